"""Live weights moved in place in their compute dtype, as the paper's implementation does (``es.restore: inplace``).

Paper App. G.1: "add sigma*eps_i to every model parameter in place, generate ..., and then subtract the same
seeded perturbation to restore the center", and the update theta += alpha/N sum_i z_i eps_i is applied to
every engine's weights locally. Here, per tensor p (HF name ``name``) in its own dtype:

    perturb(seed, s):  d = round(s * round(eps(seed, name)))      eps: esbatch/perturb/noise.py, cast to p's dtype
                       p <- round(p + d)
    restore():         p <- round(p - d)                          the same d, rebuilt from (seed, name)
    update(spec):      esbatch/perturb/update.py:es_update_inplace

``round`` is the compute dtype's rounding after each operation. round(round(p + d) - d) is not p in general, so
every perturb/restore cycle leaves its round-off in the weights (in bfloat16 most elements move after a few
dozen cycles: benchmarks/inplace_roundoff.py) and the center depends on every cycle since theta_0. Resume
therefore replays each logged update's cycles before its update (esbatch/es/trainer.py:replay).

There is no fp32 master (it saves 4 bytes/param); theta_0 is still kept in fp32 when drift is tracked. The
exact alternative, and the default, is esbatch/perturb/centered.py.

Several replicas (vLLM engines, ranks) each evaluate their own members, so each keeps its own round-off and
their weights drift apart, as in the paper's eight engines. ``coordinate_sample`` and ``divergence`` measure
that after every update: every replica reads the same pseudo-random coordinates, and the values are compared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from esbatch.models import checksum
from esbatch.perturb.centered import distance, norm
from esbatch.perturb.noise import DEFAULT_NOISE, check_noise, draw, eps_device, spans
from esbatch.perturb.update import UpdateSpec, es_update_inplace, flat


class InplaceWeights:
    restore_mode = "inplace"
    master = None  # no fp32 copy of the center in this mode: the live weights are the center

    def __init__(self, live: Mapping[str, torch.Tensor], track_drift: bool = True, noise: str = DEFAULT_NOISE) -> None:
        self.noise = check_noise(noise)  # es.noise: the generator of eps (esbatch/perturb/noise.py)
        self.live = dict(live)
        self.theta0: dict[str, torch.Tensor] | None = None  # theta_0 in fp32, for drift
        if track_drift:
            self.theta0 = {n: t.detach().to(torch.float32, copy=True) for n, t in self.live.items()}
        self._theta0_norm = norm(self.theta0.values()) if self.theta0 else None
        self._member: tuple[int, float] | None = None  # (seed, scale) of the perturbation in the weights

    @property
    def perturbed(self) -> bool:
        return self._member is not None

    @torch.no_grad()
    def perturb(self, seed: int, scale: float) -> None:
        """live <- live + scale * eps(seed), in place in the compute dtype."""
        if self._member is not None:
            raise RuntimeError("perturb() called on perturbed weights: restore first")
        self._member = (seed, scale)
        self._move(seed, scale, +1)

    @torch.no_grad()
    def restore(self) -> None:
        """live <- live - scale * eps(seed) with the perturbation's own (seed, scale): the center up to round-off."""
        if self._member is None:
            return
        seed, scale = self._member
        self._move(seed, scale, -1)
        self._member = None

    def _move(self, seed: int, scale: float, sign: int) -> None:
        """p <- round(p + sign * d), d = round(scale * round(eps)) in p's dtype, chunk by chunk (noise.spans)."""
        for name, p in self.live.items():
            where = eps_device(self.noise, p.device)
            with flat(p) as dst:
                for s, e in spans(p.numel(), self.noise):
                    d = draw(seed, name, s, e - s, where, self.noise).to(device=p.device, dtype=p.dtype).mul_(scale)
                    dst[s:e].add_(d) if sign > 0 else dst[s:e].sub_(d)

    @torch.no_grad()
    def update(self, spec: UpdateSpec) -> tuple[float, float]:
        """The ES step in the compute dtype (es_update_inplace); (L2 of the step added, fraction of elements
        whose value changed)."""
        if self._member is not None:
            raise RuntimeError("update() called on perturbed weights: restore first")
        return es_update_inplace(self.live, spec, self.noise)

    @torch.no_grad()
    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the center: a checkpoint of this mode holds the compute-dtype weights and loads bit for bit
        (fp32 weights, e.g. an exact run's center as model.init_weights, are rounded once)."""
        if diff := set(self.live) ^ set(state):
            raise KeyError(f"checkpoint and model disagree on parameters: {sorted(diff)[:5]}")
        for name, t in state.items():
            self.live[name].copy_(t)
        self._member = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of the center in the compute dtype (what center.safetensors holds in this mode)."""
        return {n: p.detach().clone() for n, p in self.live.items()}

    def rel_distance(self) -> float | None:
        """||theta_t - theta_0|| / ||theta_0|| when drift is tracked."""
        if self.theta0 is None:
            return None
        return distance(self.live.items(), self.theta0) / self._theta0_norm

    def checksum(self) -> float:
        return checksum(self.live)

    def memory_report(self) -> dict[str, float]:
        model_bytes = sum(p.numel() * p.element_size() for p in self.live.values())
        theta0_bytes = sum(t.numel() * 4 for t in self.theta0.values()) if self.theta0 is not None else 0
        return {"model_bytes": model_bytes, "master_bytes": 0, "theta0_bytes": theta0_bytes}


SAMPLE_PER_TENSOR = 4096  # coordinates per tensor that replicas compare (every one of a smaller tensor)


def coordinate_sample(live: Mapping[str, torch.Tensor], per_tensor: int = SAMPLE_PER_TENSOR) -> torch.Tensor:
    """The values of the same coordinates on every replica, as one float64 vector (names sorted): all elements of
    a tensor with at most ``per_tensor``, else ``per_tensor`` drawn uniformly (with replacement) by a generator
    seeded from the tensor's name, so replicas in different processes read the same places."""
    parts = []
    for name in sorted(live):
        flat_p = live[name].detach().reshape(-1)
        n = flat_p.numel()
        if n <= per_tensor:
            parts.append(flat_p.to("cpu", torch.float64))
            continue
        seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") % 2**63
        idx = torch.randint(n, (per_tensor,), generator=torch.Generator().manual_seed(seed))
        parts.append(flat_p[idx.to(flat_p.device)].to("cpu", torch.float64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def divergence(samples: Sequence[torch.Tensor]) -> dict[str, float]:
    """How far replicas' weights differ on their ``coordinate_sample``s (replica 0 is the reference):
    the share of sampled coordinates where any replica differs, the largest spread (max - min over replicas), and
    the largest root-mean-square difference of a replica from replica 0."""
    s = torch.stack(list(samples))
    diff = s[1:] - s[0]
    return {
        "replicas/count": float(s.shape[0]),
        "replicas/sampled": float(s.shape[1]),
        "replicas/differing_fraction": float((diff != 0).any(0).double().mean()) if s.shape[0] > 1 else 0.0,
        "replicas/max_abs_diff": float((s.max(0).values - s.min(0).values).max()) if s.numel() else 0.0,
        "replicas/rms_diff": float(diff.pow(2).mean(1).sqrt().max()) if s.shape[0] > 1 else 0.0,
    }
