"""Low-rank ES directions (EGGROLL, arXiv 2511.16652; ``es.perturbation: lowrank``) and their fp32 update.

A 2-D parameter W (m x n as stored) moves along E(seed, W) = A B^T / sqrt(r), A (m, r) = eps(seed, "<name>#A"),
B (n, r) = eps(seed, "<name>#B") (the run's generator, esbatch/perturb/noise.py); other parameters get eps(seed,
name) (``es.lowrank_vectors: full``) or stay fixed (``frozen``). Member i is theta + s_i E(seed_i); the update is

    theta += alpha/N sum_i w_i E(seed_i) = c sum_i sum_k (w_i A_i[:, k]) outer B_i[:, k],   c = alpha / N / sqrt(r)

on the fp32 center, one rank-1 product at a time in logged order, element-wise only (no BLAS summation order), so
a replay of the logged UpdateSpecs rebuilds the center bit for bit anywhere. Ours, not EGGROLL's: the vectors'
treatment, one E for a tied embedding / lm_head, and this summation order (docs/lowrank.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from esbatch.perturb.centered import CenteredWeights
from esbatch.perturb.noise import CHUNK, DEFAULT_NOISE, direction, draw_stacks, eps_device
from esbatch.perturb.update import UpdateSpec, es_update, flat

PERTURBATIONS = ("full", "lowrank")  # es.perturbation
LOWRANK_VECTORS = ("full", "frozen")  # es.lowrank_vectors: what non-matrix parameters get


def is_matrix(t: torch.Tensor) -> bool:
    """Whether a parameter gets a low-rank perturbation (2-D) rather than the vector rule."""
    return t.dim() == 2


def factors(
    seed: int,
    name: str,
    shape: tuple[int, ...] | torch.Size,
    rank: int,
    noise: str = DEFAULT_NOISE,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of matrix ``name`` (m x n) in direction ``seed``: fp32 (m, r) and (n, r), unscaled
    (E = A B^T / sqrt(r))."""
    m, n = shape
    where = eps_device(noise, device)
    a = direction(seed, f"{name}#A", (m, rank), noise, where).to(device)
    b = direction(seed, f"{name}#B", (n, rank), noise, where).to(device)
    return a, b


def _outer_sum(terms: list[tuple[torch.Tensor, torch.Tensor]], rows: slice, n: int) -> torch.Tensor:
    """sum over (a, b) in ``terms`` of sum_k a[rows, k] outer b[:, k], in fp32, term by term, k by k (each product
    rounded once, then added): the fixed per-element order that makes perturb and update reproducible."""
    a0 = terms[0][0]
    acc = torch.zeros(a0[rows].shape[0], n, dtype=torch.float32, device=a0.device)
    for a, b in terms:
        ar = a[rows]
        for k in range(a.shape[1]):
            acc.add_(ar[:, k, None] * b[None, :, k])
    return acc


def _row_spans(m: int, n: int) -> list[slice]:
    """Row blocks of an (m, n) tensor of at most noise.CHUNK elements (at least one row): bounded memory."""
    step = max(1, CHUNK // max(n, 1))
    return [slice(s, min(s + step, m)) for s in range(0, m, step)]


@torch.no_grad()
def lowrank_update(
    center: Mapping[str, torch.Tensor],
    spec: UpdateSpec,
    rank: int,
    vectors: str = "full",
    noise: str = DEFAULT_NOISE,
) -> float:
    """Apply theta += alpha/N sum_i w_i E(seed_i) to the fp32 ``center`` in place (module docstring) and return
    the step's L2 norm. Matrices: the low-rank sum; other tensors: es_update's full-rank step (vectors: full) or
    nothing (frozen). Directions with w_i == 0 are skipped, as in es_update."""
    check_vectors(vectors)
    c = spec.alpha / spec.n / math.sqrt(rank)
    sq = 0.0
    others = {}
    for name, theta in center.items():
        if not is_matrix(theta):
            others[name] = theta
            continue
        if theta.dtype != torch.float32:
            raise TypeError(f"{name}: the ES center must be fp32, got {theta.dtype}")
        m, n = theta.shape
        terms = []
        for seed, w in zip(spec.seeds, spec.weights):
            if w != 0.0:
                a, b = factors(seed, name, theta.shape, rank, noise, theta.device)
                terms.append((a.mul_(w), b))  # w_i A_i: one rounding per element
        if not terms:
            continue
        with flat(theta) as dst:
            for rows in _row_spans(m, n):
                acc = _outer_sum(terms, rows, n).mul_(c)
                dst[rows.start * n : rows.stop * n].add_(acc.view(-1))
                sq += float(torch.linalg.vector_norm(acc, dtype=torch.float64)) ** 2
    if vectors == "full" and others:
        sq += es_update(others, spec, noise) ** 2
    return sq**0.5


def check_vectors(vectors: str) -> str:
    if vectors not in LOWRANK_VECTORS:
        raise ValueError(f"es.lowrank_vectors: unknown {vectors!r}; valid: {', '.join(LOWRANK_VECTORS)}")
    return vectors


class LowRankWeights(CenteredWeights):
    """CenteredWeights (fp32 center, exact restore) whose directions are the low-rank E of the module docstring.

    perturb() materializes one member (used by the generic one-member-at-a-time path and by tests); the batched
    HF forward (esbatch/backends/hf_lowrank.py) never does, it adds s_i x E_i^T per row instead.
    """

    def __init__(
        self,
        live: Mapping[str, torch.Tensor],
        track_drift: bool = True,
        noise: str = DEFAULT_NOISE,
        rank: int = 1,
        vectors: str = "full",
    ) -> None:
        if rank < 1:
            raise ValueError(f"es.rank: the rank r of each perturbation must be >= 1, got {rank}")
        super().__init__(live, track_drift, noise)
        self.rank, self.vectors = rank, check_vectors(vectors)

    def perturbed_names(self) -> list[str]:
        """The parameters a member moves: every matrix, and the other tensors unless vectors is frozen."""
        return [n for n, t in self.master.items() if is_matrix(t) or self.vectors == "full"]

    @torch.no_grad()
    def population(
        self, members: Sequence[tuple[int, float]], scratch: dict[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """The perturbations of members (direction seed, scale s) for a batched forward, fp32 on each weight's
        device: {matrix: (s A / sqrt(r) as (U, m, r), B as (U, n, r))} and {other perturbed tensor: s eps as
        (U, *shape)}, row i member i's. All drawn at once (noise.draw_stacks), with the bits of ``factors`` and
        ``direction`` per member scaled as a.mul_(s / sqrt(r)) and eps * s (tests/unit/test_lowrank.py). ``scratch``:
        draw_stacks' buffers, reused by the next call (the results are views of them)."""
        c, r = 1.0 / math.sqrt(self.rank), self.rank
        names = self.perturbed_names()
        by_device: dict[torch.device, dict[str, tuple[int, ...]]] = {}
        for name in names:
            p = self.live[name]
            shapes = by_device.setdefault(p.device, {})
            if is_matrix(p):
                shapes[f"{name}#A"], shapes[f"{name}#B"] = (p.shape[0], r), (p.shape[1], r)
            else:
                shapes[name] = tuple(p.shape)
        seeds, eps, a_scale, scale = [seed for seed, _ in members], {}, {}, {}
        for dev, shapes in by_device.items():
            eps.update(draw_stacks(seeds, shapes, self.noise, dev, scratch))
            a_scale[dev] = torch.tensor([s * c for _, s in members], dtype=torch.float32, device=dev)  # a.mul_(s * c)
            scale[dev] = torch.tensor([s for _, s in members], dtype=torch.float32, device=dev)
        mats, vecs = {}, {}
        for name in names:
            p = self.live[name]
            if is_matrix(p):
                mats[name] = (eps[f"{name}#A"].mul_(a_scale[p.device][:, None, None]), eps[f"{name}#B"])
            else:
                vecs[name] = eps[name].mul_(scale[p.device].view(-1, *[1] * p.dim()))
        return mats, vecs

    @torch.no_grad()
    def perturb(self, seed: int, scale: float, over: bool = False) -> None:
        """live <- round(center + scale * E(seed)) for matrices, center + scale * eps(seed) for the others
        (vectors: full), computed in fp32 from the center and rounded once (frozen tensors are never moved, so
        ``over``, from one member straight to the next, leaves every weight right)."""
        if self.perturbed and not over:
            raise RuntimeError("perturb() called on perturbed weights: restore first")
        self.perturbed = True
        c = scale / math.sqrt(self.rank)
        for name, p in self.live.items():
            master = self.master[name]
            if is_matrix(master):
                m, n = master.shape
                terms = [factors(seed, name, master.shape, self.rank, self.noise, master.device)]
                with flat(p) as dst:
                    for rows in _row_spans(m, n):
                        val = _outer_sum(terms, rows, n).mul_(c).add_(master[rows])
                        dst[rows.start * n : rows.stop * n].copy_(val.view(-1))
            elif self.vectors == "full":
                eps = direction(seed, name, master.shape, self.noise, eps_device(self.noise, master.device))
                p.copy_(eps.to(master.device).mul_(scale).add_(master))

    def step(self, spec: UpdateSpec) -> float:
        """lowrank_update on the fp32 center (CenteredWeights.update copies it to the live weights)."""
        return lowrank_update(self.master, spec, self.rank, self.vectors, self.noise)
