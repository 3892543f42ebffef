"""Seeded ES directions eps(seed, tensor name), rebuilt on demand where the tensor lives (config ``es.noise``).

``philox-gauss`` (default), ``philox-rademacher``: eps of element i, a pure function of (seed, name, i), is

    w = word i % 4 of Philox4x32-10(counter = i // 4, key = tensor_seed(seed, name))
    gauss: (-1)^(w >> 31) * z(w & 0x7FFFFFFF)        rademacher: -1 if w >> 31 else +1

with z read from a committed fixed-point quantile table (``philox.TABLE_FILE``, sha256-checked) in integer
arithmetic, so every device and backend draws the same bits; chunks of ``CHUNK``. ``legacy-cpu``: torch.randn on a
CPU generator seeded with tensor_seed, whole tensors; runs recorded without ``es.noise`` load as it. Our choice:
the paper names no generator (docs/noise.md). This module is the public face; the definition and its eager torch
draw are in philox.py, the C kernel for the CPU in cpu_kernel.py (run on torch's threads by jobs.py), and the
torch.compile path for accelerators in compiled.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from esbatch.perturb.compiled import draw_compiled
from esbatch.perturb.cpu_kernel import cpu_lib
from esbatch.perturb.jobs import accumulate_jobs, draw_cpu, perturb_jobs, run_jobs, stack_jobs
from esbatch.perturb.philox import (
    DEFAULT_NOISE,
    LEGACY_NOISE,
    NOISES,
    check_noise,
    eps_blocks,
    round_key_tensor,
    table_on,
    tensor_seed,
)

CHUNK = 1 << 20  # elements of eps materialized at once (4 MiB fp32)


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
    on the CPU (it cannot start in the middle), so draw it with ``direction``. ``fast``: the C kernel on the CPU,
    compiled torch elsewhere, where there is one; else (and with fast=False) eager torch: the same bits."""
    check_noise(noise)
    if noise == LEGACY_NOISE:
        gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
        return torch.randn(start + count, generator=gen, dtype=torch.float32)[start:].to(device)
    device = torch.device(device)
    if count <= 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    key = tensor_seed(seed, name)
    gauss = noise == "philox-gauss"
    out = None
    if fast and device.type == "cpu":
        out = draw_cpu(key, start, count, gauss)  # the C kernel needs no key tensor
    elif fast:
        out = draw_compiled(key, start, count, device, gauss)
    if out is None:
        b0, off = divmod(start, 4)
        b0t = torch.tensor(b0, dtype=torch.int64, device=device)
        keys = round_key_tensor(key, device)
        out = eps_blocks(b0t, (off + count + 3) // 4, keys, table_on(device).long(), gauss)[off : off + count]
    return out


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
    for name, shape in shapes.items():
        have = scratch.get(name)
        if have is None or tuple(have.shape) != (len(seeds), *shape) or have.device != where:
            scratch[name] = torch.empty((len(seeds), *shape), dtype=torch.float32, device=where)
    stacks = {name: scratch[name] for name in shapes}
    jobs = stack_jobs(seeds, stacks, noise)
    if jobs is None:  # eager torch, or the device's compiled draw, tensor by tensor: the same bits
        for name, stack in stacks.items():
            for i, seed in enumerate(seeds):
                stack[i] = direction(seed, name, stack.shape[1:], noise, where)
    else:
        run_jobs(jobs)
    return {name: stack.to(device) for name, stack in stacks.items()}


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
    if check_noise(noise) == LEGACY_NOISE or cpu_lib() is None or count <= 0:
        return None
    out = torch.empty(count, dtype=torch.float32)
    run_jobs(accumulate_jobs(seeds, weights, name, out, start, noise))
    return out


__all__ = [
    "CHUNK",
    "DEFAULT_NOISE",
    "LEGACY_NOISE",
    "NOISES",
    "accumulate",
    "check_noise",
    "direction",
    "draw",
    "draw_stacks",
    "eps_device",
    "perturb_into",
    "spans",
    "tensor_seed",
]
