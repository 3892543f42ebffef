"""GRPO (paper Section 2.2): its config section (config.py), the loss math (core.py) and the DeepSpeed step
(trainer.py)."""

from __future__ import annotations

from typing import ClassVar

from esbatch.grpo.config import GRPOConfig
from esbatch.models import resolve_device
from esbatch.train.config import TrainConfig
from esbatch.train.lifecycle import RunSession, Trainer, UpdateAlgorithm
from esbatch.train.ranks import Ranks, collective_timeout_min


class GRPO(UpdateAlgorithm):
    name: ClassVar[str] = "grpo"
    section: ClassVar[str] = "grpo"
    config: ClassVar[type] = GRPOConfig
    resumable: ClassVar[tuple[str, ...]] = ("updates", "epochs")
    keeps_weights: ClassVar[str] = (
        "GRPO's updates are gradients of sampled responses and cannot be replayed from the log"
    )

    @classmethod
    def budget(cls, cfg: TrainConfig, n_train: int) -> int:
        """Optimizer steps (TRL's max_steps / global_step): `grpo.updates`, or for `grpo.epochs` the batches of
        the epochs (keep-tail) x `grpo.iterations`, each generated batch serving mu optimizer steps."""
        grpo = cfg.section(GRPOConfig)
        if grpo.updates is not None:
            return grpo.updates
        return super().budget(cfg, n_train) * grpo.iterations

    @classmethod
    def data_batches(cls, cfg: TrainConfig, updates: int) -> int:
        """mu optimizer steps per generated batch: ceil(updates / grpo.iterations) batches."""
        return -(-updates // cfg.section(GRPOConfig).iterations)

    @classmethod
    def join_ranks(cls, cfg: TrainConfig) -> Ranks:
        """DeepSpeed's process group (gloo on CPU, NCCL on GPU), also for a single process."""
        from esbatch.grpo.trainer import init_distributed  # heavy: torch, deepspeed

        return init_distributed(resolve_device(cfg.model.device), collective_timeout_min(cfg))

    @classmethod
    def trainer(cls, cfg: TrainConfig, session: RunSession) -> Trainer:
        from esbatch.grpo.trainer import GRPOTrainer  # heavy: torch, deepspeed

        return GRPOTrainer(cfg, session.rd, session.ranks, resolve_device(cfg.model.device))
