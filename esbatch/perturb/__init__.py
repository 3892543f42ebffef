"""How ES moves weights, shared by every backend: noise directions from (seed, tensor name), the update
theta += alpha/N sum_i w_i eps_i, and live weights that either follow an fp32 center with exact restore
(centered.py, es.restore: exact; offload.py keeps that center in host memory or on disk, es.master) or are
moved in place in the compute dtype as the paper does (inplace.py)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from esbatch.perturb.centered import CenteredWeights
from esbatch.perturb.inplace import InplaceWeights
from esbatch.perturb.noise import DEFAULT_NOISE, LEGACY_NOISE, NOISES, direction, draw, tensor_seed
from esbatch.perturb.offload import MASTERS, OffloadedWeights
from esbatch.perturb.update import UpdateSpec, es_update, es_update_inplace

RESTORE_MODES = ("exact", "inplace")  # es.restore


def weights_for(
    live: Mapping[str, torch.Tensor],
    restore: str = "exact",
    track_drift: bool = True,
    noise: str = DEFAULT_NOISE,
    master: str = "device",
) -> CenteredWeights | InplaceWeights | OffloadedWeights:
    """The keeper of the live weights for ``es.restore`` and ``es.master``: CenteredWeights (exact, the fp32
    center next to the weights), OffloadedWeights (exact, the center in host memory or on disk) or
    InplaceWeights (inplace), drawing eps with generator ``noise`` (es.noise)."""
    kinds = {"exact": CenteredWeights, "inplace": InplaceWeights}
    if restore not in kinds:
        raise ValueError(f"es.restore: unknown mode {restore!r}; valid: {', '.join(RESTORE_MODES)}")
    if master not in MASTERS:
        raise ValueError(f"es.master: unknown layout {master!r}; valid: {', '.join(MASTERS)}")
    if master != "device":
        if restore != "exact":
            raise ValueError(f"es.master: {master} keeps an fp32 center, which es.restore: {restore} has none of")
        return OffloadedWeights(live, track_drift, noise, master)
    return kinds[restore](live, track_drift, noise)


__all__ = [
    "DEFAULT_NOISE",
    "LEGACY_NOISE",
    "MASTERS",
    "NOISES",
    "RESTORE_MODES",
    "CenteredWeights",
    "InplaceWeights",
    "OffloadedWeights",
    "UpdateSpec",
    "direction",
    "draw",
    "es_update",
    "es_update_inplace",
    "tensor_seed",
    "weights_for",
]
