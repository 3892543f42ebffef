"""A run folder: everything needed to follow, evaluate and resume a run, for every algorithm.

``RunDir`` spells every file name once (layout: docs/architecture.md, "The run folder"); center files are written
atomically with their update t in the metadata, and final_model/ holds esbatch-export.json, {"t": the update it
holds}. Readers (status, plot, aggregate) never change a file. Resume refuses to guess (``check_resume``): it
accepts a torn last line of log.jsonl (an update a kill cut short, not yet applied: redone once) and nothing else
that does not add up; only then does the trainer cut the torn line (``repair_log``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from esbatch import durable

_STAGE = re.compile(r"stage(\d+)-(\w+)")  # RunDir.stage(k, algorithm)

if TYPE_CHECKING:  # torch is imported lazily: `esbatch status` reads run folders without it
    import torch


class RunFolderError(RuntimeError):
    """A run folder whose files do not add up; the message names the file and says what to do."""


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
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


def read_json_object(path: Path, what: str, fix: str, valid: Any = None) -> dict[str, Any]:
    """A JSON object file ({} when missing); anything else is a RunFolderError naming the file, why and ``fix``.
    ``valid(obj)`` may return a further reason the object is not what it should be."""
    if not path.exists():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        obj, why = None, str(e)
    else:
        why = f"expected a JSON object, got {type(obj).__name__}"
    if isinstance(obj, dict):
        why = valid(obj) if valid else ""
        if not why:
            return obj
    raise RunFolderError(f"{path}: not {what} ({why}). {fix}")


@dataclass
class ResumePoint:
    """What a run folder holds, checked to be consistent: the updates logged and the checkpoint's update."""

    records: list[dict[str, Any]]
    torn: bool  # log.jsonl ended in a torn line: that update is redone
    center_t: int | None
    ds_step: int | None


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
    EXPORT_META = "esbatch-export.json"  # inside final_model/
    DISCARDED = "log.discarded.jsonl"
    SNAPSHOTS = "snapshots"

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
        self.snapshots = self.path / self.SNAPSHOTS

    def exists(self) -> bool:
        return self.config.exists()

    def stage(self, k: int, algorithm: str) -> RunDir:
        """The folder of a pipeline's k-th stage (1-based)."""
        return RunDir(self.path / f"stage{k}-{algorithm}")

    def stages(self) -> list[RunDir]:
        """A pipeline's stage folders (:meth:`stage`) in the order of k; [] for any other run, or a pipeline that
        has not begun a stage."""
        if not self.path.is_dir():
            return []
        found = [(int(m[1]), p) for p in self.path.iterdir() if (m := _STAGE.fullmatch(p.name)) and p.is_dir()]
        return [RunDir(p) for _, p in sorted(found)]

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
    def _cut(path: Path, good: int) -> None:
        if path.exists() and good != path.stat().st_size:
            with open(path, "r+b") as f:
                f.truncate(good)

    def append_update(self, record: dict[str, Any]) -> None:
        self._append(self.log, record)

    def updates(self) -> list[dict[str, Any]]:
        recs, _ = read_jsonl(self.log)
        for i, r in enumerate(recs):
            if not isinstance(r, dict) or r.get("t") != i:
                got = r.get("t") if isinstance(r, dict) else r
                raise RunFolderError(f"{self.log}: line {i + 1} is update {got!r}, expected {i}; the log is corrupt")
        return recs

    @staticmethod
    def _scan_strict(path: Path, what: str) -> tuple[list[dict[str, Any]], bool]:
        """(records, torn): every line must be a JSON object except a last line without its newline."""
        if not path.exists():
            return [], False
        data = path.read_bytes()
        lines = data.split(b"\n")
        torn = lines[-1] != b""  # the last write was cut short (a kill mid-append): not yet applied
        body = lines[:-1]
        out = []
        for i, line in enumerate(body, 1):
            try:
                rec = json.loads(line)
                ok = isinstance(rec, dict) and isinstance(rec.get("t"), int)
            except (json.JSONDecodeError, UnicodeDecodeError):
                ok = False
            if not ok:
                raise RunFolderError(
                    f"{path}: line {i} of {len(body)} is not a complete {what} record, and "
                    f"{len(body) - i} complete line(s) follow it, so it is not a write a kill cut short: "
                    "resume will not guess which updates the weights include. Restore the file from a backup, "
                    f"or keep the {i - 1} line(s) before it (head -n {i - 1} {path} > {path}.fixed && mv "
                    f"{path}.fixed {path}) and resume again."
                )
            out.append(rec)
        return out, torn

    def check_resume(self) -> ResumePoint:
        """Read and cross-check the log, the held-out log and the checkpoints; raise RunFolderError if they
        disagree. Reads only."""
        recs, torn = self._scan_strict(self.log, "update")
        for i, r in enumerate(recs):
            if r["t"] != i:
                raise RunFolderError(
                    f"{self.log}: line {i + 1} is update {r['t']}, expected {i}: lines are missing or out of "
                    "order. Restore the file from a backup; resume will not guess which updates were applied."
                )
        self._scan_strict(self.eval_log, "held-out")
        center_t, ds_step = self.center_t(), self.ds_step()
        ckpt = max((x for x in (center_t, ds_step) if x is not None), default=None)
        if center_t == ckpt:
            what = f"{self.center} holds update {center_t}"
        else:
            what = f"{self.ds_checkpoint} is at step {ds_step}"
        if ckpt and not self.log.exists():
            raise RunFolderError(
                f"{self.log} is missing next to a checkpoint ({what}): without the log resume cannot tell which "
                f"updates the weights include, and would apply them again. Restore {self.log.name} from a backup; "
                "or start a new run (the checkpoint stays usable for `esbatch eval`)."
            )
        if ckpt is not None and ckpt > len(recs):
            lost = " and its last line is torn" if torn else ""
            raise RunFolderError(
                f"{what}, but {self.log} records only {len(recs)} complete update(s){lost}: the checkpoint is ahead "
                "of the log, so resuming would apply logged-away updates twice. Restore the log from a backup; or "
                f"move the checkpoint aside (mv {self.center} {self.center}.ahead; GRPO: also "
                f"{self.ds_checkpoint}) and resume: ES replays the {len(recs)} logged updates from the base model "
                "bit for bit, GRPO restarts from its base model."
            )
        return ResumePoint(recs, torn, center_t, ds_step)

    def ds_step(self) -> int | None:
        """The step of GRPO's newest DeepSpeed checkpoint (its `latest` tag "step<t>"), None without one."""
        latest = self.ds_checkpoint / "latest"
        if not latest.exists():
            return None
        tag = latest.read_text().strip()
        if not tag.startswith("step") or not tag[4:].isdigit():
            raise RunFolderError(f"{latest}: expected a tag like step12, got {tag[:40]!r}; the checkpoint is damaged")
        return int(tag[4:])

    def stage_budget(self) -> int:
        """A pipeline stage's length on the pipeline's update axis: its budget as its run.json records it
        (``total_updates``, the split the pipeline gave it), so a stage stopped half-way still places the next one
        where the pipeline's own count does; a stage folder without one counts the updates it logged."""
        try:
            total = self.read_meta().get("total_updates")
        except RunFolderError:
            total = None
        if isinstance(total, int) and not isinstance(total, bool):
            return total
        return len(read_jsonl(self.log)[0])

    def never_updated(self) -> bool:
        """A run that failed before its first update: nothing to lose by starting it over."""
        stages = any(self.path.glob("stage*-*"))  # a pipeline that has begun a stage
        return not (self.updates_logged() or self.center.exists() or self.ds_checkpoint.exists() or stages)

    def updates_logged(self) -> bool:
        return self.log.exists() and self.log.stat().st_size > 0

    def repair_log(self) -> None:
        """Cut a torn last line of the logs (a writer killed mid-line) so appends stay valid JSONL; trainers only."""
        for path in (self.log, self.eval_log):
            self._cut(path, read_jsonl(path)[1])

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
        return read_jsonl(self.eval_log)[0]

    # ---------------------------------------------------------------- center checkpoint
    def save_center(self, state: dict[str, torch.Tensor], t: int, path: Path | None = None) -> None:
        """Atomically write the center after ``t`` updates (to ``path``, default center.safetensors)."""
        from safetensors.torch import save_file

        path = path or self.center
        path.parent.mkdir(parents=True, exist_ok=True)
        with durable.replacing(path) as tmp:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"t": str(t)})

    def snapshot(self, t: int) -> Path:
        """Where the center after update ``t`` is kept (snapshots/center-<t>.safetensors)."""
        return self.snapshots / f"center-{t}.safetensors"

    def snapshot_updates(self) -> list[int]:
        """The updates with a snapshot on disk, ascending."""
        if not self.snapshots.is_dir():
            return []
        ts = [p.name[len("center-") : -len(".safetensors")] for p in self.snapshots.glob("center-*.safetensors")]
        return sorted(int(t) for t in ts if t.isdigit())

    def link_center(self, source: Path) -> None:
        """Make ``source`` (a stage's center) this folder's center too: a hard link, or a copy across filesystems."""

        with durable.replacing(self.center) as tmp:
            tmp.unlink(missing_ok=True)
            try:
                os.link(source, tmp)
            except OSError:
                shutil.copyfile(source, tmp)

    def write_export(self, save: Callable[[Path], None], t: int) -> None:
        """Write final_model/ by ``save(folder)`` (e.g. save_pretrained) into a temporary folder, record the update
        it holds and swap it in, so a reader never sees a half-written model or a stale one as current."""

        tmp = self.path / f".{self.FINAL_MODEL}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save(tmp)
            (tmp / self.EXPORT_META).write_text(json.dumps({"t": t}))
        except BaseException as e:  # a full disk, a kill: no half-written folder is left behind
            shutil.rmtree(tmp, ignore_errors=True)
            os_error = durable.as_os_error(e, self.final_model)
            if os_error is not None:
                raise os_error from e
            raise
        old = self.path / f".{self.FINAL_MODEL}.old{os.getpid()}"
        if self.final_model.exists():
            os.replace(self.final_model, old)
        os.replace(tmp, self.final_model)
        shutil.rmtree(old, ignore_errors=True)

    def export_t(self) -> int | None:
        """The update final_model/ holds (None: no export, or one written without its record)."""
        meta = self.final_model / self.EXPORT_META
        try:
            t = json.loads(meta.read_text()).get("t")
        except (OSError, ValueError, AttributeError):
            return None
        return t if isinstance(t, int) else None

    def load_center(self) -> tuple[dict[str, torch.Tensor], int] | None:
        if not self.center.exists():
            return None
        with self._open_center() as f:
            return {k: f.get_tensor(k) for k in f.keys()}, self._t_of(f)

    def center_t(self) -> int | None:
        """The update the saved center belongs to (reads the header only), None without a center."""
        if not self.center.exists():
            return None
        with self._open_center("numpy") as f:  # the header alone: torch is not imported for `esbatch status`
            return self._t_of(f)

    def _open_center(self, framework: str = "pt") -> Any:
        from safetensors import safe_open

        try:
            return safe_open(str(self.center), framework=framework)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise RunFolderError(self._damaged(f"cannot be read ({type(e).__name__}: {e})")) from None

    def _t_of(self, f: Any) -> int:
        t = (f.metadata() or {}).get("t", "")
        if not t.isdigit():
            raise RunFolderError(self._damaged(f"its metadata holds no update number (t={t!r})"))
        return int(t)

    def _damaged(self, why: str) -> str:
        return (
            f"{self.center}: {why}; the file is damaged (truncated, empty or not a safetensors file). Move it aside "
            f"(mv {self.center} {self.center}.damaged) and resume: ES replays every logged update from the base "
            "model bit for bit; GRPO restores from its DeepSpeed checkpoint."
        )

    # ---------------------------------------------------------------- metadata
    def read_meta(self) -> dict[str, Any]:
        return read_json_object(
            self.meta,
            "valid run metadata",
            "It holds the run's status and MLflow run id; restore it from a backup, or delete it and resume (the "
            "run then opens a new MLflow run).",
        )

    def write_meta(self, *, drop: tuple[str, ...] = (), **fields: Any) -> None:
        """Update run.json with ``fields``; the keys in ``drop`` go (a failure's reason, once the run goes on)."""
        meta = {k: v for k, v in {**self.read_meta(), **fields}.items() if k not in drop}
        durable.write_text(self.meta, json.dumps(meta, indent=2))

    def progress(self) -> int:
        """Updates done: run.json's count, or the log's complete lines for folders written before it was kept."""
        meta = self.read_meta()
        if "done" in meta:
            return int(meta["done"])
        return len(read_jsonl(self.log)[0])
