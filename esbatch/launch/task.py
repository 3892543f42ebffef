"""What one array task (or one local subprocess) runs: train one planned run of a sweep, resuming if it can.

Every entry point follows the one stop policy (esbatch/train/stop.py): SIGTERM, SIGINT and, on SLURM,
USR2 only ask the trainer to stop after its current update. On SLURM, USR2 arrives ~signal_delay_s before
the time limit (or on preemption); once the run has stopped cleanly, submitit's own handler checkpoints and
requeues the job, and the requeued task resumes from the run folder (bit-exact for ES).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import submitit
import yaml
from submitit.helpers import Checkpointable

from esbatch import durable
from esbatch.analyze.threshold import ensure_thresholded
from esbatch.config import load_run_config
from esbatch.config.eval import eval_config_from_dict
from esbatch.es.config import ESConfig
from esbatch.eval.runner import evaluate
from esbatch.launch.evals import SOURCE_FILE, evaluated_updates, is_eval_key
from esbatch.launch.state import SweepDir, disk_state
from esbatch.tracking import point_tags
from esbatch.train import fingerprint, stop, train, watchdog
from esbatch.train.config import TrainConfig
from esbatch.train.lock import writer_lock
from esbatch.train.rundir import RunDir, RunFolderError


def slurm_tags() -> dict[str, str]:
    env = os.environ
    tags = {}
    if "SLURM_JOB_ID" in env:
        job = env.get("SLURM_ARRAY_JOB_ID")
        idx = env.get("SLURM_ARRAY_TASK_ID")
        tags["slurm.job_id"] = f"{job}_{idx}" if job and idx else env["SLURM_JOB_ID"]
        if job:
            tags["slurm.array_job_id"] = job
        if idx:
            tags["slurm.array_index"] = idx
        tags["slurm.node"] = env.get("SLURMD_NODENAME", "")
        tags["slurm.restarts"] = env.get("SLURM_RESTART_COUNT", "0")
    return tags


def distributed_env_from_slurm() -> None:
    """torch.distributed's env for a multi-task SLURM job: one rank per task, rendezvous on the first node."""
    env = submitit.JobEnvironment()
    job = os.environ.get("SLURM_JOB_ID", "0")
    os.environ.update(
        RANK=str(env.global_rank),
        WORLD_SIZE=str(env.num_tasks),
        LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.hostnames[0],
        MASTER_PORT=str(20000 + int(job) % 20000),  # the same on every rank, different per job
    )


def run_eval_task(sd: SweepDir, key: str, progress: bool = False) -> dict[str, Any]:
    """Evaluate (or continue evaluating) planned eval ``key``: a trained run's center or a base model.

    An eval folder that evaluated an older center of its run (trained further since) is moved aside to
    ``<key>.at<updates>``, never mixed with the new samples. Base-model evals nest under the sweep's run. An eval
    of a threshold point (tau > 0) first writes its thresholded checkpoint of the run, or reuses an intact one."""

    entry = next((e for e in sd.read().get("evals", []) if e["key"] == key), None)
    if entry is None:
        raise KeyError(f"eval {key} is not in the plan of {sd.meta_path}")
    data = yaml.safe_load(sd.eval_plan_path(key).read_text())
    folder = sd.eval_dir(key)
    if entry.get("source"):
        updates = sd.run_dir(entry["source"]).progress()
        old = evaluated_updates(folder)
        if old not in (None, updates):  # kept aside, never mixed with samples of another center
            aside = folder.with_name(f"{key}.{'damaged' if old == 'damaged' else f'at{old}'}")
            print(f"esbatch task: {folder} scored update {old}, the run is at {updates}: moved to {aside}", flush=True)
            folder.rename(aside)
        if entry.get("tau"):  # a point of the threshold curve: its checkpoint of the run's final center first
            phase = sd.read().get("threshold") or {}
            run = sd.run_dir(entry["source"]).path
            ck, written = ensure_thresholded(run, entry["tau"], phase.get("base_dtype"), phase.get("as_dtype"))
            print(f"esbatch task: {'wrote' if written else 'reusing the intact'} {ck}", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        durable.write_text(folder / SOURCE_FILE, json.dumps({"run": entry["source"], "updates": updates}))
    elif sd.read().get("tracking") != "offline":
        data.setdefault("tracking", {})["parent_run_id"] = sd.ensure_parent_run()
    cfg = eval_config_from_dict(data, str(sd.eval_plan_path(key)))
    print(f"esbatch task: sweep {sd.read()['name']} eval {key} ({entry['label']})", flush=True)
    return evaluate(cfg, progress=progress)


def keep_recorded_noise(cfg: TrainConfig, run_dir: Path) -> None:
    """A resumed run keeps the noise generator its logged updates were drawn with: the plan of a sweep written
    before ``es.noise`` existed loads with today's default, while its run folder was trained with ``legacy-cpu``
    (esbatch/config/run.py:load_run_config); replaying that log with another generator would move the center
    elsewhere without a word."""
    cfg.section(ESConfig).noise = load_run_config(run_dir).section(ESConfig).noise


def run_task(sweep_dir: str | Path, key: str, progress: bool = False) -> dict[str, Any]:
    """Train (or continue) run ``key`` of the sweep in ``sweep_dir`` (or run eval ``key``); returns the
    trainer's (or the eval's) summary."""
    sd = SweepDir(sweep_dir)
    if is_eval_key(key):
        return run_eval_task(sd, key, progress)
    meta = sd.read()
    entry = next((r for r in meta.get("runs", []) if r["key"] == key), None)
    if entry is None:
        raise KeyError(f"run {key} is not in the plan of {sd.meta_path}")
    cfg = sd.plan_config(key)
    rd = sd.run_dir(key)
    tags = {
        **point_tags(entry.get("point", {})),  # the sweep's own keys (es.population_size, method): "Group by" them
        "esbatch.sweep": meta["name"],
        "esbatch.run_key": key,
        "esbatch.label": entry["label"],
        **slurm_tags(),
    }
    if meta.get("tracking") == "offline":  # a private store in the run folder; `esbatch aggregate` merges it
        cfg.tracking.uri = rd.offline_uri()
    else:
        tags["mlflow.parentRunId"] = sd.ensure_parent_run()
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        if not cfg.algo().multi_rank:
            raise ValueError(f"{cfg.algorithm} runs use one process; set ntasks_per_node: 1 and nodes: 1 for them")
        distributed_env_from_slurm()
    lead = os.environ.get("RANK", "0") == "0"
    with writer_lock(rd.path) if lead else contextlib.nullcontext():  # rank 0 writes; the lock outlives train()
        resume = rd.exists()
        if lead and resume and finished(rd, cfg):  # another task (a second launcher) trained it meanwhile
            print(f"esbatch task: sweep {meta['name']} run {key} is already finished; nothing to do", flush=True)
            return {
                "run_dir": str(rd.path),
                "updates": rd.progress(),
                "mlflow_run_id": rd.read_meta().get("mlflow_run_id"),
            }
        if resume:
            keep_recorded_noise(cfg, rd.path)
            fingerprint.check(rd, cfg)  # a plan that changed what the updates depend on: refused, nothing written
            if lead:
                durable.write_text(rd.config, cfg.to_yaml())  # only budgets/bookkeeping differ: the key pins the rest
        print(f"esbatch task: sweep {meta['name']} run {key} ({entry['label']}) resume={resume}", flush=True)
        return train(cfg, rd.path, resume=resume, progress=progress, run_name=entry["label"], tags=tags)


def finished(rd: RunDir, plan: TrainConfig) -> bool:
    """The run folder says finished with the plan's whole budget done (read under the run's writer lock)."""
    return disk_state(rd, plan)[0] == "finished"


class SweepTask(Checkpointable):
    """The callable submitit pickles for the array: ``SweepTask(sweep_dir)(key)``.

    submitit's default ``checkpoint`` (resubmit the same call) is all a requeue needs: everything else is
    on disk, and the requeued task resumes from the run folder.
    """

    def __init__(self, sweep_dir: str) -> None:
        self.sweep_dir = str(sweep_dir)

    def __call__(self, key: str) -> dict[str, Any]:
        requeue = signal.getsignal(signal.SIGUSR2)  # submitit's checkpoint-and-requeue handler
        stop.install((signal.SIGTERM, signal.SIGINT, signal.SIGUSR2))
        if callable(requeue):
            watchdog.before_exit(lambda what: requeue_after_hang(SweepDir(self.sweep_dir), key, requeue))
        try:
            summary = run_task(self.sweep_dir, key)
        except stop.Stopped:
            if stop.received(signal.SIGUSR2) and callable(requeue):
                requeue(signal.SIGUSR2, None)  # the run stopped cleanly: now checkpoint, requeue and exit
            raise
        return {k: summary.get(k) for k in ("run_dir", "updates", "mlflow_run_id", "wall_s")}


def requeue_after_hang(sd: SweepDir, key: str, requeue: Any) -> None:
    """A hung run (esbatch/train/watchdog.py) requeues its task through submitit, at most the launcher
    profile's max_requeues times per run (counted in run.json), so a run that hangs every time ends failed."""
    if os.environ.get("RANK", "0") != "0":
        return  # rank 0 requeues the job; the others just exit
    rd = sd.run_dir(key)
    n, limit = int(rd.read_meta().get("hang_requeues", 0)), int(sd.read().get("max_requeues", 3))
    if n >= limit:
        print(f"esbatch: run {key} hung {n + 1} times; not requeued (max_requeues: {limit})", file=sys.stderr)
        return
    rd.write_meta(hang_requeues=n + 1, status="interrupted")
    print(f"esbatch: requeueing the task after the hang ({n + 1} of at most {limit})", file=sys.stderr, flush=True)
    requeue(signal.SIGUSR2, None)  # checkpoint, `scontrol requeue`, then SystemExit


class CLIJob:
    """A job that runs ``esbatch ARGS`` with the job's own interpreter (the aggregator after the array)."""

    def __init__(self, *args: str) -> None:
        self.args = list(args)

    def __call__(self) -> str:
        p = subprocess.run([sys.executable, "-m", "esbatch", *self.args], capture_output=True, text=True)
        sys.stdout.write(p.stdout)
        sys.stderr.write(p.stderr)
        if p.returncode:
            raise RuntimeError(f"esbatch {' '.join(self.args)} exited with {p.returncode}")
        return p.stdout


def main(argv: list[str] | None = None) -> int:
    """`python -m esbatch.launch.task SWEEP_DIR KEY`: the local launcher's subprocess entry point."""
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print("usage: python -m esbatch.launch.task SWEEP_DIR RUN_KEY", file=sys.stderr)
        return 2
    stop.install()
    try:
        run_task(args[0], args[1])
    except RunFolderError as e:  # another writer holds the run folder, or the folder is damaged: say so, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the next `esbatch sweep` resumes this run", file=sys.stderr)
        return 130
    finally:
        stop.settle()
    return 0


if __name__ == "__main__":
    sys.exit(main())
