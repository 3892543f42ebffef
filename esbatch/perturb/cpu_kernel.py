"""The C kernel that draws philox noise on the CPU (noise_cpu.c): built once per source, compiler and machine
into the user's cache, loaded with ctypes, and which SIMD path (scalar, AVX2, AVX-512) it takes.

Every path gives the bits of philox.py's eager torch. Callers cut their work into kernel calls with jobs.py;
``gauss_words`` runs the Gaussian transform alone (tests: words at octave edges).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from esbatch.perturb.philox import load_table

CPU_SOURCE = Path(__file__).with_name("noise_cpu.c")
# no -march: the AVX2 path is a function-level target chosen at run time, so the cached binary runs on any x86-64
CPU_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
# the widest C kernel path allowed: 2 AVX-512, 1 AVX2, 0 scalar (every path gives the same bits)
CPU_SIMD = int(os.environ.get("ESBATCH_NOISE_SIMD", "2"))
SIMD_PATHS = ("scalar", "avx2", "avx512")


@functools.cache
def cpu_lib() -> Any:
    """The C kernel (CPU_SOURCE) as a ctypes library, built once per source and compiler into the user's cache
    (ESBATCH_NOISE_CACHE, default ~/.cache/esbatch); None (eager torch, the same bits, slower) when no C compiler
    works or ESBATCH_NOISE_FAST=0."""
    if os.environ.get("ESBATCH_NOISE_FAST", "1") == "0":
        return None
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        # the architecture too: x86-64 and arm nodes of a cluster may share a home folder (and a compiler banner)
        key = [version, " ".join(CPU_FLAGS), platform.machine()]
        tag = hashlib.sha256(CPU_SOURCE.read_bytes() + "\n".join(key).encode()).hexdigest()
        cache = Path(os.environ.get("ESBATCH_NOISE_CACHE", Path.home() / ".cache" / "esbatch"))
        lib = cache / f"noise-{tag[:16]}.so"
        if not lib.exists():
            cache.mkdir(parents=True, exist_ok=True)
            tmp = lib.with_suffix(f".tmp{os.getpid()}")
            subprocess.run([cc, *CPU_FLAGS, str(CPU_SOURCE), "-o", str(tmp), "-lm"], capture_output=True, check=True)
            os.replace(tmp, lib)  # atomic: ranks building at once all load a whole file
        dll = ctypes.CDLL(str(lib))
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(f"esbatch noise: no C kernel ({e}); drawing CPU noise with eager torch (slower)", stacklevel=2)
        return None
    u64, i64, u32, ptr, int_ = ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int
    dll.esbatch_noise.restype = None
    dll.esbatch_noise.argtypes = [u64, i64, u32, u32, ptr, int_, int_, ptr]  # start count k0 k1 table kind simd out
    dll.esbatch_gauss_words.restype = None
    dll.esbatch_gauss_words.argtypes = [ptr, i64, ptr, int_, ptr]  # words n table simd out
    dll.esbatch_noise_axpy.restype = None
    # start count k0 k1 table kind simd scale base dst
    dll.esbatch_noise_axpy.argtypes = [u64, i64, u32, u32, ptr, int_, int_, ctypes.c_float, ptr, ptr]
    dll.esbatch_noise_accumulate.restype = None
    # start count nd k0[] k1[] w[] table kind simd out
    dll.esbatch_noise_accumulate.argtypes = [u64, i64, int_, ptr, ptr, ptr, ptr, int_, int_, ptr]
    dll.esbatch_noise_update.restype = ctypes.c_double
    # start count nd k0[] k1[] w[] table kind simd scale dst
    dll.esbatch_noise_update.argtypes = [u64, i64, int_, ptr, ptr, ptr, ptr, int_, int_, ctypes.c_float, ptr]
    dll.esbatch_noise_simd.restype = int_
    dll.esbatch_noise_simd.argtypes = []
    return dll


def simd_cap() -> int:
    """CPU_SIMD as the kernel's ``simd`` argument, read at each call (tests and benchmarks set CPU_SIMD here)."""
    return int(CPU_SIMD)


def cpu_simd() -> str:
    """The C kernel path CPU draws take here: "avx512", "avx2" (what the CPU has, capped by CPU_SIMD) or "scalar"
    (also when there is no C kernel)."""
    lib = cpu_lib()
    return SIMD_PATHS[min(simd_cap(), int(lib.esbatch_noise_simd()))] if lib is not None else "scalar"


def gauss_words(words: np.ndarray, simd: int = 2) -> np.ndarray:
    """fp32 eps of given 32-bit words by the C kernel's Gaussian transform (tests: words at octave edges)."""
    lib = cpu_lib()
    if lib is None:
        raise RuntimeError("esbatch noise: no C kernel (no C compiler, or ESBATCH_NOISE_FAST=0)")
    w = np.ascontiguousarray(words, dtype=np.uint32)
    out = np.empty(w.shape, dtype=np.float32)
    lib.esbatch_gauss_words(w.ctypes.data, w.size, load_table().ctypes.data, int(simd), out.ctypes.data)
    return out
