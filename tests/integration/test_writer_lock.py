"""One writer per folder (esbatch/train/lock.py): a second writer is refused at once, naming the holder, while
the first holds the lock; the kernel releases the lock when the holder dies, even by SIGKILL.

"B while A holds the lock" is true by construction: the holder is a subprocess that takes the lock, says so on
its stdout and then blocks reading its stdin until the test closes it (or kills it)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from esbatch.config import config_from_dict
from esbatch.train import lock
from esbatch.train.lifecycle import RunSession
from esbatch.train.lock import LOCK_FILE, FolderBusy, holds, writer_lock
from esbatch.train.rundir import RunFolderError

HOLDER = """
import sys
from esbatch.train.lock import writer_lock
with writer_lock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def hold(folder: Path, **env: str) -> subprocess.Popen:
    """A process holding ``folder``'s writer lock until its stdin closes; returns once it holds it."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    assert p.stdout.readline().strip() == "held"
    return p


def release(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(timeout=60) == 0


def test_second_writer_is_refused_naming_the_holder_then_proceeds(tmp_path):
    env = {"SLURM_JOB_ID": "901", "SLURM_ARRAY_JOB_ID": "900", "SLURM_ARRAY_TASK_ID": "3"}
    a = hold(tmp_path / "run", **env)
    try:
        with pytest.raises(FolderBusy) as e:
            with writer_lock(tmp_path / "run"):
                pytest.fail("entered a folder another process holds")
        msg = str(e.value)
        assert f"process {a.pid} on host {socket.gethostname()}, SLURM job 900_3 (since " in msg
        assert "only one process may write it at a time" in msg and "scancel 900_3" in msg
        assert "nothing was changed" in msg
        assert not holds(tmp_path / "run")
        who = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        assert who["pid"] == a.pid and who["slurm_job"] == "900_3"
    finally:
        release(a)
    with writer_lock(tmp_path / "run"):  # released: the second writer proceeds and names itself
        assert holds(tmp_path / "run")
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not holds(tmp_path / "run")


def test_the_kernel_releases_the_lock_of_a_killed_holder(tmp_path):
    a = hold(tmp_path / "run")
    with pytest.raises(FolderBusy, match=f"process {a.pid} "):
        with writer_lock(tmp_path / "run"):
            pass
    a.send_signal(signal.SIGKILL)
    assert a.wait(timeout=60) == -signal.SIGKILL
    with writer_lock(tmp_path / "run"):  # nothing to clean up: the lock went with the process
        pass


def test_a_message_without_a_holder_name_yet(tmp_path):
    from esbatch.train.lock import busy_message

    msg = busy_message(tmp_path, "", "run folder")
    assert "another process (it has not written its name yet)" in msg
    assert "kill 12 on h" in busy_message(tmp_path, '{"pid": 12, "host": "h", "since": "x"}', "run folder")


def test_reentrant_and_a_subfolder_is_not_blocked_by_its_parent(tmp_path):
    with writer_lock(tmp_path / "p"):
        with writer_lock(tmp_path / "p"):  # the same process again (cmd_train, then its RunSession)
            pass
        assert holds(tmp_path / "p")
    a = hold(tmp_path / "p")  # a pipeline's driver holds its folder ...
    try:
        with writer_lock(tmp_path / "p" / "stage1-es"):  # ... and its stage takes its own
            pass
    finally:
        release(a)


def test_the_run_session_holds_the_run_folder_while_open(tmp_path, tiny_model_dir):
    cfg = config_from_dict(
        {
            "run": {"name": "r", "output_dir": str(tmp_path)},
            "model": {"name": str(tiny_model_dir)},
            "es": {"updates": 1},
        }
    )
    with RunSession(cfg, tmp_path / "r", resume=False):
        assert holds(tmp_path / "r")
        probe = subprocess.run(
            [sys.executable, "-c", HOLDER, str(tmp_path / "r")], input="", capture_output=True, text=True
        )
        assert probe.returncode == 1 and f"process {os.getpid()} " in probe.stderr
    assert not holds(tmp_path / "r")
    a = hold(tmp_path / "r")
    before = {f.name: f.read_bytes() for f in (tmp_path / "r").iterdir()}
    try:  # a resume while another process writes the folder: refused before anything is read or written
        with pytest.raises(FolderBusy):
            RunSession(cfg, tmp_path / "r", resume=True).__enter__()
        assert {f.name: f.read_bytes() for f in (tmp_path / "r").iterdir()} == before
    finally:
        release(a)


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_flock_is_a_clear_error_and_no_lock_is_left_held(tmp_path, monkeypatch, err):
    """Lustre mounted noflock answers flock with an error (ENOLCK/EOPNOTSUPP); that cannot be mounted here, so
    flock is replaced by one that raises as it does."""

    def no_flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    with pytest.raises(RunFolderError, match=r"cannot take its writer lock .*-o flock") as e:
        with writer_lock(tmp_path / "run"):
            pass
    assert not isinstance(e.value, FolderBusy) and str(tmp_path / "run") in str(e.value)
    assert not holds(tmp_path / "run")


def test_a_second_eval_of_an_eval_folder_is_refused_before_it_writes(tmp_path, tiny_model_dir, capsys):
    """`esbatch eval` holds its eval folder: a second one into the same folder exits 2 naming the first."""
    from esbatch.cli import main

    cfg = {
        "name": "ev",
        "output_dir": str(tmp_path / "evals"),
        "model": {"name": str(tiny_model_dir), "dtype": "float32"},
        "sampling": {"n": 2, "max_new_tokens": 4, "batch_size": 4},
        "ks": [1, 2],
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        "tasks": [{"name": "toy:DigitTask", "params": {"size": 8}, "limit": 2}],
    }
    (tmp_path / "ev.yaml").write_text(json.dumps(cfg))
    folder = tmp_path / "evals" / "ev"
    holder = hold(folder)
    try:
        assert main(["eval", str(tmp_path / "ev.yaml"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "this eval folder is being written by process" in err and f"kill {holder.pid}" in err, err
    finally:
        release(holder)
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE]  # nothing written but the lock's file
    assert main(["eval", str(tmp_path / "ev.yaml"), "--no-progress"]) == 0
    assert (folder / "metrics.json").exists()
