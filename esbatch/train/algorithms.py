"""The algorithm registry and the two small interfaces an algorithm implements.

``Algorithm`` (registered by name: ``es``, ``grpo``, ``pipeline``, or a user's ``package.module:Class``) says
what the config needs (its budget, its checks, the sections it ignores) and runs a training run. It is
cheap to import: validation and sweep planning use it without torch. Algorithms that train update by
update hand the lifecycle a ``Trainer`` (esbatch/train/lifecycle.py; run_updates does the rest: folder,
MLflow, run.json, checkpoints, held-out evaluation, stop checks, rank checksums, the summary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from esbatch.registry import Registry


class Algorithm:
    """A training algorithm as the rest of esbatch sees it. Class-level: nothing is instantiated."""

    name: ClassVar[str] = ""
    section: ClassVar[str | None] = None  # the config section holding its settings and `updates`/`epochs` budget
    inert: ClassVar[tuple[str, ...]] = ()  # config sections it never reads (not part of a sweep run's identity)
    multi_rank: ClassVar[bool] = True  # `run.nproc_per_node > 1` starts it under torchrun

    @classmethod
    def check(cls, cfg: Any, errors: list[str]) -> None:
        """Algorithm-specific config checks (run by `esbatch validate`); the default checks that the backend
        serves this algorithm and that exactly one budget is set."""
        from esbatch.backends import BACKENDS

        why = BACKENDS.unsupported(cfg.backend.name, cls.name)
        if why:
            errors.append(f"backend.name: {cfg.backend.name} cannot run {cls.name}: {why}")
        if cls.section is None:
            return
        sec = getattr(cfg, cls.section)
        if (sec.updates is None) == (sec.epochs is None):
            errors.append(
                f"{cls.section}.updates / {cls.section}.epochs: set exactly one training budget "
                f"(e.g. {cls.section}.updates: 300)"
            )

    @classmethod
    def planned_budget(cls, cfg: Any) -> int | None:
        """The budget in updates when the config alone says it (None: it depends on the data size)."""
        return getattr(cfg, cls.section).updates if cls.section else None

    @classmethod
    def budget(cls, cfg: Any, n_train: int) -> int:
        """The budget in updates: `<section>.updates`, or epochs x ceil(n_train / B) (keep-tail batches)."""
        sec = getattr(cfg, cls.section)
        if sec.updates is not None:
            return sec.updates
        per_epoch = -(-n_train // sec.batch_size)
        return max(1, round(sec.epochs * per_epoch))

    @classmethod
    def run(
        cls, cfg: Any, run_dir: Path, *, resume: bool, progress: bool, run_name: str | None, tags: dict[str, str]
    ) -> dict[str, Any]:
        """Train (or resume) into ``run_dir``; returns the summary (on rank 0; other ranks: {"rank": r})."""
        from esbatch.train.lifecycle import RunSession, run_updates

        ranks = cls.join_ranks(cfg)
        with RunSession(cfg, run_dir, resume=resume, ranks=ranks, run_name=run_name, tags=tags) as session:
            return run_updates(session, cls.trainer(cfg, session), progress)

    @classmethod
    def join_ranks(cls, cfg: Any) -> Any:
        """This process's rank and the world size (a world of one unless started by torchrun or SLURM)."""
        from esbatch.train.ranks import collective_timeout_min, init_ranks

        return init_ranks(collective_timeout_min(cfg))

    @classmethod
    def trainer(cls, cfg: Any, session: Any) -> Any:
        raise NotImplementedError(f"algorithm {cls.name!r} has no update loop; it overrides run()")


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", expect=Algorithm)
ALGORITHMS.register("es", "esbatch.es:ES", help="full-parameter Evolution Strategies (paper App. G.1)")
ALGORITHMS.register("grpo", "esbatch.grpo:GRPO", help="GRPO on DeepSpeed (paper Section 2.2)")
ALGORITHMS.register("pipeline", "esbatch.pipeline:Pipeline", help="stages run one after another (es->grpo, ...)")
