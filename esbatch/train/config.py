"""The run config as trainers, backends and tasks see it, and the algorithms that own its sections.

``TrainConfig`` holds the shared sections (sections.py) and one section per registered algorithm, read with
``cfg.section(ESConfig)``. ``Algorithm`` is the small interface an algorithm implements: its own section (a
schema dataclass declared in its package), its budget and checks, and how it runs. esbatch/config/run.py, the
layer above the algorithm packages, registers them (``ALGORITHMS``) and assembles the run config class from
their sections (``assemble``). Cheap to import: validation and sweep planning use it without torch.
Algorithms that train update by update hand the lifecycle a ``Trainer`` (lifecycle.py: folder, MLflow,
run.json, checkpoints, held-out evaluation, stop checks, rank checksums, the summary).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from esbatch.backends import BACKENDS
from esbatch.registry import Registry
from esbatch.schema import Schema, flatten, setting
from esbatch.tasks import TASKS
from esbatch.train.sections import (
    SHARED_SECTIONS,
    BackendConfig,
    CheckpointConfig,
    GenerationConfig,
    InTrainingEvalConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    TaskConfig,
    TrackingConfig,
    model_errors,
)

S = TypeVar("S")


# ----------------------------------------------------------------------------- the whole run config


class TrainConfig(Schema):
    """A validated run config: the shared sections below, plus one section per registered algorithm (``es``,
    ``grpo``, ``pipeline``), read with ``section``. Built by esbatch/config/run.py (``config_from_dict``)."""

    algorithm: str
    run: RunConfig
    model: ModelConfig
    task: TaskConfig
    generation: GenerationConfig
    reward: RewardConfig
    eval: InTrainingEvalConfig
    tracking: TrackingConfig
    checkpoint: CheckpointConfig
    backend: BackendConfig
    algorithm_sections: ClassVar[dict[str, type]] = {}  # section name -> its dataclass (set by ``assemble``)

    def section(self, kind: type[S]) -> S:
        """The algorithm section of type ``kind`` (e.g. ``cfg.section(ESConfig)``)."""
        for name, cls in self.algorithm_sections.items():
            if cls is kind:
                return getattr(self, name)
        raise KeyError(
            f"this run config has no {kind.__name__} section (sections: {', '.join(self.algorithm_sections)})"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def params(self) -> dict[str, Any]:
        """The resolved config as flat dotted keys (MLflow params)."""
        return flatten(self.to_dict())

    def algo(self) -> type[Algorithm]:
        """The algorithm class (esbatch/train/config.py) named by ``algorithm``."""
        return ALGORITHMS.get(self.algorithm)

    def total_updates(self, n_train: int) -> int:
        """The training budget in updates, given the size of the training split."""
        return self.algo().budget(self, n_train)

    def inert_sections(self) -> tuple[str, ...]:
        """The algorithm sections this run never reads (not part of a sweep run's identity)."""
        return self.algo().inert(tuple(self.algorithm_sections))

    def validate(self, path: str, errors: list[str]) -> None:
        """Checks across the shared sections and against the registries (algorithms, tasks, backends, models);
        each algorithm's ``check`` adds its own."""
        limits = {"generation.max_new_tokens": self.generation.max_new_tokens}
        limits["eval.max_new_tokens"] = self.eval.max_new_tokens
        for i, t in enumerate(self.eval.tasks):
            limits[f"eval.tasks[{i}].max_new_tokens"] = (
                t.get("max_new_tokens") if isinstance(t, dict) else getattr(t, "max_new_tokens", None)
            )
        model_errors(self.model, errors, limits)  # run.output_dir under a file: its setting's check

        why = ALGORITHMS.problem(self.algorithm)
        if why:
            errors.append(f"algorithm: {why}")
        else:
            ALGORITHMS.get(self.algorithm).check(self, errors)
            snapshot_errors(self, errors)
        dev = self.model.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            errors.append(f"model.device: {dev!r} is not a device. Valid: auto, cpu, cuda, cuda:N")
        why = TASKS.problem(self.task.name)
        if why:
            errors.append(f"task.name: {why}")
        else:
            TASKS.get(self.task.name).check_params(self.task.params, "task.params", errors)
            TASKS.get(self.task.name).check_data_path(self.task.data_path, "task.data_path", errors)
        if self.backend.name != "vllm" and self.backend.engines != 1:
            errors.append(
                f"backend.engines: {self.backend.engines} engines need backend.name: vllm (the {self.backend.name} "
                "backend holds one model); to split the population over processes set run.nproc_per_node instead"
            )
        why = BACKENDS.problem(self.backend.name)
        if why:
            errors.append(f"backend.name: {why}")
        elif self.eval.tasks and (why := BACKENDS.unsupported(self.backend.name, "eval")):
            errors.append(f"eval.tasks: backend.name {self.backend.name} cannot serve in-training evaluations: {why}")


@dataclasses.dataclass(frozen=True)
class RunTarget:
    """Where and how a run trains: its folder, whether it resumes that folder, a progress bar, and the MLflow
    run's name and tags (a sweep passes its label, parent run and SLURM ids)."""

    run_dir: Path
    resume: bool = False
    progress: bool = True
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)


class Algorithm:
    """A training algorithm as the rest of esbatch sees it. Class-level: nothing is instantiated."""

    name: ClassVar[str] = ""
    section: ClassVar[str | None] = None  # its config section, holding its settings and `updates`/`epochs` budget
    config: ClassVar[type | None] = None  # the dataclass of that section (a schema: esbatch/schema.py)
    resumable: ClassVar[tuple[str, ...]] = ()  # keys of its section a resumed run may change (budgets, diagnostics)
    multi_rank: ClassVar[bool] = True  # `run.nproc_per_node > 1` starts it under torchrun
    replays_log: ClassVar[bool] = False  # rebuilds its weights from the seed log (checkpoint.center: final | none)
    keeps_weights: ClassVar[str] = "it keeps its weights in files"  # why not, for the error message

    @classmethod
    def inert(cls, sections: tuple[str, ...]) -> tuple[str, ...]:
        """The algorithm sections it never reads (not part of a sweep run's identity): the others' sections."""
        return tuple(s for s in sections if s != cls.section)

    @classmethod
    def check(cls, cfg: TrainConfig, errors: list[str]) -> None:
        """Algorithm-specific config checks (run by `esbatch validate`); the default checks that the backend
        serves this algorithm, that exactly one budget is set and that checkpoint.center suits it."""
        why = BACKENDS.unsupported(cfg.backend.name, cls.name)
        if why:
            errors.append(f"backend.name: {cfg.backend.name} cannot run {cls.name}: {why}")
        cls.check_center(cfg, errors)
        if cls.section is None:
            return
        sec = getattr(cfg, cls.section)
        if (sec.updates is None) == (sec.epochs is None):
            errors.append(
                f"{cls.section}.updates / {cls.section}.epochs: set exactly one training budget "
                f"(e.g. {cls.section}.updates: 300)"
            )

    @classmethod
    def check_center(cls, cfg: TrainConfig, errors: list[str]) -> None:
        """checkpoint.center: final | none rely on replaying the seed log, which only some algorithms can do."""
        if cfg.checkpoint.center != "every" and not cls.replays_log:
            errors.append(
                f"checkpoint.center: {cfg.checkpoint.center} needs algorithm: es ({cls.keeps_weights}). Use "
                f"checkpoint.center: every for algorithm: {cls.name}"
            )

    @classmethod
    def check_stage(cls, cfg: TrainConfig, errors: list[str]) -> None:
        """Checks of its own section that also hold when it runs as a pipeline stage (default: none)."""

    @classmethod
    def data_batches(cls, cfg: TrainConfig, updates: int) -> int:
        """The training batches ``updates`` updates consume (a pipeline's next stage continues after them)."""
        return updates

    @classmethod
    def planned_budget(cls, cfg: TrainConfig) -> int | None:
        """The budget in updates when the config alone says it (None: it depends on the data size)."""
        return getattr(cfg, cls.section).updates if cls.section else None

    @classmethod
    def budget(cls, cfg: TrainConfig, n_train: int) -> int:
        """The budget in updates: `<section>.updates`, or epochs x ceil(n_train / B) (keep-tail batches)."""
        sec = getattr(cfg, cls.section)
        if sec.updates is not None:
            return sec.updates
        per_epoch = -(-n_train // sec.batch_size)
        return max(1, round(sec.epochs * per_epoch))

    @classmethod
    def run(cls, cfg: TrainConfig, target: RunTarget) -> dict[str, Any]:
        """Train (or resume) into ``target.run_dir``; returns the summary (on rank 0; other ranks: {"rank": r}).
        Algorithms that train update by update subclass ``UpdateAlgorithm`` (lifecycle.py), which does this."""
        raise NotImplementedError(f"algorithm {cls.name!r} does not say how it runs: subclass UpdateAlgorithm")


# Filled by esbatch/config/run.py, the layer above the algorithm packages (a user's "package.module:Class" is
# found by its path).
ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm", expect=Algorithm)


def assemble(algorithms: list[type[Algorithm]], name: str = "Config", module: str = __name__) -> type[TrainConfig]:
    """The run config class with the shared sections and the section of every algorithm given (in order), as a
    dataclass ``build`` can fill: algorithm, run, model, task, generation, reward, <algorithm sections>, eval,
    tracking, checkpoint, backend (the order of config.yaml)."""
    sections = {a.section: a.config for a in algorithms if a.section and a.config is not None}
    shared = dict(TrainConfig.__annotations__)
    names = ", ".join(a.name for a in algorithms)
    algo_help = f'Training algorithm: {names} (see `esbatch ls`), or your own "package.module:Class".'
    fields: list[tuple[str, Any, Any]] = [("algorithm", str, setting("es", algo_help))]
    head = ("run", "model", "task", "generation", "reward")
    for key in (
        *head,
        *sections,
        *(k for k in shared if k not in head and k not in ("algorithm", "algorithm_sections")),
    ):
        cls = sections.get(key) or SHARED_SECTIONS[key]
        fields.append((key, cls, field(default_factory=cls)))
    config = dataclasses.make_dataclass(name, fields, bases=(TrainConfig,), namespace={"algorithm_sections": sections})
    config.__module__ = module
    return config


def snapshot_errors(cfg: TrainConfig, errors: list[str]) -> None:
    """A snapshot after an update the budget never reaches would silently not exist."""
    algo = cfg.algo()
    try:
        budget = algo.planned_budget(cfg)
    except (AttributeError, TypeError):  # the algorithm's own check has reported its budget problem
        return
    late = [t for t in cfg.checkpoint.snapshots if budget is not None and t > budget]
    if late:
        key = f"{algo.section}.updates" if algo.section else "the budget"
        errors.append(
            f"checkpoint.snapshots: {', '.join(map(str, late))} lie after the last update ({key}: {budget}), so no "
            f"such snapshot would be written. Valid: 1 .. {budget}"
        )
