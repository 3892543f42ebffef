"""Full-parameter Evolution Strategies (paper App. G.1), read in this order: its config section (config.py), the
math of an update (core.py), the update step (trainer.py) and its replay (replay.py). The weights move inside
the backend (esbatch/perturb/)."""

from __future__ import annotations

from typing import ClassVar

from esbatch.es.config import ESConfig, diversity_errors, lowrank_errors, restore_errors
from esbatch.train.config import TrainConfig
from esbatch.train.lifecycle import RunSession, Trainer, UpdateAlgorithm


class ES(UpdateAlgorithm):
    name: ClassVar[str] = "es"
    section: ClassVar[str] = "es"
    config: ClassVar[type] = ESConfig
    resumable: ClassVar[tuple[str, ...]] = (
        "updates",
        "epochs",
        "diversity.every",  # diagnostics: the center never depends on them (esbatch/es/trainer.py)
        "diversity.samples",
    )
    replays_log: ClassVar[bool] = True

    @classmethod
    def check(cls, cfg: TrainConfig, errors: list[str]) -> None:
        super().check(cfg, errors)
        cls.check_stage(cfg, errors)

    @classmethod
    def check_stage(cls, cfg: TrainConfig, errors: list[str]) -> None:
        diversity_errors(cfg, errors)
        restore_errors(cfg, errors)
        lowrank_errors(cfg, errors)

    @classmethod
    def trainer(cls, cfg: TrainConfig, session: RunSession) -> Trainer:
        from esbatch.es.trainer import ESTrainer  # heavy: torch

        return ESTrainer(cfg, session.rd, session.ranks)
