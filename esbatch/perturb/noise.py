"""Seeded ES directions eps(seed, tensor name), rebuilt on demand where the tensor lives (config ``es.noise``).

``philox-gauss`` (default), ``philox-rademacher``: eps of element i, a pure function of (seed, name, i), is

    w = word i % 4 of Philox4x32-10(counter = i // 4, key = tensor_seed(seed, name))
    gauss: (-1)^(w >> 31) * z(w & 0x7FFFFFFF)        rademacher: -1 if w >> 31 else +1

with z read from a committed fixed-point quantile table (``TABLE_FILE``, sha256-checked) in integer arithmetic, so
every device and backend draws the same bits (C kernel ``CPU_SOURCE`` on CPU, ``_blocks`` via torch.compile on CUDA,
eager torch otherwise; chunks of ``CHUNK``). ``legacy-cpu``: torch.randn on a CPU generator seeded with tensor_seed,
whole tensors; runs recorded without ``es.noise`` load as it. Our choice: the paper names no generator (docs/noise.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import subprocess
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

NOISES = ("philox-gauss", "philox-rademacher", "legacy-cpu")  # es.noise
DEFAULT_NOISE = "philox-gauss"  # new runs
LEGACY_NOISE = "legacy-cpu"  # runs recorded before es.noise existed
CHUNK = 1 << 20  # elements of eps materialized at once (4 MiB fp32)
PARALLEL_MIN = 1 << 16  # CPU: elements per thread below which one thread draws the whole span

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10

TABLE_FILE = Path(__file__).with_name("gauss_table.npy")
TABLE_SCALE_BITS = 28  # z in fixed point: round(z * 2^28), max 6.34 * 2^28 < 2^31
TABLE_DIRECT = 1024  # m < 1024: one entry per m
TABLE_SUB = 1024  # sub-bins per octave above
TABLE_OCTAVES = 21  # k = 10 .. 30 (m < 2^31)
TABLE_LEN = TABLE_DIRECT + TABLE_OCTAVES * (TABLE_SUB + 1)
TABLE_SHA256 = "572bd90067724e1f83d769adf07c493e55f6700b8f721adb715453f971ce45c6"

_MASK32 = 0xFFFFFFFF


def tensor_seed(seed: int, name: str) -> int:
    """63-bit generator seed (blake2b of seed and name, top bit cleared) for one tensor of direction ``seed`` (a
    32-bit integer)."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"direction seeds are 32-bit unsigned integers, got {seed}")
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def check_noise(noise: str) -> str:
    if noise not in NOISES:
        raise ValueError(f"es.noise: unknown noise generator {noise!r}; valid: {', '.join(NOISES)}")
    return noise


# ----------------------------------------------------------------------------- the table


def table_point(m: int) -> float:
    """The table's abscissa m -> z = -Phi^{-1}((m + 0.5) / 2^32) in float64 (stdlib)."""
    from statistics import NormalDist

    return -NormalDist().inv_cdf((m + 0.5) / 2**32)


def table_abscissae() -> list[int]:
    """The m of every table entry: 0..1023, then per octave k = 10..30: (1024 + j) << (k - 10), j = 0..1024."""
    ms = list(range(TABLE_DIRECT))
    for sh in range(TABLE_OCTAVES):
        ms += [(TABLE_SUB + j) << sh for j in range(TABLE_SUB + 1)]
    return ms


def build_table() -> np.ndarray:
    """The fixed-point half-normal quantile table (what TABLE_FILE holds): int32, round(z * 2^28)."""
    return np.array([round(table_point(m) * 2**TABLE_SCALE_BITS) for m in table_abscissae()], dtype=np.int32)


@functools.cache
def _table_np() -> np.ndarray:
    raw = TABLE_FILE.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TABLE_SHA256:
        raise RuntimeError(
            f"{TABLE_FILE}: sha256 {digest} is not the recorded {TABLE_SHA256}: the Gaussian table changed, so "
            "every philox-gauss direction would change. Restore the file from git (never regenerate it in place)."
        )
    return np.load(TABLE_FILE)


@functools.cache
def _table(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_table_np()).to(device)  # int32


# ----------------------------------------------------------------------------- philox in int64 tensors


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * m for a < 2^32 in int64, m a 32-bit constant: every product < 2^48."""
    t = a * (m & 0xFFFF)
    s = a * (m >> 16) + (t >> 16)
    return s >> 16, ((s & 0xFFFF) << 16) | (t & 0xFFFF)


def _philox(ctr: list[torch.Tensor], keys: torch.Tensor) -> list[torch.Tensor]:
    """Philox4x32-10 of the 4 counter words (int64 tensors < 2^32); keys: int64 (rounds, 2), the bumped key of
    every round (``_round_keys``)."""
    x0, x1, x2, x3 = ctr
    for r in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(x0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(x2, PHILOX_M[1])
        x0, x1, x2, x3 = hi1 ^ x1 ^ keys[r, 0], lo1, hi0 ^ x3 ^ keys[r, 1], lo0
    return [x0, x1, x2, x3]


def _round_keys(key: int) -> list[list[int]]:
    k0, k1 = key & _MASK32, key >> 32
    return [[(k0 + r * PHILOX_W[0]) & _MASK32, (k1 + r * PHILOX_W[1]) & _MASK32] for r in range(PHILOX_ROUNDS)]


def _gauss(w: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """fp32 eps of 32-bit words w (int64): sign bit and the interpolated half-normal quantile of the rest."""
    m = w & 0x7FFFFFFF
    k = torch.zeros_like(m)
    for step in (16, 8, 4, 2, 1):  # k = floor(log2 m) for m >= 1 (m = 0: k = 0)
        k = k + step * ((m >> (k + step)) != 0).to(m.dtype)
    sh = (k - 10).clamp_(min=0)
    idx = (m >> sh) + (TABLE_SUB + 1) * sh
    f = m & ((1 << sh) - 1)
    lo = table[idx]
    z = lo + (((table[idx + 1] - lo) * f) >> sh)
    z = torch.where((w >> 31) != 0, -z, z)
    return z.to(torch.int32).to(torch.float32) * (2.0**-TABLE_SCALE_BITS)


def _rademacher(w: torch.Tensor) -> torch.Tensor:
    return 1.0 - 2.0 * (w >> 31).to(torch.float32)


def _blocks(b0: torch.Tensor, nb: int, keys: torch.Tensor, table: torch.Tensor, gauss: bool) -> torch.Tensor:
    """eps of the 4 * nb elements of blocks b0 .. b0 + nb - 1 (b0: int64 0-d tensor), element order."""
    block = b0 + torch.arange(nb, dtype=torch.int64, device=keys.device)
    zero = torch.zeros_like(block)
    words = _philox([block & _MASK32, block >> 32, zero, zero], keys)
    eps = [_gauss(w, table) for w in words] if gauss else [_rademacher(w) for w in words]
    return torch.stack(eps, dim=-1).view(-1)


CPU_SOURCE = Path(__file__).with_name("noise_cpu.c")
# no -march: the AVX2 path is a function-level target chosen at run time, so the cached binary runs on any x86-64
CPU_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
# the widest C kernel path allowed: 2 AVX-512, 1 AVX2, 0 scalar (every path gives the same bits)
CPU_SIMD = int(os.environ.get("ESBATCH_NOISE_SIMD", "2"))
SIMD_PATHS = ("scalar", "avx2", "avx512")


@functools.cache
def _cpu_lib() -> Any:
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


def cpu_simd() -> str:
    """The C kernel path CPU draws take here: "avx512", "avx2" (what the CPU has, capped by CPU_SIMD) or "scalar"
    (also when there is no C kernel)."""
    lib = _cpu_lib()
    return SIMD_PATHS[min(int(CPU_SIMD), int(lib.esbatch_noise_simd()))] if lib is not None else "scalar"


def gauss_words(words: np.ndarray, simd: int = 2) -> np.ndarray:
    """fp32 eps of given 32-bit words by the C kernel's Gaussian transform (tests: words at octave edges)."""
    lib = _cpu_lib()
    if lib is None:
        raise RuntimeError("esbatch noise: no C kernel (no C compiler, or ESBATCH_NOISE_FAST=0)")
    w = np.ascontiguousarray(words, dtype=np.uint32)
    out = np.empty(w.shape, dtype=np.float32)
    lib.esbatch_gauss_words(w.ctypes.data, w.size, _table_np().ctypes.data, int(simd), out.ctypes.data)
    return out


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="esbatch-noise")


@functools.cache
def _compiled() -> Any:
    """_blocks compiled by torch.compile (Triton) for CUDA; None when unavailable or ESBATCH_NOISE_FAST=0."""
    if os.environ.get("ESBATCH_NOISE_FAST", "1") == "0":
        return None
    try:
        return torch.compile(_blocks, dynamic=True)
    except Exception as e:  # noqa: BLE001 - any reason compile is unavailable: the eager path gives the same bits
        warnings.warn(f"esbatch noise: torch.compile unavailable ({e}); drawing noise eagerly (slower)", stacklevel=2)
        return None


_compile_failed: set[str] = set()


def _round_key_tensor(key: int, device: torch.device) -> torch.Tensor:
    """The Philox round keys of ``key`` as the int64 tensor the torch paths (compiled and eager) take."""
    return torch.tensor(_round_keys(key), dtype=torch.int64, device=device)


def _draw_fast(key: int, start: int, count: int, device: torch.device, gauss: bool) -> torch.Tensor | None:
    """The fast path of ``draw``: the C kernel on the CPU, compiled torch elsewhere; None when there is none."""
    if device.type == "cpu":
        lib = _cpu_lib()
        if lib is None:
            return None
        fn = lib.esbatch_noise
        out = torch.empty(count, dtype=torch.float32)
        args = (key & _MASK32, key >> 32, _table(device).data_ptr(), 0 if gauss else 1, int(CPU_SIMD))  # int32 table
        parts = min(torch.get_num_threads(), count // PARALLEL_MIN) if count >= 2 * PARALLEL_MIN else 1
        if parts <= 1:
            fn(start, count, *args, out.data_ptr())
            return out
        # torch's CPU threads, as its own ops use them: ctypes releases the GIL, and every element is a pure
        # function of its index, so any split gives the same bits
        cuts = [count * i // parts for i in range(parts + 1)]
        ptr, size = out.data_ptr(), out.element_size()
        jobs = [(start + a, b - a, *args, ptr + a * size) for a, b in zip(cuts, cuts[1:])]
        list(_pool(parts).map(lambda job: fn(*job), jobs))
        return out
    fn = _compiled() if device.type not in _compile_failed else None
    if fn is None:
        return None
    b0, off = divmod(start, 4)
    b0t = torch.tensor(b0, dtype=torch.int64, device=device)
    try:
        return fn(b0t, (off + count + 3) // 4, _round_key_tensor(key, device), _table(device).long(), gauss)[
            off : off + count
        ]
    except Exception as e:  # noqa: BLE001 - e.g. no Triton on this machine: eager gives the same bits
        _compile_failed.add(device.type)
        warnings.warn(f"esbatch noise: compiling for {device.type} failed ({e}); drawing eagerly", stacklevel=2)
        return None


# ----------------------------------------------------------------------------- the public API


def draw(
    seed: int,
    name: str,
    start: int,
    count: int,
    device: torch.device | str = "cpu",
    noise: str = DEFAULT_NOISE,
    fast: bool = True,
) -> torch.Tensor:
    """eps of elements start .. start + count - 1 (row-major) of tensor ``name`` in direction ``seed``: fp32,
    1-D, on ``device``. A Philox chunk costs O(count) wherever it starts; ``legacy-cpu`` draws the whole prefix
    on the CPU (it cannot start in the middle), so draw it with ``direction``."""
    check_noise(noise)
    if noise == LEGACY_NOISE:
        gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
        return torch.randn(start + count, generator=gen, dtype=torch.float32)[start:].to(device)
    device = torch.device(device)
    if count <= 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    key = tensor_seed(seed, name)
    gauss = noise == "philox-gauss"
    out = _draw_fast(key, start, count, device, gauss) if fast else None  # the C kernel needs no key tensor
    if out is None:
        b0, off = divmod(start, 4)
        b0t = torch.tensor(b0, dtype=torch.int64, device=device)
        keys = _round_key_tensor(key, device)
        out = _blocks(b0t, (off + count + 3) // 4, keys, _table(device).long(), gauss)[off : off + count]
    return out


JOB = 1 << 18  # elements per C kernel job: tensors of a model are cut into these and run over torch's threads


def run_jobs(jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Run C kernel calls (fn, *args) over torch's CPU thread count, results in order: ctypes releases the GIL,
    and every element is a pure function of its index, so any split gives the same bits. Gathering a whole
    model's jobs in one call keeps both threads busy across small tensors (one pool round trip per model)."""
    workers = min(torch.get_num_threads(), len(jobs))
    if workers <= 1:
        return [fn(*args) for fn, *args in jobs]
    # the pool's hand-off costs ~30 us a task, more than a small tensor's draw: hand out runs of ~JOB elements
    # (every job's args start with (start, count)), so a population's thousands of small factors cost no more
    batches, run, size = [], [], 0
    for job in jobs:
        run.append(job)
        size += job[2]
        if size >= JOB:
            batches.append(run)
            run, size = [], 0
    if run:
        batches.append(run)
    done = _pool(workers).map(lambda batch: [fn(*args) for fn, *args in batch], batches)
    return [result for batch in done for result in batch]


def draw_stacks(
    seeds: Sequence[int],
    shapes: Mapping[str, tuple[int, ...]],
    noise: str = DEFAULT_NOISE,
    device: torch.device | str = "cpu",
    scratch: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """eps(seed, name) of every seed and name: {name: fp32 (len(seeds), *shape)} on ``device``, stack row i that
    of seeds[i], with the bits of ``direction``. Low-rank ES draws a whole population's factors at once: on the CPU
    every draw is a C kernel job and all run in one round over torch's threads (a population's hundreds of small
    tensors drawn one call each spent most of their time in Python, on one core). ``scratch``: stacks of earlier
    calls, written over where the shapes match and kept for the next (fresh memory costs a page fault per 4 KiB)."""
    device, scratch = torch.device(device), {} if scratch is None else scratch
    where = eps_device(noise, device)
    lib = _cpu_lib() if check_noise(noise) != LEGACY_NOISE and where.type == "cpu" else None
    for name, shape in shapes.items():
        have = scratch.get(name)
        if have is None or tuple(have.shape) != (len(seeds), *shape) or have.device != where:
            scratch[name] = torch.empty((len(seeds), *shape), dtype=torch.float32, device=where)
    stacks = {name: scratch[name] for name in shapes}
    if lib is None:  # eager torch, or the device's compiled draw, tensor by tensor: the same bits
        for name, stack in stacks.items():
            for i, seed in enumerate(seeds):
                stack[i] = direction(seed, name, stack.shape[1:], noise, where)
        return {name: stack.to(device) for name, stack in stacks.items()}
    table, kind, jobs = _table(where).data_ptr(), 0 if noise == "philox-gauss" else 1, []
    for name, stack in stacks.items():
        count = math.prod(stack.shape[1:])
        cuts = _cuts(0, count)
        for i, seed in enumerate(seeds):
            key, ptr = tensor_seed(seed, name), stack.data_ptr() + 4 * i * count
            args = (key & _MASK32, key >> 32, table, kind, int(CPU_SIMD))
            jobs += [(lib.esbatch_noise, a, b - a, *args, ptr + 4 * a) for a, b in zip(cuts, cuts[1:]) if b > a]
    run_jobs(jobs)
    return {name: stack.to(device) for name, stack in stacks.items()}


def _cuts(start: int, end: int, job: int = JOB) -> list[int]:
    """start, the multiples of ``job`` strictly between, end: job boundaries fixed in absolute element index."""
    return [start, *range((start // job + 1) * job, end, job), end]


def perturb_jobs(
    seed: int, name: str, start: int, scale: float, base: torch.Tensor, out: torch.Tensor, noise: str = DEFAULT_NOISE
) -> list[tuple[Any, ...]] | None:
    """The C kernel jobs of perturb_into (for run_jobs), or None where that path does not apply."""
    lib = _cpu_lib() if noise != LEGACY_NOISE else None
    ok = (out.dtype, base.dtype, out.device.type, base.device.type) == (torch.float32, torch.float32, "cpu", "cpu")
    if lib is None or not ok or not (out.is_contiguous() and base.is_contiguous()) or out.numel() != base.numel():
        return None
    check_noise(noise)
    key, end = tensor_seed(seed, name), start + out.numel()
    args = (key & _MASK32, key >> 32, _table(out.device).data_ptr(), 0 if noise == "philox-gauss" else 1, int(CPU_SIMD))
    fn, bp, op = lib.esbatch_noise_axpy, base.data_ptr(), out.data_ptr()
    cuts = _cuts(start, end)
    return [(fn, a, b - a, *args, scale, bp + 4 * (a - start), op + 4 * (a - start)) for a, b in zip(cuts, cuts[1:])]


def perturb_into(
    seed: int, name: str, start: int, scale: float, base: torch.Tensor, out: torch.Tensor, noise: str = DEFAULT_NOISE
) -> bool:
    """out <- base + scale * eps(seed, name)[start : start + len(out)] in one pass of the C kernel, for fp32
    contiguous CPU tensors; False (nothing written) where that path does not apply, and the caller computes
    ``draw(...).mul_(scale).add_(base)``: the same bits (tests/unit/test_noise.py), in four passes over memory."""
    jobs = perturb_jobs(seed, name, start, scale, base, out, noise)
    if jobs is None:
        return False
    run_jobs(jobs)
    return True


def accumulate(
    seeds: Sequence[int],
    weights: Sequence[float],
    name: str,
    start: int,
    count: int,
    noise: str = DEFAULT_NOISE,
) -> torch.Tensor | None:
    """sum_d weights[d] * eps(seeds[d], name)[start : start + count], fp32 on the CPU, in one pass of the C kernel
    with the bits of ``acc = zeros; acc.add_(draw(seed_d, ...), alpha=w_d)`` per direction in order (an ES
    update's sum, es_update); None where the kernel does not apply (no C compiler, legacy-cpu) and the caller
    does it with torch."""
    lib = _cpu_lib() if check_noise(noise) != LEGACY_NOISE else None
    if lib is None or count <= 0:
        return None
    k0, k1, w = _directions(seeds, weights, name)
    out = torch.empty(count, dtype=torch.float32)
    args = (len(k0), k0.ctypes, k1.ctypes, w.ctypes, _table(out.device).data_ptr())
    args += (0 if noise == "philox-gauss" else 1, int(CPU_SIMD))
    fn, op, cuts = lib.esbatch_noise_accumulate, out.data_ptr(), _cuts(start, start + count)
    run_jobs([(fn, a, b - a, *args, op + 4 * (a - start)) for a, b in zip(cuts, cuts[1:])])
    return out


def _directions(seeds: Sequence[int], weights: Sequence[float], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The C kernel's per-direction arrays: Philox key words and fp32 weights (torch's add_ rounds alpha to the
    tensor's fp32 the same way)."""
    keys = [tensor_seed(s, name) for s in seeds]
    k0 = np.array([k & _MASK32 for k in keys], dtype=np.uint32)
    k1 = np.array([k >> 32 for k in keys], dtype=np.uint32)
    return k0, k1, np.array(weights, dtype=np.float32)


def update_jobs(
    seeds: Sequence[int],
    weights: Sequence[float],
    scale: float,
    name: str,
    dst: torch.Tensor,
    start: int = 0,
    noise: str = DEFAULT_NOISE,
) -> list[tuple[Any, ...]] | None:
    """C kernel jobs (for run_jobs) doing dst += scale * sum_d weights[d] * eps(seeds[d], name)[start : start +
    dst.numel()] on an fp32 CPU tensor in one pass, with the bits of update.step_chunk's torch ops; or None
    (nothing to run) where the kernel does not apply. Each job returns its squared-L2 part in float64; jobs are
    cut at absolute multiples of JOB, so a tensor done whole or chunk by chunk, on any thread count, yields the
    same parts to sum in order. A whole model's jobs run at once: torch ops between chunks would leave OpenMP
    threads spinning on the cores the kernel needs (measured: it doubled the update's time)."""
    lib = _cpu_lib() if check_noise(noise) != LEGACY_NOISE else None
    ok = dst.dtype == torch.float32 and dst.device.type == "cpu" and dst.is_contiguous()
    if lib is None or not ok or dst.numel() == 0:
        return None
    k0, k1, w = _directions(seeds, weights, name)
    # arr.ctypes (not .data) keeps each array alive as long as the jobs hold it
    args = (len(k0), k0.ctypes, k1.ctypes, w.ctypes, _table(dst.device).data_ptr())
    args += (0 if noise == "philox-gauss" else 1, int(CPU_SIMD), scale)
    fn, dp, cuts = lib.esbatch_noise_update, dst.data_ptr(), _cuts(start, start + dst.numel())
    return [(fn, a, b - a, *args, dp + 4 * (a - start)) for a, b in zip(cuts, cuts[1:])]


def direction(
    seed: int,
    name: str,
    shape: torch.Size | tuple[int, ...],
    noise: str = DEFAULT_NOISE,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """eps for tensor ``name`` of direction ``seed``: fp32 of ``shape`` on ``device`` (whole tensor; the weight
    movers use ``chunks`` instead)."""
    n = math.prod(shape)  # Python ints: no overflow, and ~20x cheaper than np.prod per call
    if check_noise(noise) == LEGACY_NOISE:
        gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
        return torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(device)
    return draw(seed, name, 0, n, device, noise).view(tuple(shape))


def eps_device(noise: str, device: torch.device | str) -> torch.device:
    """Where eps is drawn and combined for a tensor on ``device``: there, except legacy-cpu (the CPU, as it was)."""
    return torch.device("cpu") if check_noise(noise) == LEGACY_NOISE else torch.device(device)


def spans(numel: int, noise: str, chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    """(start, end) element ranges a weight mover handles at once: CHUNK-sized for Philox, the whole tensor for
    legacy-cpu (its sampler is not chunkable)."""
    step = max(numel, 1) if check_noise(noise) == LEGACY_NOISE else chunk
    for s in range(0, numel, step):
        yield s, min(s + step, numel)
