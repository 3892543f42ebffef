"""The calling thread's NUMA memory policy (Linux set_mempolicy/get_mempolicy), kept across code that changes it.

vLLM's CPU worker binds the memory of the thread that builds it to one NUMA node, strictly
(``torch.ops._C.init_cpu_memory_env``: numa_set_membind + numa_set_strict). In an engine process of its own that
is its business; an engine in the trainer's process (backend.policy_engine: in_process) builds its worker in the
trainer's main thread, whose every later allocation (activations, gradients, optimizer state) would then be
confined to the engine's node on a machine of several. ``kept()`` gives the thread its policy back after the engine
starts. Threads started inside the block inherit the binding; the trainer's torch threads exist before its engine
does (its model and optimizer are built first). On the one-node test machine the binding changes no placement,
and the training step's time was the same with and without it, within the run-to-run spread (docs/benchmarks.md).

On a machine without the system calls (not Linux, or an architecture not in SYSCALLS) the policy is left as is.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
from collections.abc import Iterator

# (get_mempolicy, set_mempolicy) system call numbers per machine (the kernel's syscall tables)
SYSCALLS = {"x86_64": (239, 238), "aarch64": (236, 237), "ppc64le": (260, 261), "s390x": (269, 270)}
WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)
MASK_BITS = 4096  # at least the kernel's possible node count (nr_node_ids), or get_mempolicy fails with EINVAL
MODES = {
    0: "default",
    1: "preferred",
    2: "bind",
    3: "interleave",
    4: "local",
    5: "preferred_many",
    6: "weighted_interleave",
}

Policy = tuple[int, tuple[int, ...]]  # (mode with its flags, nodes)


def _calls() -> tuple[ctypes.CDLL, int, int] | None:
    nums = SYSCALLS.get(platform.machine()) if os.name == "posix" and platform.system() == "Linux" else None
    if nums is None:
        return None
    return ctypes.CDLL(None, use_errno=True), *nums


def _mask() -> ctypes.Array:
    return (ctypes.c_ulong * (MASK_BITS // WORD_BITS))()


def current() -> Policy | None:
    """The calling thread's memory policy: (mode, nodes), or None where it cannot be read here."""
    calls = _calls()
    if calls is None:
        return None
    libc, get_nr, _ = calls
    mode, mask = ctypes.c_int(0), _mask()
    if libc.syscall(get_nr, ctypes.byref(mode), mask, MASK_BITS, None, 0) != 0:
        raise OSError(ctypes.get_errno(), f"get_mempolicy: {os.strerror(ctypes.get_errno())}")
    nodes = tuple(i for i in range(MASK_BITS) if mask[i // WORD_BITS] >> (i % WORD_BITS) & 1)
    return mode.value, nodes


def apply(policy: Policy) -> None:
    """Make ``policy`` (as current() returns it) the calling thread's memory policy."""
    calls = _calls()
    if calls is None:
        raise OSError(f"set_mempolicy: not available on {platform.system()} {platform.machine()}")
    libc, _, set_nr = calls
    mode, nodes = policy
    if not nodes:  # default and local take no nodes
        rc = libc.syscall(set_nr, mode, None, 0)
    else:
        mask = _mask()
        for n in nodes:
            mask[n // WORD_BITS] |= 1 << (n % WORD_BITS)
        rc = libc.syscall(set_nr, mode, mask, MASK_BITS + 1)  # maxnode counts one past the last bit (libnuma's use)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy({describe(policy)}): {os.strerror(err)}")


def describe(policy: Policy | None) -> str:
    """``bind:0``, ``default``: as numactl and /proc/<pid>/numa_maps spell a policy."""
    if policy is None:
        return "unknown"
    mode, nodes = policy
    name = MODES.get(mode & 0xFF, f"mode {mode}")
    return f"{name}:{','.join(map(str, nodes))}" if nodes else name


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Run the block, then give the calling thread back the memory policy it had before it (module docstring).
    Where the policy cannot be read or set (a container whose seccomp profile refuses the calls without
    CAP_SYS_NICE: EPERM), the block runs all the same and stderr says what was left as is."""
    try:
        before = current()
    except OSError as e:
        print(f"note: the NUMA memory policy is left as the vLLM engine sets it ({e})", file=sys.stderr)
        before = None
    try:
        yield
    finally:
        try:
            if before is not None and current() != before:
                apply(before)
        except OSError as e:
            print(f"note: the NUMA memory policy could not be restored to {describe(before)} ({e})", file=sys.stderr)
