"""C kernel jobs on torch's CPU threads: tensors cut into calls of the C kernel (cpu_kernel.py) at fixed element
boundaries, run over a thread pool (ctypes releases the GIL).

Every element is a pure function of its index, so any split gives the same bits. The *_jobs functions build the
calls of one tensor (None where the kernel does not apply: the caller uses torch ops, the same bits) so that a
whole model's jobs can run in one ``run_jobs`` round; ``draw_cpu`` is one span drawn over the threads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from esbatch.perturb.cpu_kernel import cpu_lib, simd_cap
from esbatch.perturb.philox import DEFAULT_NOISE, LEGACY_NOISE, check_noise, key_words, table_on, tensor_seed

PARALLEL_MIN = 1 << 16  # CPU: elements per thread below which one thread draws the whole span
JOB = 1 << 18  # elements per C kernel job: tensors of a model are cut into these and run over torch's threads


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="esbatch-noise")


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


def _cuts(start: int, end: int, job: int = JOB) -> list[int]:
    """start, the multiples of ``job`` strictly between, end: job boundaries fixed in absolute element index."""
    return [start, *range((start // job + 1) * job, end, job), end]


def draw_cpu(key: int, start: int, count: int, gauss: bool) -> torch.Tensor | None:
    """eps of elements start .. start + count - 1 of the tensor whose tensor_seed is ``key``, fp32 on the CPU by
    the C kernel, split over torch's threads when long enough; None when there is no C kernel."""
    lib = cpu_lib()
    if lib is None:
        return None
    fn = lib.esbatch_noise
    out = torch.empty(count, dtype=torch.float32)
    args = (*key_words(key), table_on(out.device).data_ptr(), 0 if gauss else 1, simd_cap())  # int32 table
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


def stack_jobs(
    seeds: Sequence[int], stacks: Mapping[str, torch.Tensor], noise: str = DEFAULT_NOISE
) -> list[tuple[Any, ...]] | None:
    """The C kernel jobs of noise.draw_stacks (for run_jobs): row i of stacks[name] (fp32, contiguous, on the CPU)
    <- eps(seeds[i], name); None where the kernel does not apply (legacy-cpu, no C compiler, not the CPU)."""
    if check_noise(noise) == LEGACY_NOISE or any(stack.device.type != "cpu" for stack in stacks.values()):
        return None
    lib = cpu_lib()
    if lib is None:
        return None
    table, kind, jobs = table_on(torch.device("cpu")).data_ptr(), 0 if noise == "philox-gauss" else 1, []
    for name, stack in stacks.items():
        count = math.prod(stack.shape[1:])
        cuts = _cuts(0, count)
        for i, seed in enumerate(seeds):
            key, ptr = tensor_seed(seed, name), stack.data_ptr() + 4 * i * count
            args = (*key_words(key), table, kind, simd_cap())
            jobs += [(lib.esbatch_noise, a, b - a, *args, ptr + 4 * a) for a, b in zip(cuts, cuts[1:]) if b > a]
    return jobs


def perturb_jobs(
    seed: int, name: str, start: int, scale: float, base: torch.Tensor, out: torch.Tensor, noise: str = DEFAULT_NOISE
) -> list[tuple[Any, ...]] | None:
    """The C kernel jobs of noise.perturb_into (for run_jobs), or None where that path does not apply."""
    lib = cpu_lib() if noise != LEGACY_NOISE else None
    ok = (out.dtype, base.dtype, out.device.type, base.device.type) == (torch.float32, torch.float32, "cpu", "cpu")
    if lib is None or not ok or not (out.is_contiguous() and base.is_contiguous()) or out.numel() != base.numel():
        return None
    check_noise(noise)
    key, end = tensor_seed(seed, name), start + out.numel()
    args = (*key_words(key), table_on(out.device).data_ptr(), 0 if noise == "philox-gauss" else 1, simd_cap())
    fn, bp, op = lib.esbatch_noise_axpy, base.data_ptr(), out.data_ptr()
    cuts = _cuts(start, end)
    return [(fn, a, b - a, *args, scale, bp + 4 * (a - start), op + 4 * (a - start)) for a, b in zip(cuts, cuts[1:])]


def accumulate_jobs(
    seeds: Sequence[int],
    weights: Sequence[float],
    name: str,
    out: torch.Tensor,
    start: int = 0,
    noise: str = DEFAULT_NOISE,
) -> list[tuple[Any, ...]] | None:
    """The C kernel jobs of noise.accumulate (for run_jobs): out <- sum_d weights[d] * eps(seeds[d], name)[start :
    start + out.numel()] on an fp32 contiguous CPU tensor; None where the kernel does not apply."""
    lib = cpu_lib() if check_noise(noise) != LEGACY_NOISE else None
    ok = out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous()
    if lib is None or not ok or out.numel() == 0:
        return None
    k0, k1, w = _directions(seeds, weights, name)
    args = (len(k0), k0.ctypes, k1.ctypes, w.ctypes, table_on(out.device).data_ptr())
    args += (0 if noise == "philox-gauss" else 1, simd_cap())
    fn, op, cuts = lib.esbatch_noise_accumulate, out.data_ptr(), _cuts(start, start + out.numel())
    return [(fn, a, b - a, *args, op + 4 * (a - start)) for a, b in zip(cuts, cuts[1:])]


def _directions(seeds: Sequence[int], weights: Sequence[float], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The C kernel's per-direction arrays: Philox key words and fp32 weights (torch's add_ rounds alpha to the
    tensor's fp32 the same way)."""
    words = [key_words(tensor_seed(s, name)) for s in seeds]
    k0 = np.array([k0 for k0, _ in words], dtype=np.uint32)
    k1 = np.array([k1 for _, k1 in words], dtype=np.uint32)
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
    lib = cpu_lib() if check_noise(noise) != LEGACY_NOISE else None
    ok = dst.dtype == torch.float32 and dst.device.type == "cpu" and dst.is_contiguous()
    if lib is None or not ok or dst.numel() == 0:
        return None
    k0, k1, w = _directions(seeds, weights, name)
    # arr.ctypes (not .data) keeps each array alive as long as the jobs hold it
    args = (len(k0), k0.ctypes, k1.ctypes, w.ctypes, table_on(dst.device).data_ptr())
    args += (0 if noise == "philox-gauss" else 1, simd_cap(), scale)
    fn, dp, cuts = lib.esbatch_noise_update, dst.data_ptr(), _cuts(start, start + dst.numel())
    return [(fn, a, b - a, *args, dp + 4 * (a - start)) for a, b in zip(cuts, cuts[1:])]
