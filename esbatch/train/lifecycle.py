"""One run lifecycle for every algorithm: folder, MLflow, run.json, stop checks, checkpoints, summary.

``RunSession`` is a run from start (or resume) to its final status: it creates the run folder, opens or
reopens the MLflow run, keeps run.json (status, algorithm, budget, progress) and, whatever ends the run,
records how it ended. ``run_updates`` drives a ``Trainer`` update by update:

    restore (checkpoint + replay) -> for t in start..T: stop check, step, compare rank checksums,
    append to log.jsonl (durable first), log metrics, checkpoint every k (and snapshots), evaluate every
    k (held-out, and eval.tasks: esbatch/train/taskeval.py) -> final checkpoint and evaluation -> summary

so ES and GRPO share the same resume, logging and stop behaviour. Rank 0 writes; every rank computes. Logging a
metric appends it to the run folder's tracking spool; a thread sends it to MLflow (esbatch/tracking/writer.py):
no update waits for the store, and the watchdog never times it.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
from abc import ABC, abstractmethod
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar

from esbatch import durable
from esbatch.models import resolve_device
from esbatch.tracking import (
    MLflowTracker,
    NullTracker,
    TrackingWriter,
    dataset_input,
    dataset_source,
    default_tracking_uri,
    parent_tag,
    run_tags,
    spool_path,
)
from esbatch.train import fingerprint, stop
from esbatch.train.config import Algorithm, RunTarget, TrainConfig
from esbatch.train.lock import writer_lock
from esbatch.train.memory import keep_freed_memory
from esbatch.train.ranks import Ranks, collective_timeout_min, init_ranks
from esbatch.train.rundir import RunDir
from esbatch.train.taskeval import TaskEvals
from esbatch.train.watchdog import Watchdog, before_exit, forget

HUNG_END_WAIT_S = 5.0  # a hung run's end status: this long for the store, else the spool keeps it


class Trainer(ABC):
    """One algorithm's update step and state, driven by esbatch/train/lifecycle.py:run_updates.

    ``saved_at`` is the update whose weights the newest checkpoint holds (-1: none), kept identical on
    every rank so that collective checkpoint writes happen on all of them or none.
    """

    label: ClassVar[str] = "train"  # the progress bar's name
    saved_at: int = -1

    @abstractmethod
    def setup(self) -> int:
        """Load the model and data; return the training budget in updates."""

    @abstractmethod
    def restore(self, records: list[dict[str, Any]]) -> int:
        """Bring the weights to the newest state the run folder allows (checkpoint, then the logged updates
        if the algorithm can replay them); return how many updates they include."""

    @abstractmethod
    def step(self, t: int) -> dict[str, Any]:
        """Run update ``t``; return its log record: at least {"t": t, "metrics": {...}}."""

    @abstractmethod
    def save(self, t: int, final: bool) -> None:
        """Checkpoint the weights after ``t`` updates (called on every rank); ``final``: the run's last."""

    @abstractmethod
    def evaluate(self) -> dict[str, Any]:
        """Held-out scores of the current weights (rank 0 only): numbers, and the per-problem verdicts as a string
        (``problems.HELDOUT_CORRECT``)."""

    def generator(self) -> Any:
        """A Generator over the current weights, ready to generate (``eval.tasks``, rank 0 only); None: the
        algorithm cannot serve in-training evaluations on other tasks."""
        return None

    def center_state(self) -> dict[str, Any]:
        """A detached copy of the current weights under HF names (``checkpoint.snapshots``, rank 0 only): fp32, or
        the compute dtype for ES with es.restore: inplace."""
        raise NotImplementedError(f"{type(self).__name__} cannot keep snapshots")

    @property
    @abstractmethod
    def n_train(self) -> int:
        """Training problems (run.json keeps it, so status can recompute an epoch budget from the plan)."""

    def checksum(self) -> float | None:
        """A fingerprint of this rank's weights, compared across ranks after every update."""
        return None

    def postfix(self, metrics: dict[str, Any]) -> dict[str, str]:
        """What the progress bar shows after an update."""
        return {"reward": f"{metrics.get('reward/mean', float('nan')):.3f}"}

    def export(self, path: Path) -> None:
        """Write the trained model as an HF directory (tracking.log_model)."""
        raise NotImplementedError

    def summary(self) -> dict[str, Any]:
        """Extra fields of the run summary."""
        return {}

    def tags(self) -> dict[str, str]:
        """Extra MLflow tags of the run (e.g. how the task's code sandbox confines programs)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release engines and processes."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RunSession:
    """A run's folder, MLflow run and run.json, from start (or resume) until it ends, however it ends."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path,
        *,
        resume: bool,
        ranks: Ranks | None = None,
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        logs_updates: bool = True,
    ) -> None:
        """``logs_updates``: the folder holds this run's own log.jsonl (False for a pipeline's root, whose
        stages keep the logs), so resume cross-checks it against the checkpoints first."""
        self.cfg, self.rd, self.resume, self.logs_updates = cfg, RunDir(run_dir), resume, logs_updates
        self.ranks = ranks or Ranks()
        self.lead = self.ranks.lead
        self.run_name, self.tags = run_name or cfg.run.name, dict(tags or {})
        self.uri = cfg.tracking.uri or default_tracking_uri(cfg.run.output_dir)
        self.tracker: Any = None
        self.changes: dict[str, tuple[Any, Any]] | None = {}  # allowed config changes of this resume
        self.watchdog: Watchdog | None = None
        self.run_id: str | None = None
        self.t_start = time.perf_counter()
        self.status = "FAILED"
        self._logged = -1  # the last update step MLflow (or the spool) had when the run reopened

    # ---------------------------------------------------------------- opening and closing
    def __enter__(self) -> RunSession:
        rd = self.rd
        if self.resume and not rd.path.is_dir():
            raise FileNotFoundError(f"{rd.path}: no run to resume here (no such folder)")
        self._lock = ExitStack()
        if self.lead:  # rank 0 is the folder's one writer (esbatch/train/lock.py); the other ranks only read it
            self._lock.enter_context(writer_lock(rd.path))
            before_exit(self._hung)  # a hang ends the process: run.json and MLflow say failed first
        try:
            self._open()
        except BaseException:
            forget(self._hung)
            self._lock.close()
            raise
        return self

    def _open(self) -> None:
        rd = self.rd
        retry = rd.exists() and not self.resume and rd.never_updated()
        if retry:
            self._check_not_running()
        elif rd.exists() and not self.resume:
            raise FileExistsError(
                f"{rd.path} already holds a run. Resume it with `esbatch train --resume {rd.path}`, "
                f"or pick another name with --set run.name=..."
            )
        if (rd.path / "sweep.json").exists():
            raise FileExistsError(
                f"{rd.path} is a sweep folder (it holds sweep.json), not a run folder; pick another run.name or "
                "run.output_dir"
            )
        if self.resume and not rd.exists():
            raise FileNotFoundError(f"{rd.path}: no run to resume here (no {RunDir.CONFIG})")
        if self.resume:
            rd.read_meta()  # a damaged run.json is named now, not after the model has loaded
            self.changes = fingerprint.check(rd, self.cfg)  # a changed config is refused by every rank, at once
            if self.logs_updates:
                rd.check_resume()  # every rank reads the same files: all refuse together, before anything is cut
        self.ranks.barrier()  # every rank has looked before rank 0 writes
        if self.lead:
            rd.path.mkdir(parents=True, exist_ok=True)
            if retry:  # failed before its first update: start over (its MLflow run stays, marked FAILED)
                rd.meta.unlink(missing_ok=True)
                rd.eval_log.unlink(missing_ok=True)
                rd.log.unlink(missing_ok=True)
            if not self.resume:
                durable.write_text(rd.config, self.cfg.to_yaml())
                fingerprint.record(rd, self.cfg)
            else:
                rd.repair_log()  # only a torn last line is left to cut: check_resume refused anything else
                if self.changes is None:
                    print(
                        f"note: {rd.path} predates config fingerprints: resumed without checking its config; it is "
                        f"recorded now ({fingerprint.FILE}) and checked from the next resume on",
                        file=sys.stderr,
                    )
                if self.changes != {}:
                    fingerprint.record(rd, self.cfg)
        self.ranks.barrier()  # rank 0 has written the folder; every rank reads the same records
        if self.cfg.run.threads:
            import torch

            torch.set_num_threads(self.cfg.run.threads)
        device = self.cfg.model.device
        if self.cfg.run.keep_freed_memory and device in ("cpu", "auto") and resolve_device(device) == "cpu":
            refused = keep_freed_memory()
            if refused and self.lead:
                print(f"note: run.keep_freed_memory: {refused}", file=sys.stderr)

    def start(self, total: int, **meta: Any) -> str | None:
        """Open (or reopen) the MLflow run and mark the run running with its budget."""

        cfg = self.cfg
        if not self.lead:
            self.tracker = NullTracker()  # rank 0 holds the MLflow run
            return None
        self.tracker = MLflowTracker(  # what the store refuses waits in the run folder (tracking/spool.py)
            self.uri, cfg.tracking.experiment, Path(cfg.run.output_dir) / "mlartifacts", spool_path(self.rd.path)
        )
        tags = {
            **run_tags(),
            "algorithm": cfg.algorithm,
            "world_size": str(self.ranks.world),
            **parent_tag(cfg.tracking.parent_run_id),
            **self.tags,
        }
        previous = self.rd.read_meta().get("mlflow_run_id") if self.resume else None
        resumes = self.rd.read_meta().get("resumes", []) if self.changes else []
        if self.changes:  # budgets and bookkeeping changed on this resume: MLflow keeps its params, so a tag
            resumes = [*resumes, {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "changed": self.changes}]
            tags[f"resume.{len(resumes)}.changed"] = fingerprint.describe(self.changes)
        self.run_id = previous  # until the store reopens it: a resume that cannot still ends it (``_close``)
        self.run_id = self.tracker.start(self.run_name, cfg.params(), tags, run_id=previous)
        self._logged = self.tracker.last_step("reward/mean") if self.resume else -1
        self.tracker = TrackingWriter(self.tracker)  # from here on, writes go through the spool and a thread
        self.rd.write_meta(
            mlflow_run_id=self.run_id,
            tracking_uri=self.uri,
            algorithm=cfg.algorithm,
            total_updates=total,
            status="running",
            host=socket.gethostname(),
            pid=os.getpid(),
            **({"resumes": resumes} if self.changes else {}),
            **meta,
            drop=("reason",),  # an earlier process's failure: this one may end otherwise
        )
        if previous is None:
            self.tracker.log_artifact(self.rd.config)
        return self.run_id

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        forget(self._hung)
        with self._lock:  # released once run.json and MLflow say how the run ended
            self._close(kind, exc)

    def _hung(self, what: str) -> None:
        """The watchdog is ending the process (esbatch/train/watchdog.py): record it as every other failure is,
        run.json ``failed`` with the reason and MLflow FAILED (or the spool says it will be)."""
        limit = self.cfg.run.hang_timeout_s
        self.status = "FAILED"
        if self.rd.meta.exists():
            reason = f"hung: {what} did not finish within run.hang_timeout_s = {limit:g} s"
            self.rd.write_meta(status="failed", reason=reason, peak_rss_mb=round(peak_rss_mb(), 1))
        if isinstance(self.tracker, TrackingWriter):
            self.tracker.end("FAILED", wait_s=HUNG_END_WAIT_S)

    def _close(self, kind: type | None, exc: BaseException | None = None) -> None:
        if kind is None:
            self.status = "FINISHED"
        elif issubclass(kind, (KeyboardInterrupt, SystemExit)):  # a stop, Ctrl-C, or submitit's exit on requeue
            self.status = "KILLED"
        why = {"reason": f"{kind.__name__}: {exc}"[:2000]} if self.status == "FAILED" and kind else {}
        try:
            if self.lead and self.rd.path.exists():
                rss = round(peak_rss_mb(), 1)
                self.rd.write_meta(status=self.status.lower(), peak_rss_mb=rss, **why, drop=() if why else ("reason",))
        except BaseException:  # run.json cannot say how the run ended (a full disk, an immutable file): MLflow
            self.status = "FAILED"  # says failed, as the exit status does, instead of staying RUNNING
            raise
        finally:
            if self.tracker is not None:
                if self.tracker.run_id is None and self.run_id is not None:  # the store refused the reopening:
                    self.tracker.run_id = self.run_id  # MLflow ends as run.json says, not as the last process left it
                self.tracker.end(self.status)
            self.ranks.close(ok=self.status == "FINISHED")

    def _check_not_running(self) -> None:
        """Refuse to restart a never-updated run that a live process on this host is still setting up."""
        meta = self.rd.read_meta()
        pid, host = meta.get("pid"), meta.get("host")
        if meta.get("status") == "running" and host == socket.gethostname() and isinstance(pid, int):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            raise FileExistsError(f"{self.rd.path}: the run is starting in process {pid} on this host; wait for it")

    # ---------------------------------------------------------------- during the run
    def log(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log_metrics(metrics, step=step)

    def record_update(self, rec: dict[str, Any]) -> None:
        """The durable record first (log.jsonl, fsynced), then progress in run.json, both timed by the watchdog
        (disk writes can hang), then the metrics into the tracking spool: MLflow gets them from a thread."""
        if not self.lead:
            return
        t = rec["t"]
        with self.watchdog.phase(f"writing update {t} to the run folder") if self.watchdog else ExitStack():
            self.rd.append_update(rec)
            self.rd.write_meta(
                done=t + 1, last_reward=rec["metrics"].get("reward/mean"), peak_rss_mb=round(peak_rss_mb(), 1)
            )
        self.log({**rec["metrics"], "system/peak_rss_mb": peak_rss_mb()}, t + 1)

    def record_eval(self, t: int, scores: dict[str, Any]) -> None:
        """eval.jsonl gets every score (the per-problem verdicts too); tracking gets the numbers."""
        self.rd.append_eval({"t": t, **scores})
        self.log({k: v for k, v in scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}, t)
        if "heldout/accuracy" in scores:
            self.rd.write_meta(last_heldout=scores["heldout/accuracy"])

    def log_missing_steps(self, records: list[dict[str, Any]]) -> None:
        """Metrics of logged updates that never reached MLflow (the run died in between): each step once."""
        if not self.lead:
            return
        for r in records:
            if r["t"] + 1 > self._logged:
                self.log(r["metrics"], r["t"] + 1)

    def summary(self, total: int, **extra: Any) -> dict[str, Any]:
        evals = sorted(self.rd.evals(), key=lambda e: e["t"])
        return {
            "run_dir": str(self.rd.path),
            "algorithm": self.cfg.algorithm,
            "updates": total,
            "tracking_uri": self.uri,
            "mlflow_run_id": self.run_id,
            "experiment_id": getattr(self.tracker, "experiment_id", None),
            "wall_s": time.perf_counter() - self.t_start,
            "heldout_first": evals[0] if evals else None,
            "heldout_last": evals[-1] if evals else None,
            "peak_rss_mb": peak_rss_mb(),
            "world_size": self.ranks.world,
            **extra,
        }


def run_updates(run: RunSession, trainer: Trainer, progress: bool) -> dict[str, Any]:
    """Drive ``trainer`` from where the run folder stands to its budget (see the module docstring)."""
    try:
        total = trainer.setup()
        # Set-up is untimed; a rank that finishes it first must not spend its deadline in a collective waiting
        # for a peer still loading (or rank 0 still opening MLflow, below): the ranks meet first, untimed (the
        # barrier's own limit is the process group's: a minute past run.hang_timeout_s, esbatch/train/ranks.py).
        run.ranks.barrier()
        run.watchdog = Watchdog(run.cfg.run.hang_timeout_s)
        with run.watchdog.phase("restoring the checkpoint and replaying the log"):
            start, records = _restore(run, trainer)
        run.tags.update(trainer.tags())
        # rank 0 opens the MLflow run and logs what the store missed: untimed too (~40 s measured on a loaded
        # 2-core machine), so the ranks meet again before the timed loop
        run.start(total, n_train=trainer.n_train)
        if run.lead and getattr(trainer, "probs", None) is not None:
            run.tracker.log_inputs(dataset_inputs(run.cfg, trainer.probs))
        run.log_missing_steps(records)
        run.ranks.barrier()
        _train_loop(run, trainer, start, total, progress)
        if run.lead and run.cfg.tracking.log_model:
            if run.rd.export_t() != total:  # checkpoint.center: final has written it already
                run.rd.write_export(trainer.export, total)
            run.tracker.log_artifacts(run.rd.final_model, RunDir.FINAL_MODEL)
        if not run.lead:
            return {"run_dir": str(run.rd.path), "updates": total, "rank": run.ranks.rank}
        for f in (run.rd.log, run.rd.eval_log):
            if f.exists():
                run.tracker.log_artifact(f)
        return run.summary(total, **trainer.summary())
    finally:
        trainer.close()


def dataset_inputs(cfg: TrainConfig, probs: Any) -> list[dict[str, Any]]:
    """The problems a run trains on (context ``training``) and is scored on (``eval``) as MLflow dataset inputs:
    named ``<task>-train`` / ``<task>-heldout``, with the task's source (its data file, hub dataset, or generator
    with params and seed) and a digest of the problems themselves (esbatch/tracking/mlflow_tracker.py)."""
    task = probs.task
    out = []
    for split, context, examples in (("train", "training", probs.train), ("heldout", "eval", probs.heldout)):
        if not examples:
            continue
        source = dataset_source(
            data_path=getattr(task, "data_path", None),
            hub_id=getattr(task, "hub_id", None),
            hub_config=getattr(task, "hub_config", None),
            hub_split=getattr(task, f"{split}_split", None) or getattr(task, "split", None),
            revision=getattr(task, "revision", None),
            generator={"task": cfg.task.name, "params": cfg.task.params, "seed": cfg.run.seed},
        )
        rows = [(e.question, e.answer) for e in examples]
        out.append(dataset_input(f"{cfg.task.name}-{split}", rows, source, split, context))
    return out


def _restore(run: RunSession, trainer: Trainer) -> tuple[int, list[dict[str, Any]]]:
    """Weights as of the newest state on disk; log lines beyond what they include are set aside."""
    records = run.rd.updates() if run.resume else []
    start = trainer.restore(records)
    if start < len(records):  # updates done after the newest checkpoint by an algorithm that cannot replay them
        if run.lead:
            run.rd.discard_updates_after(start)
        records = records[:start]
    run.ranks.check_in_sync(trainer.checksum() if run.ranks.world > 1 else None, start - 1)
    return start, records


def _train_loop(run: RunSession, trainer: Trainer, start: int, total: int, progress: bool) -> None:
    from esbatch.clock import progress as tqdm  # monotonic: a clock jump moves no ETA

    cfg, rd, phase = run.cfg, run.rd, run.watchdog.phase
    done_evals = {e["t"] for e in rd.evals()} if run.lead else set()
    task_evals = TaskEvals(cfg)
    if task_evals and type(trainer).generator is Trainer.generator:
        raise NotImplementedError(f"eval.tasks: the {cfg.algorithm} trainer cannot generate for in-training evals")

    def evaluate(t: int, force: bool = False) -> None:
        due = force or (cfg.eval.every and t % cfg.eval.every == 0)
        if run.lead and due and t not in done_evals:
            with phase(f"the held-out evaluation after update {t}"):
                scores = trainer.evaluate()
            if task_evals:
                with phase(f"the evaluation on eval.tasks after update {t}"):
                    scores = {**scores, **task_evals(trainer.generator(), t)}
            if scores:
                run.record_eval(t, scores)
                if "heldout/accuracy" in scores:
                    bar.set_postfix({**post, "heldout": f"{scores['heldout/accuracy']:.3f}"})
            done_evals.add(t)

    def snapshot(t: int) -> None:
        if run.lead and t in cfg.checkpoint.snapshots:
            with phase(f"the snapshot after update {t}"):
                rd.save_center(trainer.center_state(), t, rd.snapshot(t))

    post: dict[str, str] = {}
    bar = tqdm(total=total, initial=start, desc=trainer.label, unit="upd", disable=not (progress and run.lead))
    try:
        evaluate(0, force=True)
        for t in range(start, total):
            with phase(f"the stop check before update {t} (a collective)"):
                stopping = run.ranks.any(stop.requested())  # between updates, never inside an MLflow write
            if stopping:
                raise stop.Stopped()
            with phase(f"update {t} (generation, scoring, reward exchange, weight update)"):
                rec = trainer.step(t)
            with phase(f"the rank checksum comparison after update {t} (a collective)"):
                run.ranks.check_in_sync(trainer.checksum() if run.ranks.world > 1 else None, t)
            run.record_update(rec)  # the folder's writes under their own phase; MLflow's from a thread, untimed
            if (t + 1) % cfg.checkpoint.every == 0 or t + 1 == total:
                with phase(f"the checkpoint after update {t + 1}"):
                    trainer.save(t + 1, final=t + 1 == total)
                trainer.saved_at = t + 1
            snapshot(t + 1)
            post = trainer.postfix(rec["metrics"])
            bar.set_postfix(post)
            bar.update(1)
            evaluate(t + 1, force=t + 1 == total)
        if trainer.saved_at != total:  # died after the last update was logged, before its checkpoint
            with phase(f"the checkpoint after update {total}"):
                trainer.save(total, final=True)
            trainer.saved_at = total
            snapshot(total)
        evaluate(total, force=True)  # no-op unless the final evaluation was lost the same way
    finally:
        bar.close()


class UpdateAlgorithm(Algorithm):
    """An algorithm that trains update by update: it joins the ranks, opens the run session and hands
    ``run_updates`` the ``Trainer`` it builds (ES, GRPO)."""

    @classmethod
    def run(cls, cfg: TrainConfig, target: RunTarget) -> dict[str, Any]:
        ranks = cls.join_ranks(cfg)
        t = target
        with RunSession(cfg, t.run_dir, resume=t.resume, ranks=ranks, run_name=t.run_name, tags=t.tags) as session:
            return run_updates(session, cls.trainer(cfg, session), t.progress)

    @classmethod
    def join_ranks(cls, cfg: TrainConfig) -> Ranks:
        """This process's rank and the world size (a world of one unless started by torchrun or SLURM)."""
        return init_ranks(collective_timeout_min(cfg))

    @classmethod
    @abstractmethod
    def trainer(cls, cfg: TrainConfig, session: RunSession) -> Trainer:
        """The update loop's algorithm-specific half (set-up, one update, checkpoints, evaluation)."""
