"""A vLLM worker extension that stops answering once, for tests/vllm_cpu/test_vllm_hang.py (selected with
backend.worker_extension: toy_vllm:HangingWorkerExtension; imported inside the engine's worker process).

Set in the environment of the run (the engine inherits it): ESBATCH_TEST_HANG_MARKER, a file; the
call to es_perturb after the first ESBATCH_TEST_HANG_AFTER (counted per worker process), if the file exists,
writes the worker's pid and its parent's (the EngineCore process) into ``<marker>.pid``, deletes the marker (so the
resumed run does not hang again) and then never returns (ESBATCH_TEST_HANG_IN=rpc) or lets that RPC return
and never finishes the next forward pass (=generate)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from esbatch.backends.vllm_worker import ESWorkerExtension


def _forever(*_: Any, **__: Any) -> None:
    threading.Event().wait()


class HangingWorkerExtension(ESWorkerExtension):
    def es_perturb(self, seed: int, scale: float) -> dict[str, Any]:
        self.hang_calls = getattr(self, "hang_calls", 0) + 1
        marker = Path(os.environ.get("ESBATCH_TEST_HANG_MARKER", "/nonexistent"))
        if self.hang_calls > int(os.environ.get("ESBATCH_TEST_HANG_AFTER", "0")) and marker.exists():
            Path(f"{marker}.pid").write_text(f"{os.getpid()} {os.getppid()}")
            marker.unlink()
            if os.environ.get("ESBATCH_TEST_HANG_IN", "rpc") == "rpc":
                _forever()
            self.execute_model = _forever  # the worker's own method, which vLLM calls by name for every step
        return super().es_perturb(seed, scale)
