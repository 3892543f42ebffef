"""GRPO (paper Section 2.2): the loss math (core.py) and the DeepSpeed step (trainer.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from esbatch.train.algorithms import Algorithm
from esbatch.train.lifecycle import Trainer


class GRPO(Algorithm):
    name: ClassVar[str] = "grpo"
    section: ClassVar[str] = "grpo"
    inert: ClassVar[tuple[str, ...]] = ("es", "pipeline")

    @classmethod
    def budget(cls, cfg: Any, n_train: int) -> int:
        """Optimizer steps (TRL's max_steps / global_step): `grpo.updates`, or for `grpo.epochs` the batches of
        the epochs (keep-tail) x `grpo.iterations`, each generated batch serving mu optimizer steps."""
        if cfg.grpo.updates is not None:
            return cfg.grpo.updates
        return super().budget(cfg, n_train) * cfg.grpo.iterations

    @classmethod
    def join_ranks(cls, cfg: Any) -> Any:
        """DeepSpeed's process group (gloo on CPU, NCCL on GPU), also for a single process."""
        from esbatch.grpo.trainer import init_distributed
        from esbatch.models import resolve_device
        from esbatch.train.ranks import collective_timeout_min

        return init_distributed(resolve_device(cfg.model.device), collective_timeout_min(cfg))

    @classmethod
    def trainer(cls, cfg: Any, session: Any) -> Trainer:
        from esbatch.grpo.trainer import GRPOTrainer
        from esbatch.models import resolve_device

        return GRPOTrainer(cfg, session.rd, session.ranks, resolve_device(cfg.model.device))
