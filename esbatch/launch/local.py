"""The local launcher: the sweep's tasks as subprocesses on this machine, ``array_parallelism`` at a time.

Same task code as on SLURM (``python -m esbatch.launch.task SWEEP KEY``), no scheduler. It runs in the
foreground with a progress display; Ctrl-C stops the tasks (each marks its run killed) and the next
``esbatch sweep`` resumes them from their checkpoints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from esbatch.launch.profile import LauncherProfile
from esbatch.launch.state import SweepDir, now


def run(
    profile: LauncherProfile, sd: SweepDir, keys: list[str], tick: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Run ``keys``; returns the submission record with each task's exit code."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in profile.container.env.items()}}
    if profile.cpus_per_task and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(profile.cpus_per_task)
    queue = list(keys)
    live: dict[str, subprocess.Popen] = {}
    codes: dict[str, int] = {}
    record = {"kind": "local", "job_id": f"local-{os.getpid()}", "keys": keys, "time": now(), "pids": {}}
    with sd.locked() as meta:  # recorded up front so `esbatch status` elsewhere sees the live pids
        meta["submissions"].append(record)
        slot = len(meta["submissions"]) - 1

    def save() -> None:
        with sd.locked() as meta:
            meta["submissions"][slot] = record

    try:
        while queue or live:
            while queue and len(live) < profile.array_parallelism:
                key = queue.pop(0)
                log_path = sd.runs / key / "task.log"
                log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(log_path, "a") as log:
                    live[key] = subprocess.Popen(
                        [sys.executable, "-m", "esbatch.launch.task", str(sd.path), key],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                record["pids"][key] = live[key].pid
                save()
            for key, proc in list(live.items()):
                if proc.poll() is not None:
                    codes[key] = proc.returncode
                    del live[key]
            if tick:
                tick()
            time.sleep(0.5)
    except KeyboardInterrupt:
        for proc in live.values():
            proc.send_signal(signal.SIGTERM)
        for key, proc in live.items():
            try:
                codes[key] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[key] = proc.wait()
        raise
    finally:
        record["exit_codes"] = codes
        save()
    return record
