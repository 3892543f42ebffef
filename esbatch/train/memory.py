"""Keep freed memory in the process: glibc's allocator told (mallopt) not to hand large blocks back to the kernel.

By default glibc serves every block over 32 MB with its own mmap and unmaps it when it is freed, and gives the top
of its heap back once more than 128 KB of it is free. A training step on CPU allocates and frees the same
activations every step, so every step faults them in again: 3.2M page faults per GRPO step for SmolLM2 at
B=8 x G=8 (docs/benchmarks.md). Where faults are dear (a VM that reports free pages to its host, as the test
machine does) that is seconds of system time per step, and more in a larger process, such as one with a vLLM
engine in it. ``keep_freed_memory()`` raises the mmap threshold to 1 GiB and turns trimming off, so a freed block
stays in the heap for the next step: the process keeps its peak (a higher RSS), and faults stop after the first
steps. It changes no value a run computes, only where its memory comes from. CUDA tensors are not glibc's.

Only the calling process, from the call on; blocks already mapped are unmapped as before, and so is a block over 64 MB
(an arena's heap) that a thread other than the main one takes (the trainer's steps, and an in-process engine's, run
in the main thread). Where the C library is not glibc (musl, macOS) nothing is changed and the call says so.
"""

from __future__ import annotations

import ctypes

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks of 1 GiB and over are still mapped, and unmapped when freed
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the largest, trimming never triggers


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> str | None:
    """Tell glibc to keep freed blocks under 1 GiB in the process. None when done; else why not, in words."""
    libc = _glibc()
    if libc is None:
        return "the C library is not glibc: its allocator is left as it is"
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return "glibc refused mallopt(M_MMAP_THRESHOLD): its allocator is left as it is"
    if not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return "glibc refused mallopt(M_TRIM_THRESHOLD): large blocks are kept, the heap's top is still trimmed"
    return None
