"""Low-rank ES inside a vLLM worker (``es.perturbation: lowrank``, backend.name: vllm): the whole population in one
engine's batch, each request carrying its member, each token its member's perturbation.

The arithmetic is the HF backend's (esbatch/backends/hf_lowrank.py), written for vLLM's flat batches. vLLM runs
all scheduled tokens of all requests as one (T, hidden) tensor, in the order of the model runner's persistent
batch (which it reorders between steps), so the hooks cannot assume member-major rows: before each forward pass
a pre-hook on the model reads which request every token belongs to (``runner.req_indices``, filled for this step
by ``_prepare_inputs``) and which member every request belongs to (``SamplingParams.extra_args["es_member"]``,
set by the driver, esbatch/backends/vllm.py), and groups the rows by member (``_Groups``: while no request has
finished the batch is member-major already and the rows are only viewed; otherwise they are gathered into
(members, rows per member) slots and the products added back with index_add_), so each term is one batched
matmul per module, as in the HF backend:

    linear (fused too)  y[:, rows of part p] += (x B_p[m_t]) (s A_p / sqrt(r))[m_t]^T   [+ s eps(bias_p)[m_t]]
    embedding           y += (s A / sqrt(r))[m_t][token_t] B[m_t]^T
    RMSNorm             y += s eps(w)[m_t] * n(h)       h: the input, or the residual sum a fused add returns
    logits              logits_j += (h_j B[m_j]) (s A / sqrt(r))[m_j]^T      one row per request (m_j: its member)

A fused qkv_proj / gate_up_proj holds several HF matrices (esbatch/backends/layout.py): each part has its own
factors, applied to its own slice of the output features, as on the HF model. A tied embedding / lm_head is one
parameter with one (A, B), used by the lookup and by the logits. Tokens of requests without a member (evaluating the
center on the same engine) and padding tokens get member U, whose factors are zero.

Prefix caching: requests of different members with the same prompt must not share attention states, so the
driver salts each member's requests with its (seed, scale) (``cache_salt``); the cache is reset whenever the center
changes (update, load), as for full-rank ES.
Needs eager execution (no torch.compile, no CUDA graphs: the hooks read Python state at every step); the driver
starts low-rank engines with enforce_eager.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from esbatch.perturb.lowrank import LowRankWeights, factors, is_matrix
from esbatch.perturb.noise import direction, eps_device

Part = tuple[str, int, int]  # (HF name, first row in the engine tensor, rows)


@dataclass
class _Site:
    kind: str  # linear | embedding | rmsnorm | logits
    weight: list[Part] = field(default_factory=list)  # perturbed parts of the weight (several when fused)
    bias: list[Part] = field(default_factory=list)


@dataclass
class _Members:
    """One population on this engine: U members' scaled factors (+ a zero member U), stacked per HF tensor."""

    count: int
    a: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, m, r): s A / sqrt(r)
    at: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, r, m)
    b: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, n, r)
    bt: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, r, n)
    vec: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, d): s eps
    b_cat: dict[int, torch.Tensor] = field(default_factory=dict)  # id(module) -> (U+1, n, parts * r)


class EngineLowRank:
    """The hooks of one vLLM model runner's model, for the members of ``begin`` until ``end``."""

    def __init__(self, runner: Any, weights: LowRankWeights, rows: dict[str, list[Part]]) -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        self.runner, self.weights, self.rank = runner, weights, weights.rank
        model = runner.model
        engine_name = {id(p): n for n, p in model.named_parameters()}
        moving = set(weights.perturbed_names())

        def parts(p: Any) -> list[Part]:
            name = engine_name.get(id(p)) if isinstance(p, torch.Tensor) else None
            return [part for part in rows.get(name, []) if part[0] in moving] if name else []

        self.sites: dict[nn.Module, _Site] = {}
        for qual, mod in model.named_modules():
            if isinstance(mod, LinearBase):
                site = _Site("linear", parts(getattr(mod, "weight", None)), parts(getattr(mod, "bias", None)))
                if site.bias and mod.skip_bias_add:
                    raise ValueError(f"{qual}: skip_bias_add layers are not supported by the low-rank forward")
            elif isinstance(mod, VocabParallelEmbedding) and not isinstance(mod, ParallelLMHead):
                site = _Site("embedding", parts(mod.weight))
            elif isinstance(mod, RMSNorm):
                if mod.variance_size_override is not None:
                    raise ValueError(f"{qual}: RMSNorm over part of the hidden size is not supported (low rank)")
                site = _Site("rmsnorm", parts(mod.weight) if mod.has_weight else [])
            elif isinstance(mod, LogitsProcessor):
                head = getattr(model, "lm_head", None)
                if mod.soft_cap is not None or mod.scale != 1.0 or mod.logits_as_input:
                    raise ValueError(f"{qual}: logits soft-capping or scaling is not supported (low rank)")
                site = _Site("logits", parts(getattr(head, "weight", None)))
            else:
                continue
            if site.weight or site.bias:
                self.sites[mod] = site
        covered = {part[0] for s in self.sites.values() for part in (*s.weight, *s.bias)}
        if missing := sorted(moving - covered):
            raise ValueError(
                f"es.perturbation: lowrank cannot carry the perturbation of {missing[:5]} through vLLM's batched "
                "forward: it handles vLLM's linear layers (fused too), embeddings, the logits and RMSNorm weights. "
                "Use es.lowrank_vectors: frozen, es.perturbation: full, or backend.name: hf"
            )
        self.members: _Members | None = None
        self.handles: list[Any] = []
        self.token_member = self.row_member = torch.zeros(0, dtype=torch.long)

    # ---------------------------------------------------------------- a population
    def begin(self, members: Sequence[tuple[int, float]]) -> None:
        """Draw the factors of ``members`` (direction seed, scale) and hook them into the model: request j with
        extra_args {"es_member": k} is member k until ``end``."""
        if self.members is not None:
            self.end()
        self.members = self._prepare(members)
        self.handles = [self.runner.model.register_forward_pre_hook(self._map_tokens, with_kwargs=True)]
        self.handles += [m.register_forward_hook(self._hook) for m in self.sites]

    def end(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.members = [], None

    def _prepare(self, members: Sequence[tuple[int, float]]) -> _Members:
        out = _Members(len(members))
        c = 1.0 / math.sqrt(self.rank)
        for name in self.weights.perturbed_names():
            p = self.weights.live[name]
            if is_matrix(p):
                fs = [factors(seed, name, p.shape, self.rank, self.weights.noise, p.device) for seed, _ in members]
                zero_a = torch.zeros(p.shape[0], self.rank, device=p.device)
                zero_b = torch.zeros(p.shape[1], self.rank, device=p.device)
                a = torch.stack([f[0].mul_(s * c).to(p.device) for f, (_, s) in zip(fs, members)] + [zero_a])
                b = torch.stack([f[1].to(p.device) for f in fs] + [zero_b])
                out.a[name], out.b[name] = a.to(p.dtype), b.to(p.dtype)
                out.at[name] = out.a[name].transpose(1, 2).contiguous()
                out.bt[name] = out.b[name].transpose(1, 2).contiguous()
            else:
                where, noise = eps_device(self.weights.noise, p.device), self.weights.noise
                eps = [direction(seed, name, p.shape, noise, where).to(p.device) * s for seed, s in members]
                out.vec[name] = torch.stack([*eps, torch.zeros(p.shape, device=p.device)]).to(p.dtype)
        for mod, site in self.sites.items():
            if site.kind == "linear" and len(site.weight) > 1:  # one bmm for all parts of a fused matrix
                out.b_cat[id(mod)] = torch.cat([out.b[hf] for hf, _, _ in site.weight], dim=2)
        return out

    # ---------------------------------------------------------------- per step: which member each token is
    def _map_tokens(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        runner, u = self.runner, self.members.count if self.members else 0
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        n_tokens = ids.shape[0]
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_member = []
        for rid in batch.req_ids[:num_reqs]:
            extra = runner.requests[rid].sampling_params.extra_args or {}
            k = extra.get("es_member", u)
            if not 0 <= k <= u:
                raise RuntimeError(f"request {rid}: es_member {k} outside this population of {u} members")
            req_member.append(k)
        rows = torch.tensor(req_member, dtype=torch.long)
        scheduled = int(runner.query_start_loc.np[num_reqs])
        tokens = torch.full((n_tokens,), u, dtype=torch.long)
        tokens[:scheduled] = rows[runner.req_indices.cpu[:scheduled].long()]
        device = ids.device
        self.token_member, self.row_member = tokens.to(device), rows.to(device)
        self.token_groups, self.row_groups = _Groups.of(tokens, device), _Groups.of(rows, device)

    # ---------------------------------------------------------------- the perturbation of each site
    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        site, mem = self.sites[module], self.members
        out = output[0] if isinstance(output, tuple) else output
        if site.kind == "logits":
            h, groups = args[1], self.row_groups
            if h.shape[0] != self.row_member.shape[0]:
                raise RuntimeError(f"low-rank logits: {h.shape[0]} rows for {self.row_member.shape[0]} requests")
            hf = site.weight[0][0]
            groups.add(out, groups.matmul(groups.rows(h), mem.b[hf]), mem.at[hf])
            return
        m, groups = self.token_member, self.token_groups
        if site.kind == "linear":
            x = args[0].reshape(-1, args[0].shape[-1])
            y = out.reshape(-1, out.shape[-1])
            if site.weight:
                b = mem.b_cat.get(id(module))
                xb = groups.matmul(groups.rows(x), mem.b[site.weight[0][0]] if b is None else b)  # (G, L, parts*r)
                for k, (hf, row, rows) in enumerate(site.weight):
                    groups.add(y[:, row : row + rows], xb[:, :, k * self.rank : (k + 1) * self.rank], mem.at[hf])
            for hf, row, rows in site.bias:
                y[:, row : row + rows].add_(mem.vec[hf].index_select(0, m))
        elif site.kind == "embedding":
            hf = site.weight[0][0]
            pick = mem.a[hf][m, args[0].reshape(-1).long()]  # (T, r): row token_t of s A / sqrt(r), its member's
            groups.add(out.reshape(-1, out.shape[-1]), groups.rows(pick), mem.bt[hf])
        else:  # rmsnorm: n(h) of the input, or of the residual sum a fused add-norm returns
            h = output[1] if isinstance(output, tuple) else args[0]
            hf = site.weight[0][0]
            f = h.to(torch.float32)
            n = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(out.dtype)
            vec = mem.vec[hf].index_select(0, m)
            out.addcmul_(vec.view(vec.shape[0], *([1] * (out.dim() - 2)), vec.shape[-1]), n)


@dataclass
class _Groups:
    """The rows of one step grouped by member, so each group multiplies by its member's factors in one batched
    matmul (as the HF backend's member-major rows do), whatever order vLLM's batch holds the rows in.

    G members present, L = the most rows any of them has; slot (g, l) holds row ``slots[g * L + l]`` (padding
    slots hold row 0 with ``mask`` 0). ``direct``: the rows already are member-major with L rows each (vLLM's
    batch while no request has finished), so rows are viewed, not gathered, and the product is added in place.
    """

    members: torch.Tensor  # (G,) the members present, ascending
    length: int  # L
    slots: torch.Tensor  # (G * L,) row index of each slot
    mask: torch.Tensor | None  # (G, L, 1): 1 for real slots, 0 for padding (None: no padding)
    direct: bool
    prefix: bool  # members are 0 .. G-1: factor stacks are sliced, not gathered

    @staticmethod
    def of(member: torch.Tensor, device: Any) -> _Groups:
        """``member``: (T,) each row's member, on the CPU."""
        order = torch.argsort(member, stable=True)
        present, counts = torch.unique_consecutive(member[order], return_counts=True)
        length = int(counts.max()) if len(counts) else 0
        g = len(present)
        direct = bool((counts == length).all()) and bool((order == torch.arange(len(member))).all())
        pos = torch.arange(length).expand(g, length)
        real = pos < counts[:, None]
        slots = torch.zeros(g, length, dtype=torch.long)
        slots[real] = order
        prefix = bool((present == torch.arange(g)).all())
        return _Groups(
            present.to(device),
            length,
            slots.reshape(-1).to(device),
            None if bool(real.all()) else real[..., None].to(device),
            direct,
            prefix,
        )

    def stack(self, factors: torch.Tensor) -> torch.Tensor:
        """The present members' entries of a (U+1, ...) factor stack."""
        g = self.members.shape[0]
        return factors[:g] if self.prefix else factors.index_select(0, self.members)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """(T, k) rows -> (G, L, k), grouped by member."""
        if self.direct:
            return x.reshape(self.members.shape[0], self.length, x.shape[-1])
        return x.index_select(0, self.slots).view(self.members.shape[0], self.length, x.shape[-1])

    def matmul(self, grouped: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """(G, L, n) @ factors[member] (n, k) -> (G, L, k)."""
        return torch.bmm(grouped, self.stack(factors))

    def add(self, y: torch.Tensor, left: torch.Tensor, right_t: torch.Tensor) -> None:
        """y (T, k) += left (G, L, r) @ right_t[member] (r, k), in place, each row from its own slot."""
        right = self.stack(right_t)
        if self.direct:  # a view of y's rows (strided for one part of a fused output), added in place
            view = y.unflatten(0, (self.members.shape[0], self.length))
            if left.shape[-1] == 1:
                view.addcmul_(left, right)
            else:
                view.baddbmm_(left, right)
            return
        if self.mask is not None:  # padding slots (copies of row 0) add nothing
            left = left * self.mask.to(left.dtype)
        prod = left * right if left.shape[-1] == 1 else torch.bmm(left, right)  # (G, L, k)
        y.index_add_(0, self.slots, prod.view(-1, prod.shape[-1]))
