"""Low-rank ES inside a vLLM worker (``es.perturbation: lowrank``, backend.name: vllm): the whole population in one
engine's batch, each request carrying its member, each token its member's perturbation.

The arithmetic is the HF backend's (esbatch/backends/hf_lowrank.py) on vLLM's flat (T, hidden) batch, which vLLM
reorders between steps: a pre-hook maps each token to its request (``runner.req_indices``) and each request to its
member (``SamplingParams.extra_args["es_member"]``, set by the driver's VLLMLowRankBackend,
esbatch/backends/vllm_lowrank_backend.py), and groups rows by member
(``_Groups``), so each term is one batched matmul per module. Hooked: linear layers (fused qkv_proj / gate_up_proj:
each HF part's factors on its slice, esbatch/backends/layout.py), the embedding, RMSNorm (y *= 1 + s eps(w) / w,
additive where w_j = 0) and the logits (a tied head shares the embedding's (A, B)). Tokens without a member (centre
evaluations, padding) get member U, whose factors are zero. The driver salts each member's prefix cache with its
(seed, scale) and starts engines eager: the hooks read Python state every step (docs/lowrank.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from esbatch.backends.base import PerturbedMember
from esbatch.perturb.lowrank import LowRankWeights

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
    a: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, m, r): s A / sqrt(r), for embedding lookups
    at: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, r, m): the same, transposed
    bt: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, r, n): B transposed
    vec: dict[str, torch.Tensor] = field(default_factory=dict)  # (U+1, d): s eps
    bt_cat: dict[int, torch.Tensor] = field(default_factory=dict)  # id(module) -> (U+1, parts * r, n)
    at_cat: dict[int, torch.Tensor] = field(default_factory=dict)  # id(module) -> (U+1, parts * r, out): r > 1
    gain: dict[int, torch.Tensor] = field(default_factory=dict)  # id(RMSNorm) -> (U+1, d) fp32: 1 + s eps / w


class EngineLowRank:
    """The hooks of one vLLM model runner's model, for the members of ``begin`` until ``end``."""

    def __init__(self, runner: Any, weights: LowRankWeights, rows: dict[str, list[Part]]) -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        self.runner, self.weights, self.rank = runner, weights, weights.rank
        model = runner.model
        self.dtype = next(model.parameters()).dtype
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
        self._buffers: dict[Any, torch.Tensor] = {}  # the stacks of the last population, reused (_buffer)
        self._scratch: dict[str, torch.Tensor] = {}  # fp32 draws (LowRankWeights.population)
        self.handles: list[Any] = []
        self.token_member = self.row_member = torch.zeros(0, dtype=torch.long)

    # ---------------------------------------------------------------- a population
    def begin(self, members: Sequence[PerturbedMember]) -> None:
        """Draw the factors of ``members`` (their direction seeds and scales) and hook them into the model:
        request j with extra_args {"es_member": k} is member k until ``end``."""
        if self.members is not None:
            self.end()
        self.members = self._prepare(members)
        self.handles = [self.runner.model.register_forward_pre_hook(self._map_tokens, with_kwargs=True)]
        self.handles += [m.register_forward_hook(self._hook) for m in self.sites]

    def end(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.members = [], None

    def _buffer(self, key: Any, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A stack of the next population, in memory reused from the last when the shape matches: a population's
        stacks are rewritten in full, and fresh memory costs a page fault per 4 KiB (half of a begin's time)."""
        have = self._buffers.get(key)
        if have is None or tuple(have.shape) != shape or (have.dtype, have.device) != (like.dtype, like.device):
            have = self._buffers[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return have

    @torch.no_grad()
    def _prepare(self, members: Sequence[PerturbedMember]) -> _Members:
        out = _Members(len(members))
        looked_up = {site.weight[0][0] for site in self.sites.values() if site.kind == "embedding"}
        u, r, buf = len(members), self.rank, self._buffer
        mats, vecs = self.weights.population([(m.seed, m.scale) for m in members], self._scratch)  # fp32, at once
        for name, (a, b) in mats.items():  # cast to the model's dtype; the last, member U, is zero
            p = self.weights.live[name]
            at, bt = buf((name, "at"), (u + 1, r, p.shape[0]), p), buf((name, "bt"), (u + 1, r, p.shape[1]), p)
            at[:u], bt[:u] = a.transpose(1, 2), b.transpose(1, 2)
            at[u], bt[u] = 0, 0
            out.at[name], out.bt[name] = at, bt
            if name in looked_up:
                out.a[name] = buf((name, "a"), (u + 1, p.shape[0], r), p).copy_(at.transpose(1, 2))
        for name, eps in vecs.items():
            vec = out.vec[name] = buf((name, "vec"), (u + 1, *eps.shape[1:]), self.weights.live[name])
            vec[:u], vec[u] = eps, 0
        for mod, site in self.sites.items():
            if site.kind == "linear" and len(site.weight) > 1:  # one bmm for all parts of a fused matrix
                first = out.bt[site.weight[0][0]]
                cat = buf((id(mod), "bt"), (u + 1, len(site.weight) * r, first.shape[-1]), first)
                out.bt_cat[id(mod)] = torch.cat([out.bt[hf] for hf, _, _ in site.weight], dim=1, out=cat)
                if r > 1:  # and one product into the whole output: part k's factors on its own columns, 0 elsewhere
                    cat = buf((id(mod), "at"), (u + 1, len(site.weight) * r, mod.weight.shape[0]), first).zero_()
                    for k, (hf, row, rows) in enumerate(site.weight):
                        cat[:, k * r : (k + 1) * r, row : row + rows] = out.at[hf]
                    out.at_cat[id(mod)] = cat
            if site.kind == "rmsnorm":  # (w + s eps) n(h) = out (1 + s eps / w) where no w_j is 0
                w = self.weights.live[site.weight[0][0]].to(torch.float32)
                if bool((w != 0).all()):
                    vec = out.vec[site.weight[0][0]]
                    gain = buf((id(mod), "gain"), tuple(vec.shape), w)
                    out.gain[id(mod)] = torch.div(vec.to(torch.float32), w, out=gain).add_(1)
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
        dtype = self.dtype
        self.token_groups, self.row_groups = _Groups.of(tokens, device, dtype), _Groups.of(rows, device, dtype)

    # ---------------------------------------------------------------- the perturbation of each site
    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        site, mem, r = self.sites[module], self.members, self.rank
        out = output[0] if isinstance(output, tuple) else output
        if site.kind == "logits":
            h, groups = args[1], self.row_groups
            if h.shape[0] != self.row_member.shape[0]:
                raise RuntimeError(f"low-rank logits: {h.shape[0]} rows for {self.row_member.shape[0]} requests")
            hf = site.weight[0][0]
            groups.lowrank(out, h, mem.bt[hf], [(0, out.shape[-1], mem.at[hf], 0)], r)
            return
        groups = self.token_groups
        if site.kind == "linear":
            x = args[0].reshape(-1, args[0].shape[-1])
            y = out.reshape(-1, out.shape[-1])
            if site.weight:
                bt = mem.bt_cat.get(id(module), mem.bt[site.weight[0][0]])
                if (at_cat := mem.at_cat.get(id(module))) is not None:  # fused, r > 1: one baddbmm_ over all parts
                    groups.lowrank(y, x, bt, [(0, y.shape[-1], at_cat, 0)], r * len(site.weight))
                else:
                    parts = [(row, rows, mem.at[hf], k) for k, (hf, row, rows) in enumerate(site.weight)]
                    groups.lowrank(y, x, bt, parts, r)
            for hf, row, rows in site.bias:
                groups.vector(y[:, row : row + rows], mem.vec[hf])
        elif site.kind == "embedding":
            hf = site.weight[0][0]
            pick = mem.a[hf][self.token_member, args[0].reshape(-1).long()]  # (T, r): row token_t of s A / sqrt(r)
            y = out.reshape(-1, out.shape[-1])
            groups.lowrank(y, pick, None, [(0, y.shape[-1], mem.bt[hf], 0)], r)
        elif (gain := mem.gain.get(id(module))) is not None:  # rmsnorm, out = w n(h): one multiply
            groups.scale(out.view(-1, out.shape[-1]), gain)
        else:  # rmsnorm with a zero weight entry: n(h) of the input, or of the residual sum a fused add-norm returns
            h = output[1] if isinstance(output, tuple) else args[0]
            f = h.reshape(-1, h.shape[-1]).to(torch.float32)  # h rsqrt(mean h^2 + eps), as the HF backend's, one op
            n = nn.functional.rms_norm(f, (f.shape[-1],), eps=module.variance_epsilon).to(out.dtype)
            groups.vector(out.reshape(-1, out.shape[-1]), mem.vec[site.weight[0][0]], n)


@dataclass
class _Block:
    """Rows ``start`` .. ``start + count * length``: ``count`` runs of ``length`` rows, each run one member's, so
    they are viewed as (count, length, k) and multiplied in place; ``pick``: the runs' entries of a (U+1, ...)
    factor stack (a slice when their members ascend by one, else an index)."""

    start: int
    count: int
    length: int
    pick: slice | torch.Tensor


@dataclass
class _Gather:
    """Rows in no block, gathered into (members, L) slots: slot (g, l) holds row ``slots[g * L + l]`` (padding
    slots hold a real row with ``mask`` 0, so they add nothing); ``rows`` / ``member``: each such row and its
    member, for per-row vector terms."""

    pick: torch.Tensor  # (G,) the members present
    length: int  # L
    slots: torch.Tensor  # (G * L,)
    mask: torch.Tensor | None  # (G, L, 1) in the model's dtype, None without padding
    rows: torch.Tensor
    member: torch.Tensor


@dataclass
class _Groups:
    """The rows of one step grouped by member, so each member's term is a batched matmul with its own factors (as
    the HF backend's member-major rows), whatever order vLLM's batch holds the rows in.

    vLLM lays a step's tokens out request by request, in its persistent batch's order: member-major while the
    driver's requests are in the order it sent them, shuffled where finished requests left holes that later ones
    moved into. So the rows are cut into runs of one member; consecutive runs of the same length form a
    ``_Block`` (viewed in place: the prefill of whole prompts, the decode steps of a batch in order) when it holds
    at least ``MIN_BLOCK`` rows; the rest are gathered by member (``_Gather``) and added back with index_add_.
    """

    blocks: list[_Block]
    gather: _Gather | None

    MIN_BLOCK = 32

    @staticmethod
    def of(member: torch.Tensor, device: Any, dtype: torch.dtype = torch.float32) -> _Groups:
        """``member``: (T,) each row's member, on the CPU."""
        t = member.shape[0]
        if t == 0:
            return _Groups([], None)
        change = torch.ones(t, dtype=torch.bool)
        change[1:] = member[1:] != member[:-1]
        starts = change.nonzero().flatten()
        lengths = torch.diff(starts, append=torch.tensor([t])).tolist()
        owners, starts = member[starts].tolist(), starts.tolist()
        blocks, loose, i = [], [], 0
        while i < len(starts):  # consecutive runs of equal length
            j = i + 1
            while j < len(starts) and lengths[j] == lengths[i]:
                j += 1
            count, length = j - i, lengths[i]
            if count * length >= _Groups.MIN_BLOCK:
                ids = owners[i:j]
                pick: slice | torch.Tensor = (
                    slice(ids[0], ids[0] + count)
                    if ids == list(range(ids[0], ids[0] + count))
                    else torch.tensor(ids, device=device)
                )
                blocks.append(_Block(starts[i], count, length, pick))
            else:
                loose.append((starts[i], starts[i] + count * length))
            i = j
        if not loose:
            return _Groups(blocks, None)
        rows = torch.cat([torch.arange(a, b) for a, b in loose])
        owner = member[rows]
        order = torch.argsort(owner, stable=True)
        present, counts = torch.unique_consecutive(owner[order], return_counts=True)
        length = int(counts.max())
        real = torch.arange(length).expand(len(present), length) < counts[:, None]
        slots = torch.full((len(present), length), int(rows[0]), dtype=torch.long)
        slots[real] = rows[order]
        mask = None if bool(real.all()) else real[..., None].to(device=device, dtype=dtype)
        slots = slots.flatten().to(device)
        return _Groups(blocks, _Gather(present.to(device), length, slots, mask, rows.to(device), owner.to(device)))

    def lowrank(self, y: torch.Tensor, x: torch.Tensor, bt: torch.Tensor | None, parts: list, r: int) -> None:
        """y[:, c : c + w] += (x B[m])[:, k r : (k + 1) r] At[m] for each part (c, w, At, k), each row with its
        member m's factors, in place; Bt: (U+1, parts * r, n), At: (U+1, r, w). ``bt`` None: x holds the left
        factors already (T, r).

        x B[m] is computed as (Bt[m] x^T)^T (several times faster on CPU than x B with a few columns); a part that
        is a column slice of a fused output takes rank-1 terms in place (addcmul_), rank-r ones through a product
        added to it (baddbmm_ on a strided view is slow)."""
        for blk in self.blocks:
            rows = slice(blk.start, blk.start + blk.count * blk.length)
            xv = x[rows].view(blk.count, blk.length, x.shape[-1])
            left = xv if bt is None else torch.bmm(bt[blk.pick], xv.transpose(1, 2)).transpose(1, 2)
            for c, w, at, k in parts:
                yv = y[rows, c : c + w].unflatten(0, (blk.count, blk.length))
                lk, right = left[..., k * r : (k + 1) * r], at[blk.pick]
                if r == 1:
                    yv.addcmul_(lk, right)
                elif w == y.shape[-1]:
                    yv.baddbmm_(lk, right)
                else:
                    yv.add_(torch.bmm(lk, right))
        if (g := self.gather) is not None:
            xg = x.index_select(0, g.slots).view(g.pick.shape[0], g.length, x.shape[-1])
            left = xg if bt is None else torch.bmm(bt.index_select(0, g.pick), xg.transpose(1, 2)).transpose(1, 2)
            if g.mask is not None:
                left = left * g.mask
            for c, w, at, k in parts:
                lk, right = left[..., k * r : (k + 1) * r], at.index_select(0, g.pick)
                prod = lk * right if r == 1 else torch.bmm(lk, right)
                y[:, c : c + w].index_add_(0, g.slots, prod.reshape(-1, w))

    def vector(self, y: torch.Tensor, vec: torch.Tensor, n: torch.Tensor | None = None) -> None:
        """y += vec[m] (* n), each row with its member m's vector, in place; vec: (U+1, d)."""
        for blk in self.blocks:
            rows = slice(blk.start, blk.start + blk.count * blk.length)
            yv = y[rows].unflatten(0, (blk.count, blk.length))
            v = vec[blk.pick][:, None, :]
            yv.add_(v) if n is None else yv.addcmul_(v, n[rows].unflatten(0, (blk.count, blk.length)))
        if (g := self.gather) is not None:
            v = vec.index_select(0, g.member)
            y.index_add_(0, g.rows, v if n is None else v * n.index_select(0, g.rows))

    def scale(self, y: torch.Tensor, gain: torch.Tensor) -> None:
        """y *= gain[m], each row by its member m's gain, in place, the product in fp32; gain: (U+1, d) fp32."""
        for blk in self.blocks:
            rows = slice(blk.start, blk.start + blk.count * blk.length)
            y[rows].unflatten(0, (blk.count, blk.length)).mul_(gain[blk.pick][:, None, :])
        if (g := self.gather) is not None:
            scaled = y.index_select(0, g.rows) * gain.index_select(0, g.member)
            y.index_copy_(0, g.rows, scaled.to(y.dtype))
