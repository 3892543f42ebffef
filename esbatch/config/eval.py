"""Eval configs: which model (base, a run folder's center, or an MLflow run), which tasks, how many samples.

name: easy-qwen1.5b
model: {name: qwen2.5-1.5b-instruct, dtype: bfloat16}
checkpoint: null              # a run folder: evaluate its final center instead of the base weights
mlflow_run: null              # or a training run id: its folder (or final_model artifact) is found
sampling: {n: 32, temperature: 0.6, top_p: 1.0, max_new_tokens: 2048, greedy: true}
ks: [1, 16, 32]
tasks:
  - {name: gsm8k, limit: null}
  - {name: commonsenseqa, label: CSQA}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from esbatch.backends import BACKENDS
from esbatch.config.loader import find, read_yaml
from esbatch.config.run import parse_overrides
from esbatch.registry import did_you_mean
from esbatch.schema import ConfigError, Schema, build, deep_merge, folder_name, output_folder, setting
from esbatch.train.rundir import RunDir
from esbatch.train.sections import (  # the run config's sections: in-training evals use them too
    BackendConfig,
    EvalTask,
    ModelConfig,
    TrackingConfig,
    ks_errors,
    ks_list,
    model_errors,
)


@dataclass
class Sampling:
    n: int = setting(32, "Responses per problem (paper G.4: 32).", ge=1)
    temperature: float = setting(0.6, "Sampling temperature (paper G.4: 0.6).", gt=0.0)
    top_p: float = setting(1.0, "Nucleus sampling mass.", gt=0.0, le=1.0)
    max_new_tokens: int = setting(2048, "Tokens per response (Easy 2048, Hard 8192).", ge=1)
    greedy: bool = setting(False, "Also one greedy response per problem (Easy setting).")
    batch_size: int = setting(64, "Sequences per generate() call: n samples of batch_size // n prompts.", ge=1)
    seed: int = setting(0, "Generation seed (each problem chunk derives its own from it).")


@dataclass
class EvalConfig(Schema):
    validate_always: ClassVar[bool] = True
    name: str = setting("eval", "Output folder name under output_dir.", check=folder_name)
    output_dir: str = setting("esbatch-evals", "Where eval folders go.", check=output_folder)
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The model to evaluate."})
    checkpoint: str | None = setting(None, "A run folder: its config names the base model, its center the weights.")
    checkpoint_update: int | None = setting(
        None,
        "With checkpoint: evaluate the center after this update instead of the final one: the run's center or "
        "snapshots/center-<T>.safetensors (GRPO: checkpoint.snapshots); ES rebuilds a missing one from its log.",
        ge=0,
    )
    mlflow_run: str | None = setting(None, "A training MLflow run id: evaluate its final center, log nested under it.")
    sampling: Sampling = field(default_factory=Sampling, metadata={"help": "Sampled evaluation protocol."})
    ks: list = setting([1, 16, 32], "K values for Pass@K and Maj@K (each <= sampling.n).", check=ks_list)
    tasks: list[EvalTask] = setting([{"name": "gsm8k"}], "Tasks to evaluate, each a mapping (or just a task name).")
    threads: int = setting(0, "torch CPU threads (0 = torch's default).", ge=0)
    score_workers: int = setting(0, "Threads scoring responses (math-verify, code sandbox); 0 = CPU count.", ge=0)
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "MLflow."})
    backend: BackendConfig = field(default_factory=BackendConfig, metadata={"help": "Generation backend."})

    def task_list(self) -> list[EvalTask]:
        return [t if isinstance(t, EvalTask) else EvalTask(**t) for t in self.tasks]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tasks"] = [dataclasses.asdict(t) for t in self.task_list()]
        return d

    def validate(self, path: str, errors: list[str]) -> None:
        labels = [t.label or t.name for t in self.task_list()]
        for lab in sorted({x for x in labels if labels.count(x) > 1}):
            errors.append(f"tasks: '{lab}' appears twice; give one of them a distinct `label`")
        if not labels:
            errors.append("tasks: give at least one task, e.g. tasks: [{name: gsm8k}]")
        errors.extend(ks_errors(self.ks, self.sampling.n, "ks", "sampling.n"))
        if self.checkpoint and self.mlflow_run:
            errors.append("checkpoint / mlflow_run: give one source of trained weights, not both")
        if self.checkpoint_update is not None and not self.checkpoint:
            errors.append("checkpoint_update: needs checkpoint: RUN_FOLDER (the run whose center after it to evaluate)")
        if self.checkpoint and not RunDir(self.checkpoint).exists():
            errors.append(f"checkpoint: {self.checkpoint} is not a run folder (no {RunDir.CONFIG} there)")
        if not self.checkpoint and not self.mlflow_run:  # else the run's own config names the model
            limits = {"sampling.max_new_tokens": self.sampling.max_new_tokens}
            for i, t in enumerate(self.task_list()):
                limits[f"tasks[{i}].max_new_tokens"] = t.max_new_tokens
            model_errors(self.model, errors, limits)
        why = BACKENDS.unsupported(self.backend.name, "eval") if self.backend.name in BACKENDS else None
        if why:
            errors.append(f"backend.name: {self.backend.name} cannot run evaluations: {why}")
        elif self.backend.name not in BACKENDS:
            errors.append(
                f"backend.name: unknown backend '{self.backend.name}'."
                f"{did_you_mean(self.backend.name, BACKENDS.names())} Available: {', '.join(BACKENDS.names())}"
            )


def eval_config_from_dict(data: dict[str, Any], source: str | None = None) -> EvalConfig:
    """Validate; every problem (including each task entry and its params) is reported at once."""
    errors: list[str] = []
    cfg = build(EvalConfig, data, "", errors)
    if errors:
        raise ConfigError(errors, source)
    return cfg


def load_eval_config(name_or_path: str | None, overrides: list[str] | None = None) -> EvalConfig:
    """A YAML path or built-in eval config name (eval-easy, eval-hard, eval-quick), plus --set overrides."""
    path = find(name_or_path or "eval-quick", "eval")
    data = deep_merge(read_yaml(path), parse_overrides(overrides))
    return eval_config_from_dict(data, str(path))
