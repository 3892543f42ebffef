"""A run folder: everything needed to follow, evaluate and resume a run, for every algorithm.

    config.yaml           the resolved config
    log.jsonl             one line per finished update (ES: seeds, rewards, weights; every algorithm: metrics)
    eval.jsonl            held-out scores of the weights after update t
    center.safetensors    fp32 weights after update t (t in its metadata), written atomically
    run.json              status, algorithm, budget, progress, MLflow run id and tracking URI
    ds_checkpoint/        GRPO: DeepSpeed's optimizer + weights checkpoints
    stage<k>-<algo>/      pipelines: one run folder per stage
    task.log              a sweep task's output (local launcher)
    mlflow.db             offline tracking: this run's private MLflow store

Every file name is spelled here once. Readers (status, plot, aggregate) never change a file; only a
resuming trainer cuts a torn last line (``repair_log``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: `esbatch status` reads run folders without it
    import torch


class RunDir:
    CONFIG = "config.yaml"
    LOG = "log.jsonl"
    EVAL = "eval.jsonl"
    CENTER = "center.safetensors"
    META = "run.json"
    DS_CHECKPOINT = "ds_checkpoint"
    TASK_LOG = "task.log"
    STORE = "mlflow.db"
    FINAL_MODEL = "final_model"
    DISCARDED = "log.discarded.jsonl"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / self.CONFIG
        self.log = self.path / self.LOG
        self.eval_log = self.path / self.EVAL
        self.center = self.path / self.CENTER
        self.meta = self.path / self.META
        self.ds_checkpoint = self.path / self.DS_CHECKPOINT
        self.task_log = self.path / self.TASK_LOG
        self.offline_store = self.path / self.STORE
        self.final_model = self.path / self.FINAL_MODEL

    def exists(self) -> bool:
        return self.config.exists()

    def stage(self, k: int, algorithm: str) -> RunDir:
        """The folder of a pipeline's k-th stage (1-based)."""
        return RunDir(self.path / f"stage{k}-{algorithm}")

    def offline_uri(self) -> str:
        return f"sqlite:///{self.offline_store.resolve()}"

    # ---------------------------------------------------------------- append-only logs
    @staticmethod
    def _append(path: Path, record: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _read(path: Path) -> tuple[list[dict[str, Any]], int]:
        """(records, bytes of complete lines) of a JSONL file, stopping at a torn or corrupt line. Reads only."""
        if not path.exists():
            return [], 0
        out, good = [], 0
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break
                good += len(line)
        return out, good

    @staticmethod
    def _cut(path: Path, good: int) -> None:
        if path.exists() and good != path.stat().st_size:
            with open(path, "r+b") as f:
                f.truncate(good)

    def append_update(self, record: dict[str, Any]) -> None:
        self._append(self.log, record)

    def updates(self) -> list[dict[str, Any]]:
        recs, _ = self._read(self.log)
        for i, r in enumerate(recs):
            if r["t"] != i:
                raise RuntimeError(f"{self.log}: line {i + 1} is update {r['t']}, expected {i}; the log is corrupt")
        return recs

    def repair_log(self) -> None:
        """Cut a torn last line of the logs (a writer killed mid-line) so appends stay valid JSONL; trainers only."""
        for path in (self.log, self.eval_log):
            self._cut(path, self._read(path)[1])

    def discard_updates_after(self, t: int) -> None:
        """Move log lines of updates >= t (done after the newest checkpoint, so lost) to log.discarded.jsonl."""
        recs = self.updates()
        if len(recs) <= t:
            return
        for r in recs[t:]:
            self._append(self.path / self.DISCARDED, r)
        with open(self.log, "rb") as f:
            size = sum(len(next(f)) for _ in range(t))
        self._cut(self.log, size)

    def append_eval(self, record: dict[str, Any]) -> None:
        self._append(self.eval_log, record)

    def evals(self) -> list[dict[str, Any]]:
        return self._read(self.eval_log)[0]

    # ---------------------------------------------------------------- center checkpoint
    def save_center(self, state: dict[str, torch.Tensor], t: int) -> None:
        """Atomically write the fp32 center after ``t`` updates."""
        from safetensors.torch import save_file

        tmp = self.center.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"t": str(t)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.center)

    def link_center(self, source: Path) -> None:
        """Make ``source`` (a stage's center) this folder's center too: a hard link, or a copy across filesystems."""
        import shutil

        tmp = self.center.with_suffix(f".tmp{os.getpid()}")
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, self.center)

    def load_center(self) -> tuple[dict[str, torch.Tensor], int] | None:
        if not self.center.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(self.center), framework="pt") as f:
            t = int(f.metadata()["t"])
            return {k: f.get_tensor(k) for k in f.keys()}, t

    def center_t(self) -> int | None:
        """The update the saved center belongs to (reads the header only), None without a center."""
        if not self.center.exists():
            return None
        from safetensors import safe_open

        with safe_open(str(self.center), framework="pt") as f:
            return int(f.metadata()["t"])

    # ---------------------------------------------------------------- metadata
    def read_meta(self) -> dict[str, Any]:
        return json.loads(self.meta.read_text()) if self.meta.exists() else {}

    def write_meta(self, **fields: Any) -> None:
        meta = {**self.read_meta(), **fields}
        tmp = self.meta.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, self.meta)

    def progress(self) -> int:
        """Updates done: run.json's count, or the log's complete lines for folders written before it was kept."""
        meta = self.read_meta()
        if "done" in meta:
            return int(meta["done"])
        return len(self._read(self.log)[0])
