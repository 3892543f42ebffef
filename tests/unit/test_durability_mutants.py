"""The run lock and the durable writes, pinned where planted faults survived the other tests (issue 44 D6,
mutmut 3.8.1 on esbatch/durable.py and esbatch/train/lock.py).

Everything here is in-process and by construction: "another process holds the lock" is a second open file
description of the same ``.lock`` file flocked by the test (flock locks belong to the open file description, so the
kernel refuses the writer exactly as it refuses another process), "an ancestor holds it" is ``ESBATCH_LOCK_HELD``
naming this process's real parent, or a made-up process tree under ``lock.PROC``, and the order of a durable
write's steps is recorded by an injected ``os.fsync`` / ``os.replace`` that name the file or folder behind each fd.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import socket
from pathlib import Path

import pytest

from esbatch import durable
from esbatch.train import fingerprint, lock
from esbatch.train.lock import HELD_ENV, LOCK_FILE, FolderBusy, holds, writer_lock
from esbatch.train.rundir import RunDir, RunFolderError

# ---------------------------------------------------------------------------------------------- helpers


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class Other:
    """Another writer holding ``folder``'s lock: its own open file description of the lock file, flocked."""

    def __init__(self, folder: Path, text: bytes = b"") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.fd: int | None = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            raise
        if text:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text, 0)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def other():
    held: list[Other] = []

    def take(folder: Path, text: bytes = b"") -> Other:
        held.append(Other(folder, text))
        return held[-1]

    yield take
    for o in held:
        o.close()


@pytest.fixture(autouse=True)
def _no_inherited_lock(monkeypatch):
    monkeypatch.delenv(HELD_ENV, raising=False)
    for k in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(k, raising=False)
    assert lock._held == {}
    yield
    assert lock._held == {}, "a lock is still recorded as held after its block"


def tree(root: Path, parents: dict[int, int], comm: str = "python3") -> None:
    """A made-up /proc: ``parents[pid]`` is pid's parent (field 4 of /proc/<pid>/stat; field 5, the process group,
    is set apart from it)."""
    for pid, ppid in parents.items():
        (root / str(pid)).mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} {ppid + 1000} {ppid + 2000} 0 -1\n")


# ---------------------------------------------------------------------------------------------- the lock itself


def test_the_lock_file_names_its_holder_and_only_that(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "900")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    folder = tmp_path / "a" / "b" / "run"  # parents made
    folder.mkdir(parents=True)
    (folder / LOCK_FILE).write_bytes(b"x" * 5000)  # a longer previous holder's text: truncated, not overwritten
    old = os.umask(0o022)
    try:
        with writer_lock(folder):
            raw = (folder / LOCK_FILE).read_text()
            assert raw.endswith("}\n") and raw.count("\n") == 1
            who = json.loads(raw)
            assert who["pid"] == os.getpid() and who["host"] == socket.gethostname()
            assert who["slurm_job"] == "900_3"
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", who["since"])
            assert set(who) == {"pid", "host", "since", "slurm_job"}
            assert holds(folder) and holds(tmp_path / "a" / "b" / ".." / "b" / "run")
    finally:
        os.umask(old)
    assert not holds(folder)
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()  # the file stays, with its name


def test_a_new_lock_file_is_created_rw_for_its_owner_and_read_only_for_others(tmp_path):
    old = os.umask(0)
    try:
        with writer_lock(tmp_path / "new" / "run"):
            assert (tmp_path / "new" / "run").is_dir()
            assert (tmp_path / "new" / "run" / LOCK_FILE).stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


@pytest.mark.parametrize(
    "env, job",
    [
        ({"SLURM_ARRAY_JOB_ID": "900", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "901"}, "900_3"),
        ({"SLURM_ARRAY_JOB_ID": "900", "SLURM_JOB_ID": "901"}, "901"),  # no task id: the plain job
        ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "901"}, "901"),
        ({"SLURM_JOB_ID": "901"}, "901"),
        ({"SLURM_ARRAY_JOB_ID": "900", "SLURM_ARRAY_TASK_ID": "3"}, "900_3"),
        ({}, None),
        ({"SLURM_JOB_ID": ""}, None),
    ],
)
def test_holder_identity_names_the_slurm_job(monkeypatch, env, job):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    who = lock.holder_identity()
    assert who.get("slurm_job") == job
    assert who["pid"] == os.getpid() and who["host"] == socket.gethostname()
    assert set(who) == {"pid", "host", "since"} | ({"slurm_job"} if job else set())


def test_the_lock_is_reentrant_and_counts_its_depth(tmp_path, other):
    folder = tmp_path / "run"
    key = str(folder.resolve())
    with writer_lock(folder):
        fd = lock._held[key][0]
        assert lock._held[key] == [fd, 1]
        with writer_lock(tmp_path / "x" / ".." / "run"):  # the same folder by another spelling
            assert lock._held[key] == [fd, 2]
            with writer_lock(folder):
                assert lock._held[key] == [fd, 3]
            assert lock._held[key] == [fd, 2]
        assert lock._held[key] == [fd, 1] and holds(folder)
        with pytest.raises(BlockingIOError):  # still held by us after the inner blocks ended
            other(folder)
    assert not holds(folder)
    other(folder).close()  # released: another writer gets it at once


def test_an_exception_in_a_reentered_block_keeps_the_outer_hold(tmp_path):
    folder = tmp_path / "run"
    key = str(folder.resolve())
    with writer_lock(folder):
        with pytest.raises(ValueError), writer_lock(folder):
            raise ValueError("inner")
        assert lock._held[key][1] == 1 and holds(folder)
    assert not holds(folder)


def test_a_busy_folder_is_refused_naming_its_holder_and_leaks_nothing(tmp_path, other):
    folder = tmp_path / "run"
    text = json.dumps({"pid": 4242, "host": "node7", "since": "2026-01-02T03:04:05", "slurm_job": "77_1"}) + "\n"
    other(folder, text.encode())
    before = open_fds()
    with pytest.raises(FolderBusy) as e:
        with writer_lock(folder, "sweep folder"):
            pytest.fail("entered a folder another writer holds")
    assert str(e.value) == lock.busy_message(folder, text, "sweep folder")
    assert "this sweep folder is being written by process 4242 on host node7, SLURM job 77_1 (since " in str(e.value)
    assert "scancel 77_1" in str(e.value)
    assert open_fds() == before and not holds(folder)
    assert (folder / LOCK_FILE).read_text() == text  # the refused writer changed nothing


def test_a_busy_folder_whose_lock_file_is_not_text_is_refused_without_a_name(tmp_path, other):
    folder = tmp_path / "run"
    other(folder, b"\xff\xfe{not json")
    with pytest.raises(FolderBusy, match=r"another process \(it has not written its name yet\)"):
        with writer_lock(folder):
            pass


def test_only_the_first_4096_bytes_of_the_holders_text_are_read(tmp_path, other, monkeypatch):
    folder = tmp_path / "run"
    other(folder, b"{}")
    reads = []
    real = os.pread

    def pread(fd, n, offset):
        reads.append((n, offset))
        return real(fd, n, offset)

    monkeypatch.setattr(lock.os, "pread", pread)
    with pytest.raises(FolderBusy):
        with writer_lock(folder):
            pass
    assert reads == [(4096, 0)]


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_flock_is_named_and_leaks_no_fd(tmp_path, monkeypatch, err):
    def no_flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    before = open_fds()
    with pytest.raises(RunFolderError) as e:
        with writer_lock(tmp_path / "run"):
            pass
    assert type(e.value) is RunFolderError
    assert str(e.value).startswith(
        f"{tmp_path / 'run'}: cannot take its writer lock ({tmp_path / 'run' / LOCK_FILE}: {os.strerror(err)})."
    )
    assert open_fds() == before and not holds(tmp_path / "run")


def test_an_interrupt_while_taking_the_lock_leaks_no_fd(tmp_path, monkeypatch):
    class Interrupt(BaseException):
        pass

    def interrupted(fd, op):
        raise Interrupt

    monkeypatch.setattr(lock.fcntl, "flock", interrupted)
    before = open_fds()
    with pytest.raises(Interrupt):
        with writer_lock(tmp_path / "run"):
            pass
    assert open_fds() == before


def test_the_flock_asked_for_is_exclusive_and_non_blocking(tmp_path, monkeypatch):
    ops = []
    real = fcntl.flock
    monkeypatch.setattr(lock.fcntl, "flock", lambda fd, op: (ops.append(op), real(fd, op))[1])
    with writer_lock(tmp_path / "run"):
        pass
    assert ops == [fcntl.LOCK_EX | fcntl.LOCK_NB]


def test_a_failure_writing_the_holders_name_releases_the_lock_and_says_why(tmp_path, monkeypatch, other):
    def full(fd, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock.os, "ftruncate", full)
    before = open_fds()
    with pytest.raises(OSError) as e:
        with writer_lock(tmp_path / "run"):
            pytest.fail("the block ran without the holder's name written")
    assert e.value.errno == errno.ENOSPC  # the cause, not a KeyError from the bookkeeping
    assert open_fds() == before and not holds(tmp_path / "run")
    monkeypatch.undo()
    other(tmp_path / "run").close()  # the kernel's lock went with the fd


def test_the_lock_is_released_when_the_block_raises(tmp_path, other):
    with pytest.raises(KeyError), writer_lock(tmp_path / "run"):
        raise KeyError("x")
    assert not holds(tmp_path / "run")
    other(tmp_path / "run").close()


# ---------------------------------------------------------------------------------------------- the busy message


def test_the_busy_message_word_for_word():
    raw = json.dumps({"pid": 12, "host": "h1", "since": "S", "slurm_job": "5_2"})
    assert lock.busy_message(Path("/r"), raw, "run folder") == (
        "/r: this run folder is being written by process 12 on host h1, SLURM job 5_2 (since S); only one process "
        "may write it at a time. Wait for that process to end or stop it (scancel 5_2), then run this command "
        "again; nothing was changed (the kernel releases the lock when its holder exits)."
    )
    assert lock.busy_message(Path("/r"), '{"pid": 12, "host": "h1", "since": "S"}', "eval folder") == (
        "/r: this eval folder is being written by process 12 on host h1 (since S); only one process may write it "
        "at a time. Wait for that process to end or stop it (kill 12 on h1), then run this command again; nothing "
        "was changed (the kernel releases the lock when its holder exits)."
    )


@pytest.mark.parametrize(
    "raw, holder, stop",
    [
        ('{"pid": 12}', "process 12 on host ? (since ?)", "kill 12 on ?"),
        ('{"pid": 12, "slurm_job": ""}', "process 12 on host ? (since ?)", "kill 12 on ?"),
        ("", "another process (it has not written its name yet)", "stop it"),
        ("not json", "another process (it has not written its name yet)", "stop it"),
        ("[12]", "another process (it has not written its name yet)", "stop it"),
        ('{"host": "h"}', "another process (it has not written its name yet)", "stop it"),
        ('"pid and host"', "another process (it has not written its name yet)", "stop it"),  # JSON, not a mapping
    ],
)
def test_the_busy_message_for_a_partial_or_missing_name(raw, holder, stop):
    msg = lock.busy_message(Path("/r"), raw, "run folder")
    assert f"being written by {holder}; only one" in msg and f"stop it ({stop}), then" in msg


# ------------------------------------------------------------------------------------------ a lock held by an ancestor


def test_held_env_names_this_process_and_the_resolved_folder(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    assert lock.held_env("link") == {HELD_ENV: f"{os.getpid()}:{(tmp_path / 'real').resolve()}"}
    assert list(lock.held_env("link")) == ["ESBATCH_LOCK_HELD"]


def test_a_lock_held_by_the_parent_covers_exactly_its_folder(tmp_path, monkeypatch, other):
    """The parent process (this test's real parent) holds ``run``'s lock for us: we enter ``run`` without taking
    it (another holder is ignored), and nothing else: not its parent folder, a sibling, nor a subfolder."""
    run, sibling, sub = tmp_path / "sweep" / "run", tmp_path / "sweep" / "run2", tmp_path / "sweep" / "run" / "s1"
    for f in (run, sibling, tmp_path / "sweep"):
        other(f, b'{"pid": 99, "host": "h"}')
    monkeypatch.setenv(HELD_ENV, f"{os.getppid()}:{run.resolve()}")
    with writer_lock(tmp_path / "sweep" / "x" / ".." / "run"):  # its parent's lock covers us: no flock, no name
        assert not holds(run)
        assert (run / LOCK_FILE).read_text() == '{"pid": 99, "host": "h"}'
    for f in (sibling, tmp_path / "sweep"):
        with pytest.raises(FolderBusy, match="process 99 on host h"), writer_lock(f):
            pass
    with writer_lock(sub):  # a subfolder takes its own lock (a pipeline's stage)
        assert holds(sub) and json.loads((sub / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_an_inherited_lock_creates_no_lock_file(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv(HELD_ENV, f"{os.getppid()}:{run.resolve()}")
    with writer_lock(run):
        assert run.is_dir() and not (run / LOCK_FILE).exists()


@pytest.mark.parametrize("pid", ["self", "nonsense", "", "-1", "0"])
def test_a_lock_named_for_a_process_that_is_no_ancestor_is_taken_for_real(tmp_path, monkeypatch, other, pid):
    run = tmp_path / "run"
    other(run)
    monkeypatch.setenv(HELD_ENV, f"{os.getpid() if pid == 'self' else pid}:{run.resolve()}")
    with pytest.raises(FolderBusy), writer_lock(run):
        pass


def test_a_folder_with_a_colon_in_its_name_is_matched_whole(tmp_path, monkeypatch, other):
    run = tmp_path / "a:b" / "r:1"
    other(run)
    monkeypatch.setenv(HELD_ENV, f"{os.getppid()}:{run.resolve()}")
    with writer_lock(run):
        assert not holds(run)


@pytest.fixture
def proc(tmp_path, monkeypatch):
    """A made-up process tree: this process's parent is 100, whose parents are 101, 102, ... (``tree``)."""
    root = tmp_path / "proc"
    root.mkdir()
    monkeypatch.setattr(lock, "PROC", root)
    monkeypatch.setattr(lock.os, "getppid", lambda: 100)
    return root


def test_an_ancestor_up_to_eight_levels_up_holds_the_lock_and_not_further(proc):
    tree(proc, {100 + i: 101 + i for i in range(12)})  # 100 -> 101 -> ... -> 112
    assert lock._pid_is_ancestor("100")  # the parent
    assert lock._pid_is_ancestor("101")  # torchrun: esbatch -> torch.distributed.run -> rank
    assert lock._pid_is_ancestor("107")  # the eighth level up
    assert not lock._pid_is_ancestor("108")
    assert not lock._pid_is_ancestor("111")
    assert not lock._pid_is_ancestor("99")  # not in the chain


def test_the_walk_reads_the_parent_field_past_a_command_name_with_parentheses(proc):
    tree(proc, {100: 101, 101: 102}, comm="a) b) S 7 7")  # a process may name itself anything
    assert lock._pid_is_ancestor("102")
    assert not lock._pid_is_ancestor("7")


@pytest.mark.parametrize("chain_to", [1, 0])
def test_the_walk_stops_at_init(proc, chain_to):
    tree(proc, {100: chain_to, 1: 1, 0: 0})
    assert not lock._pid_is_ancestor(str(chain_to))  # init (or the kernel) is nobody's lock holder
    assert lock._pid_is_ancestor("100")


def test_a_chain_through_pid_2_is_followed(proc):
    tree(proc, {100: 2, 2: 3, 3: 1})
    assert lock._pid_is_ancestor("2") and lock._pid_is_ancestor("3")


@pytest.mark.parametrize("stat", [None, "100 (p) S", "100 (p) S x 5", "no parenthesis"])
def test_an_unreadable_parent_ends_the_walk_with_no(proc, stat):
    if stat is not None:
        (proc / "100").mkdir()
        (proc / "100" / "stat").write_text(stat)
    assert lock._pid_is_ancestor("100")  # the parent itself needs no read
    assert not lock._pid_is_ancestor("101")


@pytest.mark.parametrize("pid", ["", "abc", "-100", "1.0", " 100"])
def test_a_pid_that_is_not_a_number_is_no_ancestor(proc, pid):
    tree(proc, {100: 101})
    assert not lock._pid_is_ancestor(pid)


# ---------------------------------------------------------------------------------------------- durable writes


class Recorder:
    """Records the steps of a durable write in order: each fsync names the file or folder behind its fd."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[tuple] = []
        self.fsync_fails: set[str] = set()
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            name = os.readlink(f"/proc/self/fd/{fd}")
            self.steps.append(("fsync", name, Path(name).read_bytes() if Path(name).is_file() else None))
            if name in self.fsync_fails:
                raise OSError(errno.EINVAL, "Invalid argument")
            real_fsync(fd)

        def replace(src, dst) -> None:
            self.steps.append(("replace", str(src), str(dst)))
            real_replace(src, dst)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize(
    "write",
    [lambda p: durable.write_text(p, "new"), lambda p: durable.write_bytes(p, b"new")],
    ids=["write_text", "write_bytes"],
)
def test_a_replace_is_preceded_by_an_fsync_of_the_file_and_followed_by_one_of_its_folder(tmp_path, monkeypatch, write):
    target = tmp_path / "d" / "run.json"
    target.parent.mkdir()
    target.write_text("old")
    rec = Recorder(monkeypatch)
    fds = open_fds()
    write(target)
    tmp = str(tmp_path / "d" / f"run.json.tmp{os.getpid()}")
    assert rec.steps == [
        ("fsync", tmp, b"new"),  # the new bytes are on disk before the rename makes them the file
        ("replace", tmp, str(target)),
        ("fsync", str(tmp_path / "d"), None),  # then the rename itself
    ]
    assert target.read_text() == "new" and sorted(p.name for p in target.parent.iterdir()) == ["run.json"]
    assert open_fds() == fds


def test_open_text_and_replacing_fsync_in_the_same_order(tmp_path, monkeypatch):
    target = tmp_path / "t.csv"
    rec = Recorder(monkeypatch)
    with durable.open_text(target, newline="") as f:
        f.write("a,b\r\n")
    with durable.replacing(tmp_path / "m.bin") as tmp:
        tmp.write_bytes(b"lib")
    assert [s[0] for s in rec.steps] == ["fsync", "replace", "fsync"] * 2
    assert rec.steps[0][2] == b"a,b\r\n" and rec.steps[3][2] == b"lib"
    assert rec.steps[2][1] == rec.steps[5][1] == str(tmp_path)
    assert target.read_bytes() == b"a,b\r\n"


def test_no_fsync_of_the_folder_when_the_block_fails(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    with pytest.raises(ValueError), durable.replacing(tmp_path / "x") as tmp:
        tmp.write_text("half")
        raise ValueError
    assert rec.steps == [] and list(tmp_path.iterdir()) == []


def test_a_folder_that_refuses_fsync_still_gets_the_file_and_leaks_no_fd(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    rec.fsync_fails.add(str(tmp_path))
    fds = open_fds()
    durable.write_text(tmp_path / "f", "new")
    assert (tmp_path / "f").read_text() == "new" and [s[0] for s in rec.steps] == ["fsync", "replace", "fsync"]
    assert open_fds() == fds


def test_a_folder_that_cannot_be_opened_still_gets_the_file(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    real_open = os.open

    def no_dir_open(path, flags, *a):
        if Path(path) == tmp_path:
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_dir_open)
    durable.write_text(tmp_path / "f", "new")
    assert (tmp_path / "f").read_text() == "new" and [s[0] for s in rec.steps] == ["fsync", "replace"]


def test_the_folder_is_opened_read_only(tmp_path, monkeypatch):
    opened = []
    real_open = os.open

    def spy(path, flags, *a):
        opened.append((str(path), flags))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", spy)
    durable._fsync_folder(tmp_path)
    assert opened == [(str(tmp_path), os.O_RDONLY)]


def test_a_file_fsync_failure_is_the_write_failing_named_for_the_target(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    tmp = str(durable.tmp_path(tmp_path / "f"))
    rec.fsync_fails.add(tmp)
    (tmp_path / "f").write_text("old")
    with pytest.raises(OSError) as e:
        durable.write_text(tmp_path / "f", "new")
    assert e.value.errno == errno.EINVAL and e.value.filename == str(tmp_path / "f")
    assert (tmp_path / "f").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    assert [s[0] for s in rec.steps] == ["fsync"]


def test_the_tmp_file_is_beside_the_target_named_by_this_process():
    assert durable.tmp_path("/a/b/run.json") == Path(f"/a/b/run.json.tmp{os.getpid()}")
    assert durable.tmp_path(Path("x")) == Path(f"x.tmp{os.getpid()}")


@pytest.mark.parametrize(
    "filename, named",
    [(None, "target"), ("tmp", "target"), ("/elsewhere/other", "/elsewhere/other")],
)
def test_an_os_error_in_the_block_names_the_target_unless_it_named_another_file(tmp_path, filename, named):
    target = tmp_path / "f"
    tmp = durable.tmp_path(target)
    with pytest.raises(OSError) as e, durable.replacing(target):
        raise OSError(errno.ENOSPC, "No space left on device", {"tmp": str(tmp)}.get(filename, filename))
    assert e.value.filename == (str(target) if named == "target" else named)
    assert type(e.value) is OSError and e.value.__cause__ is None


def test_a_library_error_that_gives_only_an_os_error_in_its_message_becomes_that_os_error(tmp_path):
    target = tmp_path / "model.safetensors"
    with pytest.raises(OSError) as e, durable.replacing(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("I/O error: No space left on device (os error 28)")
    assert (e.value.errno, e.value.strerror, e.value.filename) == (28, os.strerror(28), str(target))
    assert isinstance(e.value.__cause__, RuntimeError) and list(tmp_path.iterdir()) == []
    assert durable.as_os_error(RuntimeError("no errno here"), target) is None
    assert durable.as_os_error(OSError(5, "x"), target) is None
    assert durable.as_os_error(OSError(5, "I/O error (os error 28)"), target) is None  # already an OSError
    assert durable.as_os_error(RuntimeError("(os error 5)"), "p").args == (5, os.strerror(5))


def test_an_error_without_an_errno_passes_unchanged(tmp_path):
    err = KeyError("k")
    with pytest.raises(KeyError) as e, durable.replacing(tmp_path / "f"):
        raise err
    assert e.value is err


def test_text_writes_pass_encoding_and_newline(tmp_path):
    durable.write_text(tmp_path / "a", "é\n", encoding="latin-1", newline="\r\n")
    assert (tmp_path / "a").read_bytes() == b"\xe9\r\n"
    durable.write_text(tmp_path / "b", "é\n")
    assert (tmp_path / "b").read_bytes() == "é\n".encode()
    with durable.open_text(tmp_path / "c", encoding="utf-16") as f:
        f.write("x")
    assert (tmp_path / "c").read_bytes() == "x".encode("utf-16")
    assert durable.write_text(tmp_path / "d", "") == tmp_path / "d"
    assert durable.write_bytes(str(tmp_path / "e"), b"") == tmp_path / "e"


# ---------------------------------------------------------------------------------------------- the fingerprint


@dataclasses.dataclass
class _Section:
    root: Path = Path("/data/x")
    n: int = 3


@dataclasses.dataclass
class _Cfg:
    sec: _Section = dataclasses.field(default_factory=_Section)
    name: str = "r"


def test_a_default_that_json_cannot_write_is_compared_as_its_text():
    """check() compares a key a later esbatch added with its default as flat_values writes values (str for what
    JSON cannot write): the defaults must be written the same way."""
    assert fingerprint._defaults(_Cfg()) == {"sec.root": "/data/x", "sec.n": 3, "name": "r"}


def test_a_change_is_described_as_json_values_and_quoted_text():
    assert fingerprint.describe({"a.b": (None, True), "c": ("x", "y"), "d": ([1, 2], 2.5)}) == (
        "a.b: null -> true; c: 'x' -> 'y'; d: [1, 2] -> 2.5"
    )
    assert fingerprint.describe({}) == ""


@dataclasses.dataclass
class _Flat:
    """A config whose resolved dict holds a key its schema does not describe (``extra``) and a value JSON cannot
    write (a Path)."""

    name: str = "r"
    extra: object = dataclasses.field(default=None, metadata={"internal": True})
    root: object = dataclasses.field(default=None, metadata={"internal": True})

    def to_dict(self) -> dict:
        return {"name": self.name, "extra": self.extra, "where": {"root": self.root}}


def test_flat_values_write_what_json_cannot_as_text():
    assert fingerprint.flat_values(_Flat(root=Path("/data/x"))) == {"name": "r", "extra": None, "where.root": "/data/x"}


def _fingerprinted(tmp_path, values: dict) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir(parents=True)
    fingerprint.path(rd).write_text(json.dumps({"sha256": "x", "values": values}))
    return rd


def test_a_key_that_appears_at_null_with_no_default_is_a_change(tmp_path):
    rd = _fingerprinted(tmp_path, {"name": "r", "where.root": None})
    with pytest.raises(RunFolderError, match=r"\(extra: \(unset\) -> null\)"):
        fingerprint.check(rd, _Flat())


def test_a_key_that_vanishes_from_null_is_a_change(tmp_path):
    rd = _fingerprinted(tmp_path, {"name": "r", "extra": None, "where.root": None, "gone": None})
    with pytest.raises(RunFolderError, match=r"\(gone: null -> \(unset\)\)"):
        fingerprint.check(rd, _Flat())


def test_a_refused_resume_names_the_keys_it_may_change_and_what_to_do(tmp_path):
    rd = _fingerprinted(tmp_path, {"name": "q", "extra": None, "where.root": None})
    keys = fingerprint.resume_overridable()
    with pytest.raises(RunFolderError) as e:
        fingerprint.check(rd, _Flat())
    assert str(e.value) == (
        f"{rd.path}: the config differs from the one its updates were made with (name: 'q' -> 'r'); a resume may "
        f"change only budgets and bookkeeping: {', '.join(sorted(keys))}. Undo the change (in {rd.config} or "
        "--set), or start a new run with it. Nothing was changed."
    )


def test_a_fingerprint_whose_values_are_not_a_mapping_says_so(tmp_path):
    rd = _fingerprinted(tmp_path, [1])  # type: ignore[arg-type]
    with pytest.raises(RunFolderError) as e:
        fingerprint.check(rd, _Flat())
    assert str(e.value) == (
        f"{fingerprint.path(rd)}: not a valid config fingerprint ('values' is not a mapping). Restore it from a "
        "backup, or delete it to resume without the check (it is written again from the config the run continues "
        "with)."
    )
