"""The ES center update (paper App. G.1) and the one object that carries its settings: es_update on the fp32
center (es.restore: exact), es_update_inplace on the live compute-dtype weights (es.restore: inplace)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from esbatch.perturb.jobs import run_jobs, update_jobs
from esbatch.perturb.noise import DEFAULT_NOISE, accumulate, draw, eps_device, spans


@dataclass(frozen=True)
class UpdateSpec:
    """Everything an ES update needs: directions, their weights, alpha and the population size N.

    Logged with every update (log.jsonl), so a resumed run replays the same updates bit for bit, and passed
    to backends as one object, so a new update setting touches this class and es_update only.
    """

    seeds: tuple[int, ...]
    weights: tuple[float, ...]
    alpha: float
    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        if len(self.seeds) != len(self.weights):
            raise ValueError(f"{len(self.seeds)} direction seeds but {len(self.weights)} weights")

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> UpdateSpec:
        """The update of one log.jsonl record."""
        return cls(rec["update_seeds"], rec["update_weights"], rec["alpha"], rec["n"])

    def to_dict(self) -> dict[str, Any]:
        """The record fields (and the payload of a vLLM worker rpc)."""
        return {
            "update_seeds": list(self.seeds),
            "update_weights": list(self.weights),
            "alpha": self.alpha,
            "n": self.n,
        }


@contextmanager
def flat(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """A 1-D view of ``t``'s elements in row-major order to work on chunk by chunk (a contiguous copy, written
    back on exit, when ``t`` is a non-contiguous view)."""
    if t.is_contiguous():
        yield t.view(-1)
        return
    f = t.contiguous().view(-1)
    yield f
    t.copy_(f.view(t.shape))


@torch.no_grad()
def es_update(center: Mapping[str, torch.Tensor], spec: UpdateSpec, noise: str = DEFAULT_NOISE) -> float:
    r"""Apply the ES step to the fp32 center in place and return the update's L2 norm.

        theta_{t+1} = theta_t + alpha / N * sum_i w_i * eps_i

    with w_i the normalized reward of direction i (one-point) or z(+) - z(-) (antithetic), N the
    population size, and eps_i rebuilt from (seed_i, name) by generator ``noise`` (es.noise). The sum is
    accumulated in fp32 and added once per element, so small steps are not lost to rounding in a low-precision
    compute dtype. Directions with w_i == 0 contribute nothing and are skipped. Philox noise is drawn and summed
    on the center's device in chunks of noise.CHUNK elements (the same per-element operations as one pass);
    on the CPU the C kernel does those operations in one pass over each tensor (jobs.update_jobs, tested bit
    for bit against them; the L2, a logged metric only, is summed in a different order than before 2026-12-02
    and may differ in its last bits). legacy-cpu sums whole tensors on the CPU, as runs made with it did.
    """
    for name, theta in center.items():
        if theta.dtype != torch.float32:
            raise TypeError(f"{name}: the ES center must be fp32, got {theta.dtype}")
    # fp32 on the CPU: the C kernel, every tensor's jobs in one run (the same bits as the chunks below)
    jobs = {name: j for name, theta in center.items() if (j := cpu_jobs(spec, name, theta, 0, noise)) is not None}
    parts = iter(run_jobs([job for j in jobs.values() for job in j]))
    sq = 0.0
    for name, theta in center.items():
        if name in jobs:
            for _ in jobs[name]:
                sq += next(parts)
            continue
        where = eps_device(noise, theta.device)
        with flat(theta) as dst:
            for s, e in spans(theta.numel(), noise):
                acc = step_chunk(spec, name, s, e, where, noise)
                dst[s:e].add_(acc.to(theta.device))
                sq += float(torch.linalg.vector_norm(acc, dtype=torch.float64)) ** 2  # no float64 copy
    return sq**0.5


def cpu_jobs(spec: UpdateSpec, name: str, dst: torch.Tensor, start: int, noise: str) -> list[tuple] | None:
    """C kernel jobs (jobs.run_jobs) adding step_chunk's step to ``dst`` (elements start.. of tensor ``name``,
    fp32 contiguous on the CPU) in one pass, each returning its squared-L2 part (jobs.update_jobs); None where
    that path does not apply."""
    used = [(seed, w) for seed, w in zip(spec.seeds, spec.weights) if w != 0.0]
    seeds, weights = [s for s, _ in used], [w for _, w in used]
    return update_jobs(seeds, weights, spec.alpha / spec.n, name, dst, start, noise)


def step_chunk(spec: UpdateSpec, name: str, s: int, e: int, where: torch.device, noise: str) -> torch.Tensor:
    """alpha / N * sum_i w_i eps_i on elements s .. e-1 of tensor ``name``: fp32 on ``where``, summed in logged
    order (the one arithmetic of es_update, shared by the offloaded centers of esbatch/perturb/offload.py).
    On the CPU the C kernel sums every direction in one pass (noise.accumulate)."""
    used = [(seed, w) for seed, w in zip(spec.seeds, spec.weights) if w != 0.0]
    acc = accumulate(*zip(*used), name, s, e - s, noise) if used and where.type == "cpu" else None
    if acc is None:  # the same sum with torch ops: a draw and an add_ per direction (CUDA, or no C kernel)
        acc = torch.zeros(e - s, dtype=torch.float32, device=where)
        for seed, w in used:
            acc.add_(draw(seed, name, s, e - s, where, noise), alpha=w)
    return acc.mul_(spec.alpha / spec.n)


@torch.no_grad()
def es_update_inplace(
    live: Mapping[str, torch.Tensor], spec: UpdateSpec, noise: str = DEFAULT_NOISE
) -> tuple[float, float]:
    r"""The same ES step computed and added in place in each tensor's own (compute) dtype, as the paper's
    implementation does (App. G.1, "update every engine locally by theta_{t+1} = theta_t + alpha/N sum_i z_i
    eps_i"; ``es.restore: inplace``). Returns (L2 of the step added, fraction of elements whose value changed).

    Per tensor p, every operation rounded to p's dtype, in this order:

        acc  = 0
        acc  = acc + w_i * eps_i        for each direction i in logged order with w_i != 0
                                        (eps_i rounded to the dtype, the product rounded, then the sum)
        step = acc * (alpha / N)        alpha / N is one Python float: one rounding, not divide-then-scale
        p    = p + step

    Unlike es_update, a step below half an ulp of p is lost, which is the paper's behaviour in bfloat16. The
    order is per element, so computing it chunk by chunk (noise.spans) changes nothing.
    """
    sq = 0.0
    changed = total = 0
    for name, p in live.items():
        where = eps_device(noise, p.device)
        with flat(p) as dst:
            for s, e in spans(p.numel(), noise):
                acc = torch.zeros(e - s, dtype=p.dtype, device=p.device)
                for seed, w in zip(spec.seeds, spec.weights):
                    if w != 0.0:
                        acc.add_(draw(seed, name, s, e - s, where, noise).to(device=p.device, dtype=p.dtype).mul_(w))
                step = acc.mul_(spec.alpha / spec.n)
                old = dst[s:e]
                new = old + step  # what old.add_(step) stores, kept apart to count changed elements
                changed += int((new != old).sum())
                old.copy_(new)
                sq += float(torch.linalg.vector_norm(step, dtype=torch.float64)) ** 2
        total += p.numel()
    return sq**0.5, changed / total
