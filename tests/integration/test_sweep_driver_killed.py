"""A local sweep whose driver (`esbatch sweep`) is SIGKILLed leaves no task training unsupervised (Linux).

Each task asks the kernel for SIGTERM when its driver dies (esbatch/launch/local.py, ``_SUPERVISED``), the graceful
stop: the run ends after its update, marked killed and resumable. The kill lands while the task is inside its
second update by construction: its scorer waits at a gate (tests/gate.py), and goes on only once its stop flag is
set. The test process is a child subreaper meanwhile, so the orphaned task is reparented to it and its exit status
can be read. The only clock is a generous limit for the task to exit; meanwhile nothing else signals it.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from gate import Gate, gate_path
from toy import gated, logged, run_esbatch, spawn_esbatch, toy_config

from esbatch.launch.local import _SUPERVISED

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

UPDATES = 3
EXIT_LIMIT_S = 180.0  # the task finishes its update, writes run.json and the store: seconds
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


@contextmanager
def subreaper() -> Iterator[None]:
    """Orphaned descendants are reparented to this process (not init) meanwhile, so it can wait for them."""
    libc = ctypes.CDLL(None, use_errno=True)
    old = ctypes.c_int(0)
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(old), 0, 0, 0)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, old.value, 0, 0, 0)


def wait_adopted(pid: int, limit_s: float = EXIT_LIMIT_S) -> int | None:
    """The exit code of ``pid`` (an orphan adopted by this process; -N: killed by signal N), or None if it is
    still running after ``limit_s``: a blocking wait for its exit, bounded by an alarm, no polling."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(max(1, int(limit_s)))
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except TimeoutError:
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def write_sweep(tmp: Path, model_dir: Path, gate: str) -> Path:
    """One run, waiting at ``gate`` inside its second update (the first logged)."""
    base = gated(toy_config(model_dir, heldout=2, es_updates=UPDATES, checkpoint={"every": 1}), gate, 1)
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = {
        "name": "orphan",
        "base": "base.yaml",
        "output_dir": str(tmp / "out"),
        "grid": {"es.population_size": [4]},
        "launcher": "local",
    }
    path = tmp / "orphan.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


def ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@contextmanager
def driver_killed_mid_update(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[Gate, Path, Path, int]]:
    """Start `esbatch sweep`, wait until its task is inside its second update, SIGKILL the driver; yields (the gate, the
    sweep file, the run folder, the task's pid). The task, still waiting at the gate, is this process's child then;
    whatever happens, it is gone when the block ends."""
    gate = gate_path()
    path = write_sweep(tmp_path, tiny_model_dir, gate)
    sd = tmp_path / "out" / "orphan"
    task = None
    with subreaper(), Gate(gate) as g:
        driver = spawn_esbatch("sweep", str(path))
        try:
            (tag,) = g.arrivals(1)
            task = int(tag.split()[0])
            (sub,) = json.loads((sd / "sweep.json").read_text())["submissions"]
            (key,) = sub["keys"]
            assert sub["pids"] == {key: task} and ppid(task) == driver.pid  # the launcher's own child
            driver.kill()
            driver.wait(timeout=60)
            assert driver.returncode == -signal.SIGKILL
            assert ppid(task) == os.getpid()  # orphaned: adopted by this process, still waiting at the gate
            yield g, path, sd / "runs" / key, task
        finally:
            if driver.poll() is None:
                driver.kill()
            driver.communicate(timeout=60)
            if task is not None:
                kill_and_reap(task)  # the task that never stopped (the failing case), not left behind


def test_a_sigkilled_sweep_driver_stops_its_local_task_gracefully(tmp_path, tiny_model_dir):
    with driver_killed_mid_update(tmp_path, tiny_model_dir) as (g, path, run, task):
        g.release(stopped=True)  # it goes on only once its stop flag is set: by the SIGTERM the driver's death sent
        code = wait_adopted(task)
        assert code is not None, f"the task (pid {task}) still runs {EXIT_LIMIT_S:.0f} s after its driver was killed"
    log = (run / "task.log").read_text()
    assert code == 130, log[-3000:]  # the graceful stop's exit code (esbatch/launch/task.py)
    assert "SIGTERM: stopping after the current update" in log, log[-3000:]
    assert "interrupted; the next `esbatch sweep` resumes this run" in log, log[-3000:]
    assert json.loads((run / "run.json").read_text())["status"] == "killed"
    assert logged(run) == 2  # the first update and the one it was in: it stopped after that, not inside it

    again = run_esbatch("sweep", str(path), timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "1 resume from their folders" in again.stdout and "1 runs: 1 finished" in again.stdout, again.stdout
    assert logged(run) == UPDATES


def test_a_rerun_beside_a_surviving_task_starts_no_second_writer(tmp_path, tiny_model_dir):
    """While the driver's task is still finishing its update after the driver died, a re-run of the sweep leaves
    it alone: its pid in sweep.json says it runs. And when sweep.json does not name it (a driver killed between
    starting the task and recording its pid), the run folder's writer lock refuses the re-run's task (exit 2,
    naming the holder), having written nothing."""
    with driver_killed_mid_update(tmp_path, tiny_model_dir) as (g, path, run, task):
        sd = run.parent.parent
        p = run_esbatch("sweep", str(path), timeout=900)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        assert "skipping 1 running" in p.stdout and "nothing to submit." in p.stdout, p.stdout

        meta = json.loads((sd / "sweep.json").read_text())
        meta["submissions"][0]["pids"] = {}  # the survivor is not recorded: only the lock stands in the way
        (sd / "sweep.json").write_text(json.dumps(meta))
        before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file() and f.name != "task.log"}
        p = run_esbatch("sweep", str(path), timeout=900)
        assert p.returncode == 1, (p.stdout + p.stderr)[-3000:]
        assert f"run {run.name} exited with 2; its log: {run / 'task.log'}" in p.stdout, p.stdout
        log = (run / "task.log").read_text()
        assert f"is being written by process {task} " in log, log[-3000:]
        after = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file() and f.name != "task.log"}
        assert after == before  # the re-run's task changed nothing in the folder

        g.release(stopped=True)
        code = wait_adopted(task)
        assert code == 130, f"the surviving task ended with {code}"
    assert logged(run) == 2
    again = run_esbatch("sweep", str(path), timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "1 runs: 1 finished" in again.stdout, again.stdout
    assert logged(run) == UPDATES


def test_a_task_whose_driver_died_before_it_asked_for_the_signal_does_not_start(tmp_path):
    """The race the parent-pid check closes: a driver dead before the task's prctl never sends the signal, and its
    task finds another parent (here: this test's parent, not the task's, stands for the dead driver). It exits 130
    without becoming the task; with its real parent it becomes the task."""
    marker = tmp_path / "started"
    task = ["-c", f"open({str(marker)!r}, 'w').close()"]
    dead = os.getppid()
    gone = subprocess.run([sys.executable, "-c", _SUPERVISED, str(dead), *task], capture_output=True, text=True)
    assert gone.returncode == 130 and not marker.exists(), gone.stderr
    assert f"the sweep driver (pid {dead}) ended before this task started; not starting it" in gone.stderr
    ok = subprocess.run([sys.executable, "-c", _SUPERVISED, str(os.getpid()), *task], capture_output=True)
    assert ok.returncode == 0 and marker.exists(), ok.stderr
