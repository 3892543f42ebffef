"""Generation backends, chosen by ``backend.name`` and imported only when chosen."""

from esbatch.backends.base import Generation, GenerationBackend, SamplingParams, UpdateStats
from esbatch.registry import Registry

BACKENDS: Registry[type[GenerationBackend]] = Registry("backend")
BACKENDS.register("hf", "esbatch.backends.hf:HFBackend", help="HF transformers on CPU or one GPU")

__all__ = ["BACKENDS", "Generation", "GenerationBackend", "SamplingParams", "UpdateStats"]
