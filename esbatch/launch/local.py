"""The local launcher: the sweep's tasks as subprocesses on this machine, ``array_parallelism`` at a time.

Same task code as on SLURM (``python -m esbatch.launch.task SWEEP KEY``), no scheduler. It runs in the
foreground with a progress display. A stop (Ctrl-C, SIGTERM; esbatch/train/stop.py) is passed on to the
running tasks once, which stop between updates and mark their runs killed; no new task starts, and the
next ``esbatch sweep`` resumes them from their folders.

A driver that dies without passing the stop on (SIGKILL, the OOM killer) leaves no task running unsupervised on
Linux: each task asks the kernel for SIGTERM when its driver dies (``PR_SET_PDEATHSIG``, ``_SUPERVISED``), the same
graceful stop. Without prctl (not Linux) a task outlives its driver: sweep.json names it (its submission's
``pids``) and SIGTERM (``kill PID``; ``esbatch cancel`` where /proc exists) stops it the same way. Either way a run
folder has one writer: a re-run of the sweep leaves a task it sees alive alone, and a task it starts beside an
unrecorded survivor exits 2 (folder busy) at the run's writer lock (esbatch/train/lock.py), having written nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from esbatch.launch.base import Launcher
from esbatch.launch.state import SweepDir, now
from esbatch.train import stop

# What the local launcher runs in place of ``python -m esbatch.launch.task`` on Linux (argv: the driver's pid, then
# the task's python arguments): ask the kernel to send SIGTERM when the driver dies, then become the task (execv keeps
# the request; the task's own handler, esbatch/train/stop.py, makes it the graceful stop that marks the run killed).
# A wrapper, not preexec_fn, which is not safe in a process with threads. The classic race: a driver that died before
# prctl ran sends nothing, so the parent pid is checked after it; a changed one means the driver is gone: the task
# is not started. SIGTERM before the task has installed its handler (while it imports) ends it at once, before it
# has written anything. Standard library only: it starts in milliseconds.
_SUPERVISED = """\
import ctypes, os, signal, sys
driver, task = int(sys.argv[1]), sys.argv[2:]
PR_SET_PDEATHSIG = 1
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
    print(f"esbatch: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(ctypes.get_errno())}): this task goes on if the "
          "sweep driver dies (esbatch cancel stops it)", file=sys.stderr, flush=True)
if os.getppid() != driver:
    print(f"esbatch: the sweep driver (pid {driver}) ended before this task started; not starting it",
          file=sys.stderr, flush=True)
    sys.exit(130)
os.execv(sys.executable, [sys.executable, *task])
"""


class LocalLauncher(Launcher):
    kind: ClassVar[str] = "local"
    foreground: ClassVar[bool] = True

    def __init__(self, profile: Any, tick: Callable[[], None] | None = None) -> None:
        super().__init__(profile)
        self.tick = tick

    def submit(
        self, sd: SweepDir, name: str, keys: list[str], after: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Run ``keys`` (a key in ``after`` once its dependency exited 0); returns the submission record with
        each task's exit code and the keys ``held_back`` because their dependency failed."""
        record = {"kind": "local", "job_id": f"local-{os.getpid()}", "keys": keys, "time": now(), "pids": {}}
        record["token"] = os.urandom(8).hex()  # which entry of sweep.json is this one (save_submission)
        if after:
            record["after"] = dict(after)
        with sd.locked() as meta:  # recorded up front so `esbatch status` elsewhere sees the live pids
            meta.setdefault("submissions", []).append(record)

        def save() -> None:
            save_submission(sd, record)

        codes: dict[str, int] = {}
        try:
            self._run(sd, keys, record, codes, save)
        finally:
            record["exit_codes"] = codes
            save()
        stop.check()  # the tasks were told to stop: say so (exit 130), after the record is saved
        return [record]

    def _run(self, sd: SweepDir, keys: list[str], record: dict, codes: dict, save: Callable[[], None]) -> None:
        queue, live, told = list(keys), {}, False
        after = record.get("after", {})
        while queue or live:
            while len(live) < self.profile.array_parallelism and not stop.requested():
                key = self._next(queue, after, codes, live, record)
                if key is None:
                    break
                live[key] = self._start(sd, key)
                record["pids"][key] = live[key].pid
                save()
            if stop.requested() and not told:
                for proc in live.values():
                    proc.send_signal(signal.SIGTERM)  # each task stops after its current update
                told, queue = True, []
            for key, proc in list(live.items()):
                if proc.poll() is not None:
                    codes[key] = proc.returncode
                    del live[key]
            if self.tick:
                self.tick()
            for _ in range(10):  # 0.5 s between polls, but a stop is passed on to the tasks within 50 ms
                if stop.requested() and not told:
                    break
                time.sleep(0.05)

    @staticmethod
    def _next(queue: list[str], after: dict, codes: dict, live: dict, record: dict) -> str | None:
        """The first queued key whose dependency (if any) ended with exit 0; drops those whose dependency
        failed (recorded as ``held_back``)."""
        for key in list(queue):
            dep = after.get(key)
            if dep is None or codes.get(dep) == 0:
                queue.remove(key)
                return key
            if dep in codes or (dep not in live and dep not in queue):
                queue.remove(key)  # its training failed (or was never started here): the eval cannot run
                record.setdefault("held_back", []).append(key)
        return None

    def _start(self, sd: SweepDir, key: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in self.profile.container.env.items()}}
        if self.profile.cpus_per_task and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(self.profile.cpus_per_task)
        log_path = sd.task_log(key)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "esbatch.launch.task", str(sd.path), key]
        if sys.platform.startswith("linux"):  # the task gets SIGTERM when the driver dies (_SUPERVISED)
            # The kernel sends it when the *thread* that forked the task ends, not the process: this one, which runs
            # submit() (the main thread under `esbatch sweep`) and leaves it only once every task it started has
            # ended, so the signal comes only when the driver dies, or when submit() ends by an exception with tasks
            # still running (nobody would watch them either). Never start tasks from a short-lived thread.
            cmd = [sys.executable, "-c", _SUPERVISED, str(os.getpid()), *cmd[1:]]
        with open(log_path, "a") as log:
            return subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def states(self, sd: SweepDir, submissions: list[dict[str, Any]]) -> dict[str, str]:
        out: dict[str, str] = {}
        for sub in submissions:
            for key, pid in sub.get("pids", {}).items():
                if _alive(pid):
                    out[key] = "RUNNING"
        return out

    def cancel(self, sd: SweepDir, submissions: list[dict[str, Any]]) -> None:
        """Stop the launcher (it starts nothing more) and its tasks: each stops after its current update."""
        for sub in submissions:
            launcher = int(sub["job_id"].removeprefix("local-"))
            for pid, what in [
                (launcher, b"esbatch"),
                *((p, b"esbatch.launch.task") for p in sub.get("pids", {}).values()),
            ]:
                if _alive(pid, what):
                    os.kill(pid, signal.SIGTERM)

    def describe(self, sd: SweepDir, name: str, n_tasks: int) -> str:
        return f"would run {n_tasks} task(s) here, {self.profile.array_parallelism} at a time (nothing run)"


def save_submission(sd: SweepDir, record: dict[str, Any]) -> bool:
    """Replace this launcher's submission in sweep.json, found by its token, not by position: a
    sweep folder deleted and started afresh while this launcher was still stopping holds another launcher's
    submission at the same index, which a positional write overwrote (the live sweep then looked interrupted
    and `esbatch cancel` found nothing to stop). When the submission is gone, nothing is written."""
    with sd.locked() as meta:
        subs = meta.setdefault("submissions", [])
        for i, sub in enumerate(subs):
            if sub.get("token") == record["token"]:
                subs[i] = record
                return True
    print(
        f"warning: {sd.meta_path} no longer holds submission {record['job_id']} of {record['time']} (the sweep "
        "folder was replaced while this launcher ran): its exit codes are not recorded there",
        file=sys.stderr,
    )
    return False


def _alive(pid: int, what: bytes = b"esbatch.launch.task") -> bool:
    """A live esbatch process (a task by default) with this pid, not a recycled pid of another program."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return what in cmd
