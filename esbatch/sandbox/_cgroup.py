"""Per-run cgroups: the program's whole process tree limited together in memory and number of processes.

Each run gets a child cgroup of the evaluator's own (so whatever limits the evaluator also limits its
programs): cgroup v2 where the memory and pids controllers can be enabled for children there (or in the
folder named by ``ESBATCH_SANDBOX_CGROUP``, e.g. one delegated by systemd), else cgroup v1 ``memory`` and
``pids`` hierarchies where we may create folders (root). ``None`` where neither can be had: the sandbox then
falls back to its own accounting (see ``_launcher._tree_memory``).
"""

from __future__ import annotations

import itertools
import os
import re
import time
from contextlib import suppress
from dataclasses import dataclass
from functools import cache

PREFIX = "esbatch-sbx"
_counter = itertools.count()
_disabled = False


@dataclass
class RunCgroup:
    version: int
    dirs: list[str]  # v2: one folder; v1: the memory folder, then the pids one

    @property
    def oom_file(self) -> str:
        """Where the cgroup counts its OOM kills (``oom_kill N``)."""
        return os.path.join(self.dirs[0], "memory.events" if self.version == 2 else "memory.oom_control")

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files the program's process writes itself into."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def usage(self) -> tuple[int | None, int]:
        """(peak memory in bytes if known, number of OOM kills)."""
        mem = self.dirs[0]
        peak_file = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        peak = None
        with suppress(OSError, ValueError):
            peak = int(_read(os.path.join(mem, peak_file)))
        kills = 0
        with suppress(OSError, ValueError):
            m = re.search(r"^oom_kill (\d+)", _read(self.oom_file), re.M)
            kills = int(m.group(1)) if m else 0
        return peak, kills

    def remove(self) -> None:
        """Remove the folders; the namespace is dead by now, but its last processes may take a moment to go."""
        for d in self.dirs:
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for v2) -> our cgroup's path, from /proc/self/cgroup."""
    found = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            found[c] = path
    return found


def _mounts() -> dict[str, str]:
    """Controller (or "" for cgroup2) -> where its hierarchy is mounted."""
    found = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        pre, _, post = line.partition(" - ")
        fstype, _, options = post.split()[:3]
        if fstype == "cgroup2":
            found.setdefault("", pre.split()[4])
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in ("memory", "pids"):
                    found.setdefault(opt, pre.split()[4])
    return found


def _sweep(parent: str) -> None:
    """Remove our folders left by evaluators that died (empty once their processes are gone)."""
    with suppress(OSError):
        for name in os.listdir(parent):
            m = re.fullmatch(rf"{PREFIX}-(\d+)-\d+", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                with suppress(OSError):
                    os.rmdir(os.path.join(parent, name))


def _v2_parent() -> str | None:
    """A cgroup2 folder whose children get the memory and pids controllers, or None."""
    own, mounts = _own_cgroups(), _mounts()
    parent = os.environ.get("ESBATCH_SANDBOX_CGROUP") or (mounts[""] + own[""] if "" in mounts and "" in own else None)
    if not parent or not os.access(parent, os.W_OK):
        return None
    try:
        enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
        if not {"memory", "pids"} <= set(enabled):
            if own.get("") == "/" and not os.environ.get("ESBATCH_SANDBOX_CGROUP"):
                return None  # the machine's root cgroup: not ours to change
            # refused where the folder has processes of its own (cgroup v2 has none but in leaves)
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
    except OSError:
        return None
    return parent


def _v1_parents() -> list[str] | None:
    own, mounts = _own_cgroups(), _mounts()
    if not all(c in own and c in mounts for c in ("memory", "pids")):
        return None
    parents = [mounts[c] + own[c] for c in ("memory", "pids")]
    return parents if all(os.access(p, os.W_OK) for p in parents) else None


def disable() -> None:
    """No cgroups from now on (the program could not join one): init's accounting instead."""
    global _disabled
    _disabled = True


@cache
def _parents() -> tuple[int, list[str]] | None:
    """Where per-run cgroups can be made: (version, parent folders), checked by making and removing one."""
    for version, parents in ((2, [_v2_parent()]), (1, _v1_parents())):
        if parents and all(parents):
            for p in parents:
                _sweep(p)
            probe = RunCgroup(version, [os.path.join(p, f"{PREFIX}-{os.getpid()}-probe") for p in parents])
            try:
                for d in probe.dirs:
                    os.mkdir(d)
            except OSError:
                continue
            finally:
                probe.remove()
            return version, parents
    return None


def mode() -> str | None:
    """ "cgroup v2" / "cgroup v1 (memory, pids)", or None where per-run cgroups cannot be made here."""
    found = None if _disabled else _parents()
    return None if found is None else {2: "cgroup v2 (memory, pids)", 1: "cgroup v1 (memory, pids)"}[found[0]]


def create(memory_bytes: int, max_procs: int) -> RunCgroup | None:
    """A fresh cgroup capped at ``memory_bytes`` (no swap) and ``max_procs`` tasks, or None (no cgroups)."""
    found = None if _disabled else _parents()
    if found is None:
        return None
    version, parents = found
    cg = RunCgroup(version, [os.path.join(p, f"{PREFIX}-{os.getpid()}-{next(_counter)}") for p in parents])
    try:
        for d in cg.dirs:
            os.mkdir(d)
        if version == 2:
            settings = {"memory.max": memory_bytes, "memory.swap.max": 0, "memory.oom.group": 1, "pids.max": max_procs}
            folders = dict.fromkeys(settings, cg.dirs[0])
        else:
            settings = {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes}
            settings["pids.max"] = max_procs
            folders = {**dict.fromkeys(settings, cg.dirs[0]), "pids.max": cg.dirs[1]}
        for name, value in settings.items():
            path = os.path.join(folders[name], name)
            if os.path.exists(path) or name in ("memory.max", "memory.limit_in_bytes", "pids.max"):
                _write(path, str(value))  # the memory and pids limits are required, the others where present
    except OSError:
        cg.remove()
        raise
    return cg
