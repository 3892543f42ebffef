"""What one array task (or one local subprocess) runs: train one planned run of a sweep, resuming if it can.

On SLURM the task is a submitit ``Checkpointable``: ~signal_delay_s before the time limit (or on
preemption) USR2 arrives, submitit calls ``checkpoint`` and requeues the job, and the requeued task
resumes from the run folder (fp32 center checkpoint + replay of the logged updates, bit-exact).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from esbatch.launch.state import SweepDir


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
    import submitit

    env = submitit.JobEnvironment()
    job = os.environ.get("SLURM_JOB_ID", "0")
    os.environ.update(
        RANK=str(env.global_rank),
        WORLD_SIZE=str(env.num_tasks),
        LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.hostnames[0],
        MASTER_PORT=str(20000 + int(job) % 20000),  # the same on every rank, different per job
    )


def run_task(sweep_dir: str | Path, key: str, progress: bool = False) -> dict[str, Any]:
    """Train (or continue) run ``key`` of the sweep in ``sweep_dir``; returns the trainer's summary."""
    from esbatch.config import load_config
    from esbatch.es.trainer import train

    sd = SweepDir(sweep_dir)
    meta = sd.read()
    ranks = int(os.environ.get("SLURM_NTASKS", "1"))
    entry = next((r for r in meta.get("runs", []) if r["key"] == key), None)
    if entry is None:
        raise KeyError(f"run {key} is not in the plan of {sd.meta_path}")
    cfg = load_config(str(sd.plan_path(key)))
    rd = sd.run_dir(key)
    tags = {
        "esbatch.sweep": meta["name"],
        "esbatch.run_key": key,
        "esbatch.label": entry["label"],
        **slurm_tags(),
    }
    if meta.get("tracking") == "offline":  # a private store in the run folder; `esbatch aggregate` merges it
        cfg.tracking.uri = f"sqlite:///{rd.path.resolve() / 'mlflow.db'}"
    elif meta.get("parent_run_id"):
        tags["mlflow.parentRunId"] = meta["parent_run_id"]
    if ranks > 1:
        if cfg.algorithm == "pipeline":
            raise ValueError("pipeline runs use one process; set ntasks_per_node: 1 and nodes: 1 for them")
        distributed_env_from_slurm()
    resume = rd.exists()
    if resume and os.environ.get("RANK", "0") == "0":
        rd.config.write_text(cfg.to_yaml())  # only budgets/bookkeeping can differ: the key pins the rest
    print(f"esbatch task: sweep {meta['name']} run {key} ({entry['label']}) resume={resume}", flush=True)
    if cfg.algorithm == "pipeline":
        from esbatch.pipeline import run_pipeline

        return run_pipeline(cfg, rd.path, resume=resume, progress=progress, run_name=entry["label"], tags=tags)
    if cfg.algorithm == "grpo":
        from esbatch.grpo.trainer import train_grpo

        return train_grpo(cfg, rd.path, resume=resume, progress=progress, run_name=entry["label"], tags=tags)
    return train(cfg, rd.path, resume=resume, progress=progress, run_name=entry["label"], tags=tags)


try:
    from submitit.helpers import Checkpointable, DelayedSubmission
except ImportError:  # pragma: no cover - submitit is a dependency; keep the local path importable anyway
    Checkpointable = object  # type: ignore[assignment,misc]
    DelayedSubmission = None  # type: ignore[assignment]


class SweepTask(Checkpointable):  # type: ignore[misc,valid-type]
    """The callable submitit pickles for the array: ``SweepTask(sweep_dir)(key)``."""

    def __init__(self, sweep_dir: str) -> None:
        self.sweep_dir = str(sweep_dir)

    def __call__(self, key: str) -> dict[str, Any]:
        summary = run_task(self.sweep_dir, key)
        return {k: summary.get(k) for k in ("run_dir", "updates", "mlflow_run_id", "wall_s")}

    def checkpoint(self, key: str) -> Any:
        # Everything needed is already on disk (log.jsonl is fsynced after every update), so the
        # requeued task simply runs again and resumes from the run folder.
        return DelayedSubmission(SweepTask(self.sweep_dir), key)


def aggregate_task(sweep_dir: str) -> str:
    """The job submitted with afterok on the array: merge offline stores, write tables and plots."""
    from esbatch.aggregate.collect import aggregate

    return str(aggregate(sweep_dir))


def main(argv: list[str] | None = None) -> int:
    """`python -m esbatch.launch.task SWEEP_DIR KEY`: the local launcher's subprocess entry point."""
    import signal

    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print("usage: python -m esbatch.launch.task SWEEP_DIR RUN_KEY", file=sys.stderr)
        return 2

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        run_task(args[0], args[1])
    except KeyboardInterrupt:
        print("interrupted; the next `esbatch sweep` resumes this run", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
