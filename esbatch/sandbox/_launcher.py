"""The sandbox's inner side, run as ``python -I -S -B _launcher.py`` by ``esbatch.sandbox`` (its configuration
arrives on stdin: an 8-byte length, then the ``marshal``-ed dict).

    evaluator -> launcher (the evaluator's PID namespace) -> init (pid 1 of a new PID namespace) -> program

The launcher enters the namespaces, forks init and turns the evaluator's SIGTERM into a SIGKILL for init; init builds
the program's file system view, forks it, reaps orphans, polls memory when no cgroup limits it, and exits with the
program's main process (the kernel then kills the rest); the program drops its privileges, takes its rlimits, execs.
Reports reach the evaluator on a status pipe the program never holds, one line each: ``init PID``, ``report HEX`` (the
file system view, ``marshal``-ed), ``error TEXT``, ``memory BYTES``, ``peak BYTES``, ``status WAITSTATUS``. Standard
library only, and only modules that load fast (no json, re or enum): an unprivileged evaluator may run this file with
a system interpreter.
"""

from __future__ import annotations

import _signal as signal  # the C module: "signal" imports enum
import ctypes
import marshal
import os
import resource

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
NAMESPACES = {"user": CLONE_NEWUSER, "pid": CLONE_NEWPID, "network": CLONE_NEWNET, "mount": CLONE_NEWNS}
NAMESPACES["ipc"] = CLONE_NEWIPC
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
# nosuid, nodev, noexec, noatime, nodiratime, relatime: the same bits in statvfs().f_flag and mount(2). A
# read-only remount must repeat them, or a user namespace refuses it (they are locked there).
KEEP_FLAGS = 0x2 | 0x4 | 0x8 | 0x400 | 0x800 | 0x1000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
HIDING_TMPFS = "size=1m,nr_inodes=64,mode=755"  # read-only once the workdir is in place
POLL_S = 0.01  # memory accounting period (no cgroup)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int, what: str) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), what)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(src), target.encode(), enc(fstype), flags, enc(data)), f"mount {target}")


def _emit(fd: int, line: str) -> None:
    """One report line; a single write below PIPE_BUF, so lines from init and the launcher never mix."""
    try:
        os.write(fd, (line.replace("\n", " ")[:3000] + "\n").encode())
    except OSError:
        pass


# ----------------------------------------------------------------------------- namespaces (the launcher)


def _flags(cfg: dict) -> int:
    names = ["pid", "mount", "ipc"] + ["network"] * cfg["new_net"] + ["user"] * cfg["new_user"]
    return sum(NAMESPACES[n] for n in names)


def _refused(cfg: dict) -> str:
    """Which namespaces the kernel refuses, each tried in a throwaway child (with a user namespace if needed)."""
    base = CLONE_NEWUSER if cfg["new_user"] else 0
    names = [n for n, flag in NAMESPACES.items() if _flags(cfg) & flag]
    refused = []
    for name in names:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if _libc.unshare(base | NAMESPACES[name]) == 0 else 1)
        if os.waitpid(pid, 0)[1] != 0:
            refused.append(f"{name} namespace")
    return ", ".join(refused) or "the namespaces together"


def _unshare(cfg: dict) -> None:
    """New namespaces for the next child; a user namespace maps our own uid and gid only."""
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(_flags(cfg)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare refused ({os.strerror(err)}): {_refused(cfg)}")
    if cfg["new_user"]:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def _wait_for_init(pid: int) -> None:
    """Relay SIGTERM as SIGKILL to init until it has exited, then reap it and exit."""

    def kill_init(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signal.SIGKILL)  # from outside the namespace, SIGKILL reaches its init
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, kill_init)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # a zombie until reaped: its pid cannot be reused
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    os.waitpid(pid, 0)
    os._exit(0)


def _read_config() -> dict:
    size = int.from_bytes(_read_exactly(0, 8), "little")
    return marshal.loads(_read_exactly(0, size))


def _read_exactly(fd: int, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the configuration was cut short")
        data += chunk
    return bytes(data)


def main() -> None:
    cfg = _read_config()
    fd = cfg["status_fd"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "pdeathsig")
    if os.getppid() != cfg["parent"]:  # the evaluator died before the line above
        os._exit(1)
    try:
        cgroup_fds = [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in cfg["cgroup_procs"]]
        oom_fd = os.open(cfg["oom_file"], os.O_RDONLY | os.O_CLOEXEC) if cfg["oom_file"] else None
        _unshare(cfg)
    except OSError as e:
        _emit(fd, f"error {e}")
        os._exit(0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # init waits for it with sigtimedwait
    pid = os.fork()
    if pid == 0:
        _init(cfg, cgroup_fds, oom_fd)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    _emit(fd, f"init {pid}")
    _wait_for_init(pid)


# ----------------------------------------------------------------------------- the file system (init)


def _under(path: str, folders: list[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def _hide(paths: list[str]) -> list[str]:
    """An empty tmpfs over each folder (parents first; a folder inside a hidden one is hidden already)."""
    hidden: list[str] = []
    for p in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        if p != "/" and not _under(p, hidden) and os.path.isdir(p):
            _mount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV, HIDING_TMPFS)
            hidden.append(p)
    return hidden


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are written as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def _read_only_except(writable: list[str]) -> None:
    """Remount every mount we can reach read-only, but ``writable``. A mount covered by another one (under a
    hidden folder) is unreachable, so it is skipped: the path then leads to a different device or nowhere."""
    with open("/proc/self/mountinfo") as f:
        entries = [line.split() for line in f]
    for fields in entries:
        path, (major, minor) = _unescape(fields[4]), map(int, fields[2].split(":"))
        if path in writable:
            continue
        try:
            if os.stat(path).st_dev != os.makedev(major, minor):
                continue
            flag = os.statvfs(path).f_flag
        except OSError:
            continue
        if not flag & MS_RDONLY:
            try:
                _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | (flag & KEEP_FLAGS))
            except OSError as e:
                if e.errno != 22:  # EINVAL: not a mount point after all (another mount lies over it)
                    raise


def _make_workdir(cfg: dict) -> None:
    """The program's working folder: a fresh tmpfs capped in bytes and inodes, holding ``main.py``."""
    workdir, uid = cfg["workdir"], cfg["uid"]
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    size = cfg["disk_bytes"] + len(cfg["code"].encode()) + 4096  # the program text is not the program's quota
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={cfg['inodes']},mode=700")
    main_py = os.path.join(workdir, "main.py")
    with open(main_py, "w", encoding="utf-8") as f:
        f.write(cfg["code"])
    if uid is not None:
        for p in (workdir, main_py):
            os.chown(p, uid, uid)


def _build_filesystem(cfg: dict) -> dict:
    """Hide the private folders, keep the interpreter visible, fresh /proc, tmpfs workdir, the rest read-only."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done below propagates back to the host
    keep = [(os.open(p, os.O_PATH | os.O_CLOEXEC), p) for p in cfg["keep"] if os.path.isdir(p)]
    hidden = _hide(cfg["hide"])
    for fd, path in keep:  # through the host's /proc, still mounted: the folder itself is covered by now
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # only this PID namespace's processes
    _make_workdir(cfg)
    # The new /proc stays writable: the program writes its own namespace's user.max_user_namespaces there
    # (see _seal_user_namespaces); every other file in it needs a capability or is the program's own.
    _read_only_except([cfg["workdir"], "/proc"])
    return {"proc": "fresh", "hidden": hidden, "visible": [p for _, p in keep]}


# ----------------------------------------------------------------------------- init (pid 1) and the program


def _drop_bounding_set() -> None:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap, "drop capabilities")


def _seal_user_namespaces() -> bool:
    """As the program's final uid: a user namespace of its own in which no further one can be made, so the
    program cannot become root of a nested one (mounting an uncapped tmpfs, unmounting nothing: the mounts it
    inherits are locked anyway). Where the kernel refuses us the namespace, it refuses the program too."""
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWUSER) != 0:
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:  # the limit of this namespace only
        f.write("0")
    return True


def _join_new_session_keyring() -> None:
    """Leave the evaluator's session keyring (possessing it would expose its keys, e.g. Kerberos tickets)."""
    keyctl = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)  # no glibc wrapper: the syscall number
    join_session_keyring, enosys = 1, 38
    if keyctl is not None and _libc.syscall(keyctl, join_session_keyring, None) < 0:
        if ctypes.get_errno() != enosys:
            _check(-1, "join a new session keyring")


def _exec_program(cfg: dict, cgroup_fds: list[int], err_fd: int) -> None:
    """In the program's process: give up everything it must not keep, then exec. Never returns."""
    try:
        os.close(cfg["status_fd"])
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for s in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(s, signal.SIG_DFL)
        try:
            for f in cgroup_fds:
                os.write(f, b"0")  # 0: the writing process
        except OSError as e:
            raise OSError(e.errno, f"joining the run's cgroup: {e.strerror}") from None
        os.setsid()
        _drop_bounding_set()
        _join_new_session_keyring()
        if cfg["uid"] is not None:  # root evaluator: a uid of its own, which keeps no capability
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
            _prctl(PR_SET_DUMPABLE, 1, "dumpable")  # else /proc/self stays root's after setuid (and exec resets it)
        if _seal_user_namespaces():  # a new namespace comes with a full bounding set: drop it again
            _drop_bounding_set()
        _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")
        os.chdir(cfg["workdir"])
        for res, soft, hard in cfg["rlimits"]:  # last: an address-space limit would hamper the code above
            resource.setrlimit(res, (soft, hard))
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])  # uid != 0: the capabilities go at exec
    except BaseException as e:
        try:
            os.write(err_fd, f"starting the program: {type(e).__name__}: {e}".encode())
        except OSError:
            pass
    os._exit(127)


def _start_program(cfg: dict, cgroup_fds: list[int]) -> tuple[int, str]:
    """Fork and exec the program; the error text of a failed start (empty once exec succeeded)."""
    rd, wr = os.pipe()  # close-on-exec: EOF without data means exec succeeded
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        _exec_program(cfg, cgroup_fds, wr)
    os.close(wr)
    for f in cgroup_fds:
        os.close(f)
    with os.fdopen(rd, "rb") as f:
        return pid, f.read().decode(errors="replace")


def _tree_memory() -> int:
    """Resident anonymous + shared memory of every process in the namespace but init (overcounts pages that
    forked children still share: the limit errs on the safe side)."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:  # gone meanwhile
            continue
        for line in status.splitlines():
            if line.startswith((b"RssAnon:", b"RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


def _reap(main_pid: int) -> int | None:
    """Reap every child that has exited (orphans of the namespace end up here); the main process's status."""
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == main_pid:
            status = st


def _oom_kills(fd: int) -> int:
    """The cgroup's OOM kill count (memory.oom_control in v1, memory.events in v2)."""
    for line in os.pread(fd, 4096, 0).decode().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def _supervise(cfg: dict, main_pid: int, oom_fd: int | None) -> None:
    """Until the main process exits or the tree goes over its memory limit (the cgroup's OOM killer struck,
    or the polled total is too high); then exit, and with init the whole namespace goes."""
    fd, limit, peak, status = cfg["status_fd"], cfg["memory_limit"], 0, None
    while status is None:
        signal.sigtimedwait([signal.SIGCHLD], POLL_S if limit or oom_fd is not None else 3600)
        status = _reap(main_pid)
        if status is None and oom_fd is not None and _oom_kills(oom_fd):
            _emit(fd, "memory cgroup")
            break
        if status is None and limit:
            used = _tree_memory()
            peak = max(peak, used)
            if used > limit:
                _emit(fd, f"memory {used}")
                break
    if limit:
        _emit(fd, f"peak {peak}")
    if status is not None:
        _emit(fd, f"status {status}")
    os._exit(0)


def _init(cfg: dict, cgroup_fds: list[int], oom_fd: int | None) -> None:
    """pid 1 of the new PID namespace. Never returns."""
    fd = cfg["status_fd"]
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "pdeathsig")  # the launcher gone: the namespace goes too
        os.umask(0o022)
        report = _build_filesystem(cfg)
        pid, err = _start_program(cfg, cgroup_fds)
    except BaseException as e:
        err = f"{type(e).__name__}: {e}"
    if err:
        _emit(fd, f"error {err}")
        os._exit(0)
    _emit(fd, f"report {marshal.dumps(report).hex()}")  # no repr: parsing it back needs compile()
    _supervise(cfg, pid, oom_fd)


if __name__ == "__main__":
    main()
