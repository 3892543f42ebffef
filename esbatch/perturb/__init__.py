"""How ES moves weights, shared by every backend: noise directions from (seed, tensor name), the update
theta += alpha/N sum_i w_i eps_i, and live weights that either follow an fp32 center with exact restore
(centered.py, es.restore: exact) or are moved in place in the compute dtype as the paper does (inplace.py)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from esbatch.perturb.centered import CenteredWeights
from esbatch.perturb.inplace import InplaceWeights
from esbatch.perturb.noise import DEFAULT_NOISE, LEGACY_NOISE, NOISES, direction, draw, tensor_seed
from esbatch.perturb.update import UpdateSpec, es_update, es_update_inplace

RESTORE_MODES = ("exact", "inplace")  # es.restore


def weights_for(
    live: Mapping[str, torch.Tensor], restore: str = "exact", track_drift: bool = True, noise: str = DEFAULT_NOISE
) -> CenteredWeights | InplaceWeights:
    """The keeper of the live weights for ``es.restore``: CenteredWeights (exact) or InplaceWeights (inplace),
    drawing eps with generator ``noise`` (es.noise)."""
    kinds = {"exact": CenteredWeights, "inplace": InplaceWeights}
    if restore not in kinds:
        raise ValueError(f"es.restore: unknown mode {restore!r}; valid: {', '.join(RESTORE_MODES)}")
    return kinds[restore](live, track_drift, noise)


__all__ = [
    "DEFAULT_NOISE",
    "LEGACY_NOISE",
    "NOISES",
    "RESTORE_MODES",
    "CenteredWeights",
    "InplaceWeights",
    "UpdateSpec",
    "direction",
    "draw",
    "es_update",
    "es_update_inplace",
    "tensor_seed",
    "weights_for",
]
