"""Low-rank ES in the HF backend (``es.perturbation: lowrank``): the whole population in one batched generate.

``HFLowRankBackend`` (the registry's ``hf`` backend for this perturbation, esbatch/backends/__init__.py) is an
HFBackend whose weights keep low-rank directions and whose populations run through ``LowRankPopulation`` here.

Member i is theta + s_i E_i (esbatch/perturb/lowrank.py), never materialized: forward hooks add each row's term:

    nn.Linear     y = x W^T + b  +  (x B_i) (s_i A_i / sqrt(r))^T  [+ s_i eps_i(bias)]
    nn.Embedding  y = W[t]       +  (s_i A_i / sqrt(r))[t] B_i^T
    RMSNorm       y = w * n(x)   +  s_i eps_i(w) * n(x)          n(x) = x / sqrt(mean(x^2) + eps), recomputed

so x W^T is computed once for all N x B rows. A tied embedding / lm_head shares one (A, B); other modules' tensors
are refused at construction. Rows are member-major; each member samples from its own torch.Generator (its
gen_seed), so its responses equal the materialized member's up to logit rounding (docs/lowrank.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from esbatch.backends.base import Generation, PerturbedMember, PopulationOutput, SamplingParams
from esbatch.backends.config import ESSetup
from esbatch.backends.dispatch import Claim
from esbatch.backends.hf import HFBackend
from esbatch.perturb.lowrank import LowRankWeights


def _is_rmsnorm(module: nn.Module) -> bool:
    """An RMSNorm whose output is weight * x / sqrt(mean(x^2) + eps) (Llama, Qwen2, Mistral, ...)."""
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


@dataclass
class _Site:
    """One module whose output a member's perturbation changes, and the parameter names it reads."""

    kind: str  # linear | embedding | rmsnorm
    weight: str | None = None  # perturbed weight's name (None: frozen or not perturbed)
    bias: str | None = None


@dataclass
class _Batch:
    """The members of one generate call: U members x rpm rows each, their scaled factors and vector noise."""

    members: int
    a: dict[str, torch.Tensor] = field(default_factory=dict)  # (U, m, r): s_i A_i / sqrt(r), compute dtype
    b: dict[str, torch.Tensor] = field(default_factory=dict)  # (U, n, r): B_i
    at: dict[str, torch.Tensor] = field(default_factory=dict)  # (U, r, m): a transposed, contiguous
    bt: dict[str, torch.Tensor] = field(default_factory=dict)  # (U, r, n): b transposed, contiguous
    vec: dict[str, torch.Tensor] = field(default_factory=dict)  # (U, d): s_i eps_i


def _add_outer(y: torch.Tensor, left: torch.Tensor, right_t: torch.Tensor) -> None:
    """y (U, L, k) += left (U, L, r) @ right_t (U, r, k) in place. At r = 1 a broadcast multiply-add: baddbmm_
    ran 3.7-7x slower on this CPU (torch 2.13, U=32, L=4, k=1536 and 49152: 139-185 against 50 us, 4.3-6.3 ms
    against 0.9 ms); at r = 4 baddbmm_ beat r multiply-adds (53 against 92 us, 2.6 against 4.5 ms)."""
    if left.shape[-1] == 1:
        y.addcmul_(left, right_t)
    else:
        y.baddbmm_(left, right_t)


class LowRankPopulation:
    """The batched low-rank generation of one HF model whose weights follow ``weights`` (a LowRankWeights):
    which modules carry a perturbation, the hooks that add it, and the generate calls of a population. The
    backend (HFLowRankBackend, below) supplies generation (``gen``: an HFGenerator)."""

    def __init__(self, model: nn.Module, weights: LowRankWeights, batch_size: int) -> None:
        self.model, self.weights, self.batch_size = model, weights, batch_size
        self.rank = weights.rank
        self.sites = self._sites()
        self._batch: _Batch | None = None

    # ---------------------------------------------------------------- where the perturbation enters
    def _sites(self) -> dict[nn.Module, _Site]:
        """Every module that reads a perturbed parameter; an error naming any perturbed parameter none reads."""
        names = {id(p): n for n, p in self.weights.live.items()}
        moving = set(self.weights.perturbed_names())

        def moved(p: Any) -> str | None:
            n = names.get(id(p)) if isinstance(p, nn.Parameter) else None
            return n if n in moving else None

        sites: dict[nn.Module, _Site] = {}
        for mod in self.model.modules():
            if isinstance(mod, nn.Linear):
                sites[mod] = _Site("linear", moved(mod.weight), moved(mod.bias))
            elif isinstance(mod, nn.Embedding):
                sites[mod] = _Site("embedding", moved(mod.weight))
            elif _is_rmsnorm(mod):
                sites[mod] = _Site("rmsnorm", moved(mod.weight))
        covered = {n for s in sites.values() for n in (s.weight, s.bias) if n}
        if missing := sorted(moving - covered):
            raise ValueError(
                f"es.perturbation: lowrank cannot carry the perturbation of {missing[:5]} through the batched "
                "forward: it handles matrices of nn.Linear and nn.Embedding, Linear biases and RMSNorm weights. "
                "Use es.lowrank_vectors: frozen (1-D tensors unperturbed), or es.perturbation: full"
            )
        return {m: s for m, s in sites.items() if s.weight or s.bias}

    def _prepare(self, members: Sequence[PerturbedMember]) -> _Batch:
        """Scaled factors and vector noise of ``members``, stacked per parameter, in the compute dtype."""
        batch = _Batch(len(members))
        mats, vecs = self.weights.population([(m.seed, m.scale) for m in members])  # fp32, drawn at once
        for name, (a, b) in mats.items():
            dtype = self.weights.live[name].dtype
            batch.a[name], batch.b[name] = a.to(dtype), b.to(dtype)
            batch.at[name] = batch.a[name].transpose(1, 2).contiguous()
            batch.bt[name] = batch.b[name].transpose(1, 2).contiguous()
        for name, eps in vecs.items():
            batch.vec[name] = eps.to(self.weights.live[name].dtype)
        return batch

    def _hook(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        batch, site = self._batch, self.sites[module]
        if batch is None:
            return None
        x, u = args[0], batch.members
        if x.shape[0] % u:
            raise RuntimeError(f"low-rank forward: {x.shape[0]} rows do not split into {u} members")
        # added in place into the module's fresh output (one kernel per term, no temporaries of its size): the
        # hooks run at every decoding step on every perturbed module, so their op count is ES's cost here
        y = out.reshape(u, -1, out.shape[-1])
        if site.kind == "linear":
            if site.weight:
                xb = torch.bmm(x.reshape(u, -1, x.shape[-1]), batch.b[site.weight])  # (U, L, r)
                _add_outer(y, xb, batch.at[site.weight])
            if site.bias:
                y.add_(batch.vec[site.bias][:, None, :])
        elif site.kind == "embedding":
            ids = x.reshape(u, -1, 1)
            a = batch.a[site.weight]
            rows = torch.gather(a, 1, ids.expand(-1, -1, a.shape[-1]))  # (U, L, r): rows t of s A / sqrt(r)
            _add_outer(y, rows, batch.bt[site.weight])
        else:  # rmsnorm
            h = x.to(torch.float32)
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(x.dtype)
            y.addcmul_(batch.vec[site.weight][:, None, :], h.reshape(u, -1, h.shape[-1]))
        return y.reshape(out.shape)

    @contextmanager
    def _hooked(self) -> Iterator[None]:
        handles = [m.register_forward_hook(self._hook) for m in self.sites]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._batch = None

    # ---------------------------------------------------------------- the population
    def members_per_call(self, n_prompts: int, n: int) -> int:
        """How many whole members one generate call holds (1 when a member's rows exceed generation.batch_size)."""
        return max(1, self.batch_size // (n_prompts * n))

    def calls(self, n_members: int, n_prompts: int, n: int) -> list[tuple[list[int], slice]]:
        """The generate calls of a population: (members, prompt slice) each, rows = len(members) x prompts x n."""
        rows = n_prompts * n
        if rows <= self.batch_size:
            per = self.batch_size // rows
            return [(list(range(i, min(i + per, n_members))), slice(0, n_prompts)) for i in range(0, n_members, per)]
        per_call = max(1, self.batch_size // n)
        return [
            ([i], slice(s, min(s + per_call, n_prompts)))
            for i in range(n_members)
            for s in range(0, n_prompts, per_call)
        ]

    @torch.no_grad()
    def evaluate(
        self, gen: Any, members: Sequence[PerturbedMember], prompts: Sequence[str], sampling: SamplingParams
    ) -> PopulationOutput:
        """Every member's responses (direction seed, scale, generation seed) from batched generate calls of
        ``gen`` (module docstring); generation_s is their wall time, perturb_restore_s the time drawing factors."""
        if self.weights.perturbed:
            raise RuntimeError("evaluate_population() on perturbed weights: restore first")
        out = PopulationOutput([[] for _ in members])
        greedy = sampling.temperature == 0
        # greedy HF decoding takes no num_return_sequences: each prompt is repeated n times here, as HF would
        gcfg = gen.generation_config(replace(sampling, n=1), sample=False)
        sampler = None if greedy else _MemberSampler(sampling, [m.gen_seed for m in members], self.model.device)
        with self._hooked():
            for idx, span in self.calls(len(members), len(prompts), sampling.n):
                t0 = time.perf_counter()
                self._batch = self._prepare([members[i] for i in idx])
                t1 = time.perf_counter()
                chunk = [p for _ in idx for p in prompts[span] for _ in range(sampling.n)]
                procs = [sampler.rows_of(idx)] if sampler else []
                gens = gen.generate_call(chunk, gcfg, sampling, procs)
                out.perturb_restore_s += t1 - t0
                out.generation_s += time.perf_counter() - t1
                per = len(gens) // len(idx)
                for k, i in enumerate(idx):
                    out.generations[i] += gens[k * per : (k + 1) * per]
        return out


class _MemberSampler:
    """Samples each member's rows from the member's own generator (module docstring): HF's temperature and top-p
    warpers, softmax, multinomial, then every other token is masked so HF's greedy step picks the sample."""

    def __init__(self, sampling: SamplingParams, gen_seeds: Sequence[int], device: Any) -> None:
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.warpers: list[Any] = []
        if sampling.temperature != 1.0:  # as HF adds them (generation/utils.py:_get_logits_processor)
            self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
        dev = torch.device(device)
        self.gens = [torch.Generator(device=dev).manual_seed(int(g)) for g in gen_seeds]
        self.members: list[int] = []

    def rows_of(self, members: list[int]) -> _MemberSampler:
        """This sampler for a generate call over ``members`` (in row order)."""
        self.members = members
        return self

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for w in self.warpers:
            scores = w(input_ids, scores)
        probs = nn.functional.softmax(scores, dim=-1)
        per = probs.shape[0] // len(self.members)
        picks = [
            torch.multinomial(probs[k * per : (k + 1) * per], num_samples=1, generator=self.gens[i])
            for k, i in enumerate(self.members)
        ]
        mask = torch.full_like(scores, float("-inf"))
        return mask.scatter_(1, torch.cat(picks), 0.0)


class HFLowRankBackend(HFBackend):
    """HFBackend for ``es.perturbation: lowrank``: rank-r directions (LowRankWeights, esbatch/perturb/lowrank.py)
    and the whole population generated in batched calls (LowRankPopulation above, docs/lowrank.md)."""

    def __init__(
        self, model: Any, tokenizer: Any, *, rank: int = 1, vectors: str = "full", **options: Any
    ) -> None:  # options: HFBackend's (batch_size, track_drift, restore, noise, master)
        master, restore = options.get("master", "device"), options.get("restore", "exact")
        if master != "device":
            raise ValueError(f"es.perturbation: lowrank needs es.master: device (got {master})")
        if restore != "exact":
            raise ValueError(
                f"es.perturbation: lowrank needs es.restore: exact (got {restore}): the batched forward never moves "
                "the weights, and the update is accumulated on the fp32 center"
            )
        self.rank, self.vectors = rank, vectors
        super().__init__(model, tokenizer, **options)
        self.population = LowRankPopulation(model, self.weights, self.batch_size)

    def make_weights(self, params: dict[str, torch.Tensor], restore: str, track_drift: bool, noise: str) -> Any:
        return LowRankWeights(params, track_drift, noise, self.rank, self.vectors)

    @classmethod
    def es_options(cls, setup: ESSetup) -> dict[str, Any]:
        return {**super().es_options(setup), "rank": setup.rank, "vectors": setup.lowrank_vectors}

    def evaluate_population(
        self,
        members: Sequence[PerturbedMember],
        prompts: Sequence[str],
        sampling: SamplingParams,
        claim: Claim | None = None,
    ) -> PopulationOutput:
        """All members in batched generate calls, each row carrying its member's perturbation (no perturb/restore).

        ``claim`` (ranks sharing the population, es.dispatch: dynamic): this rank takes one generate call's worth
        of members at a time from it until none is left. Each member samples from its own generator, so how the
        members are grouped into calls does not change its responses."""
        if claim is None:
            return self.population.evaluate(self, members, prompts, sampling)
        per = self.population.members_per_call(len(prompts), sampling.n)
        got: dict[int, list[Generation]] = {}
        gen_s = move_s = 0.0
        while True:
            chunk: list[int] = []
            while len(chunk) < per and (i := claim()) is not None:
                chunk.append(i)
            if not chunk:
                break
            pop = self.population.evaluate(self, [members[i] for i in chunk], prompts, sampling)
            got.update(zip(chunk, pop.generations))
            gen_s, move_s = gen_s + pop.generation_s, move_s + pop.perturb_restore_s
        order = sorted(got)
        return PopulationOutput([got[i] for i in order], gen_s, move_s, members=order)
