"""A run directory: everything needed to resume a killed ES run bit-exactly.

    config.yaml          the resolved config
    log.jsonl            one line per finished update: seeds, signs, rewards, weights, metrics
    eval.jsonl           held-out scores of the center
    center.safetensors   fp32 center after update t (t in its metadata), written atomically
    run.json             MLflow run id and tracking URI

The ES state is theta_0 plus the log: a resumed run loads the newest center checkpoint and replays
the logged updates after it (no generation needed); data order and seeds are functions of t.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: `esbatch status` reads run folders without it
    import torch


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / "config.yaml"
        self.log = self.path / "log.jsonl"
        self.eval_log = self.path / "eval.jsonl"
        self.center = self.path / "center.safetensors"
        self.meta = self.path / "run.json"

    def exists(self) -> bool:
        return self.config.exists()

    # ---------------------------------------------------------------- append-only logs
    @staticmethod
    def _append(path: Path, record: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _read(path: Path) -> list[dict[str, Any]]:
        """Records of a JSONL file; a torn last line (killed mid-write) is dropped and cut off."""
        if not path.exists():
            return []
        out, good = [], 0
        with open(path, "rb") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break
                if not line.endswith(b"\n"):
                    out.pop()
                    break
                good += len(line)
        if good != path.stat().st_size:
            with open(path, "r+b") as f:
                f.truncate(good)
        return out

    def append_update(self, record: dict[str, Any]) -> None:
        self._append(self.log, record)

    def updates(self) -> list[dict[str, Any]]:
        recs = self._read(self.log)
        for i, r in enumerate(recs):
            if r["t"] != i:
                raise RuntimeError(f"{self.log}: line {i + 1} is update {r['t']}, expected {i}; the log is corrupt")
        return recs

    def append_eval(self, record: dict[str, Any]) -> None:
        self._append(self.eval_log, record)

    def evals(self) -> list[dict[str, Any]]:
        return self._read(self.eval_log)

    # ---------------------------------------------------------------- center checkpoint
    def save_center(self, state: dict[str, torch.Tensor], t: int) -> None:
        """Atomically write the fp32 center after ``t`` updates."""
        from safetensors.torch import save_file

        tmp = self.center.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"t": str(t)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.center)

    def load_center(self) -> tuple[dict[str, torch.Tensor], int] | None:
        if not self.center.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(self.center), framework="pt") as f:
            t = int(f.metadata()["t"])
            return {k: f.get_tensor(k) for k in f.keys()}, t

    # ---------------------------------------------------------------- metadata
    def read_meta(self) -> dict[str, Any]:
        return json.loads(self.meta.read_text()) if self.meta.exists() else {}

    def write_meta(self, **fields: Any) -> None:
        meta = {**self.read_meta(), **fields}
        tmp = self.meta.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, self.meta)
