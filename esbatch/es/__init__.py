"""Full-parameter Evolution Strategies (paper App. G.1): the population and reward shaping (core.py) and
the update step (trainer.py). The weights move inside the backend (esbatch/perturb/)."""

from __future__ import annotations

from typing import Any, ClassVar

from esbatch.train.algorithms import Algorithm
from esbatch.train.lifecycle import Trainer


class ES(Algorithm):
    name: ClassVar[str] = "es"
    section: ClassVar[str] = "es"
    inert: ClassVar[tuple[str, ...]] = ("grpo", "pipeline")

    @classmethod
    def check(cls, cfg: Any, errors: list[str]) -> None:
        super().check(cfg, errors)
        if cfg.es.diversity.samples > 1 and cfg.generation.temperature == 0:
            errors.append(
                f"es.diversity.samples: {cfg.es.diversity.samples} responses per member and prompt need sampling, "
                "but generation.temperature is 0 (greedy: every response is the same); use samples: 1 or a "
                "temperature > 0"
            )

    @classmethod
    def trainer(cls, cfg: Any, session: Any) -> Trainer:
        from esbatch.es.trainer import ESTrainer

        return ESTrainer(cfg, session.rd, session.ranks)
