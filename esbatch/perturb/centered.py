"""Live weights that follow an fp32 center: the in-place ES moves every backend makes.

``live`` maps HF parameter names to the tensors a model generates with (an HF model's parameters, or
views into a vLLM engine's fused tensors, esbatch/backends/layout.py). The center lives in an fp32 copy,
so restore() is an exact copy, a perturbation is computed in fp32 and rounded once, and the update is
accumulated in fp32 (esbatch/perturb/update.py). Cost: one fp32 copy of the parameters (4 bytes/param), plus one
for theta_0 when drift is tracked. This is ``es.restore: exact`` (the default). In-place add/subtract, the
paper's implementation, needs no copy but does not restore exactly (8% of SmolLM2 fp32 elements off after one
cycle at sigma=0.01, measured): ``es.restore: inplace``, esbatch/perturb/inplace.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from esbatch.models import checksum
from esbatch.perturb.jobs import perturb_jobs, run_jobs
from esbatch.perturb.noise import DEFAULT_NOISE, check_noise, draw, eps_device, perturb_into, spans
from esbatch.perturb.update import UpdateSpec, es_update, flat


class CenteredWeights:
    restore_mode = "exact"

    def __init__(self, live: Mapping[str, torch.Tensor], track_drift: bool = True, noise: str = DEFAULT_NOISE) -> None:
        self.noise = check_noise(noise)  # es.noise: the generator of eps (esbatch/perturb/noise.py)
        self.live = dict(live)
        self.master = {n: t.detach().to(torch.float32, copy=True) for n, t in self.live.items()}
        self.theta0 = {n: t.clone() for n, t in self.master.items()} if track_drift else None
        self._theta0_norm = norm(self.theta0.values()) if self.theta0 else None
        self.perturbed = False

    @torch.no_grad()
    def perturb(self, seed: int, scale: float, over: bool = False) -> None:
        """live <- center + scale * eps(seed), from the center only, chunk by chunk (noise.spans)."""
        if self.perturbed and not over:  # over: straight from one member to the next (every weight is rewritten)
            raise RuntimeError("perturb() called on perturbed weights: restore first")
        self.perturbed = True
        jobs, rest = [], []  # fp32 on the CPU: every tensor in one pass of the C kernel, in one run (perturb_into)
        for name, p in self.live.items():
            j = perturb_jobs(seed, name, 0, scale, self.master[name], p, self.noise) if p.is_contiguous() else None
            if j is None:
                rest.append(name)
            else:
                jobs.extend(j)
        run_jobs(jobs)
        for name in rest:
            p = self.live[name]
            master = self.master[name].reshape(-1)  # read only: a copy only for a non-contiguous view
            where = eps_device(self.noise, p.device)
            with flat(p) as dst:
                for s, e in spans(p.numel(), self.noise):
                    if perturb_into(seed, name, s, scale, master[s:e], dst[s:e], self.noise):
                        continue  # fp32 on the CPU: the same bits in one pass (noise.perturb_into)
                    eps = draw(seed, name, s, e - s, where, self.noise).to(p.device)
                    dst[s:e].copy_(eps.mul_(scale).add_(master[s:e]))

    @torch.no_grad()
    def restore(self) -> None:
        for name, p in self.live.items():
            p.copy_(self.master[name])
        self.perturbed = False

    @torch.no_grad()
    def update(self, spec: UpdateSpec) -> tuple[float, float]:
        """The ES step on the fp32 center, copied to the live weights; (update L2, fraction of live elements
        whose compute-dtype value changed)."""
        if self.perturbed:
            raise RuntimeError("update() called on perturbed weights: restore first")
        l2 = self.step(spec)
        changed = total = 0
        for name, p in self.live.items():
            new = self.master[name].to(p.dtype)
            changed += int((new != p).sum())
            total += p.numel()
            p.copy_(new)
        return l2, changed / total

    def step(self, spec: UpdateSpec) -> float:
        """Apply the update to the fp32 center in place; its L2 norm (a subclass changes the directions here)."""
        return es_update(self.master, spec, self.noise)

    @torch.no_grad()
    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the center (resume, or an earlier stage's weights)."""
        if diff := set(self.master) ^ set(state):
            raise KeyError(f"checkpoint and model disagree on parameters: {sorted(diff)[:5]}")
        for name, t in state.items():
            self.master[name].copy_(t)
            self.live[name].copy_(self.master[name])
        self.perturbed = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of the fp32 center (what center.safetensors holds in this mode)."""
        return {n: t.clone() for n, t in self.master.items()}

    def rel_distance(self) -> float | None:
        """||theta_t - theta_0|| / ||theta_0|| when drift is tracked."""
        if self.theta0 is None:
            return None
        return distance(self.master.items(), self.theta0) / self._theta0_norm

    def checksum(self) -> float:
        """A fingerprint of the fp32 center (esbatch/models.py:checksum), equal on processes holding equal centers."""
        return checksum(self.master)

    def memory_report(self) -> dict[str, float]:
        model_bytes = sum(p.numel() * p.element_size() for p in self.live.values())
        master_bytes = sum(t.numel() * 4 for t in self.master.values())
        theta0_bytes = master_bytes if self.theta0 is not None else 0
        return {"model_bytes": model_bytes, "master_bytes": master_bytes, "theta0_bytes": theta0_bytes}


NORM_CHUNK = 1 << 20  # elements per float64 partial sum: no float64 (or difference) copy of a whole tensor


def norm(tensors: Iterable[torch.Tensor]) -> float:
    """sqrt(sum of squares) over all elements, in float64, chunk by chunk (a whole-tensor float64 cast of an
    embedding is hundreds of MB, which would set the run's peak memory)."""
    return sum(_sq(t.reshape(-1)) for t in tensors) ** 0.5


def distance(tensors: Iterable[tuple[str, torch.Tensor]], ref: dict[str, torch.Tensor]) -> float:
    """||tensors - ref|| over all elements (fp32 differences of each tensor's chunks), in float64."""
    total = 0.0
    for name, t in tensors:
        a, b = t.reshape(-1), ref[name].reshape(-1)
        for s in range(0, a.numel(), NORM_CHUNK):
            total += _sq(a[s : s + NORM_CHUNK].float() - b[s : s + NORM_CHUNK])
    return total**0.5


def _sq(t: torch.Tensor) -> float:
    return sum(
        float(torch.linalg.vector_norm(t[s : s + NORM_CHUNK], dtype=torch.float64)) ** 2
        for s in range(0, t.numel(), NORM_CHUNK)
    )
