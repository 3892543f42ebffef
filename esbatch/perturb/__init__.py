"""How ES moves weights, shared by every backend: noise directions from (seed, tensor name), the update
theta += alpha/N sum_i w_i eps_i, and live weights that follow an fp32 center with exact restore."""

from esbatch.perturb.noise import direction, tensor_seed
from esbatch.perturb.update import UpdateSpec, es_update

__all__ = ["UpdateSpec", "direction", "es_update", "tensor_seed"]
