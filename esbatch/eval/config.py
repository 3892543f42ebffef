"""Eval configs: which model (base, ES run folder, or MLflow run), which tasks, how many samples.

name: easy-qwen1.5b
model: {name: qwen2.5-1.5b-instruct, dtype: bfloat16}
checkpoint: null              # an ES run folder: evaluate its final center instead of the base weights
mlflow_run: null              # or a training run id: its folder (or final_model artifact) is found
sampling: {n: 32, temperature: 0.6, top_p: 1.0, max_new_tokens: 2048, greedy: true}
ks: [1, 16, 32]
tasks:
  - {name: gsm8k, limit: null}
  - {name: commonsenseqa, label: CSQA}
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from esbatch.config import (
    BUILTIN_CONFIG_DIR,
    ConfigError,
    ModelConfig,
    TrackingConfig,
    _f,
    build_dataclass,
    deep_merge,
    parse_overrides,
)
from esbatch.registry import did_you_mean


@dataclass
class EvalTask:
    name: str = _f("gsm8k", "Registered task (see `esbatch ls`).")
    label: str | None = _f(None, "Column/row name in the tables (default: the task name).")
    params: dict = _f({}, "Task constructor parameters (as in training configs).")
    data_path: str | None = _f(None, "Local data file instead of the hub dataset.")
    limit: int | None = _f(None, "Evaluate the first `limit` problems only (None = the whole split).", ge=1)
    max_new_tokens: int | None = _f(None, "Per-task override of sampling.max_new_tokens.", ge=1)
    few_shot: int = _f(0, "Solved demonstrations before each question (the paper evaluates zero-shot).", ge=0)


@dataclass
class Sampling:
    n: int = _f(32, "Responses per problem (paper G.4: 32).", ge=1)
    temperature: float = _f(0.6, "Sampling temperature (paper G.4: 0.6).", gt=0.0)
    top_p: float = _f(1.0, "Nucleus sampling mass.", gt=0.0, le=1.0)
    max_new_tokens: int = _f(2048, "Tokens per response (Easy 2048, Hard 8192).", ge=1)
    greedy: bool = _f(False, "Also one greedy response per problem (Easy setting).")
    batch_size: int = _f(64, "Sequences per generate() call: n samples of batch_size // n prompts.", ge=1)
    seed: int = _f(0, "Generation seed (each problem chunk derives its own from it).")


@dataclass
class EvalConfig:
    name: str = _f("eval", "Output folder name under output_dir.")
    output_dir: str = _f("esbatch-evals", "Where eval folders go.")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The model to evaluate."})
    checkpoint: str | None = _f(None, "An ES run folder: its config names the base model, its center the weights.")
    mlflow_run: str | None = _f(None, "A training MLflow run id: evaluate its final center, log nested under it.")
    sampling: Sampling = field(default_factory=Sampling, metadata={"help": "Sampled evaluation protocol."})
    ks: list = _f([1, 16, 32], "K values for Pass@K and Maj@K (those <= n are reported).")
    tasks: list = _f([{"name": "gsm8k"}], "Tasks, each {name, label, params, data_path, limit, max_new_tokens}.")
    threads: int = _f(0, "torch CPU threads (0 = torch's default).", ge=0)
    score_workers: int = _f(0, "Threads scoring responses (math-verify, code sandbox); 0 = CPU count.", ge=0)
    tracking: TrackingConfig = field(default_factory=TrackingConfig, metadata={"help": "MLflow."})

    def task_list(self) -> list[EvalTask]:
        return [t if isinstance(t, EvalTask) else EvalTask(**t) for t in self.tasks]

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        d = dataclasses.asdict(self)
        d["tasks"] = [dataclasses.asdict(t) for t in self.task_list()]
        return d


def eval_config_from_dict(data: dict[str, Any], source: str | None = None) -> EvalConfig:
    """Validate; every problem (including each task entry and its params) is reported at once."""
    from esbatch.tasks import TASKS

    errors: list[str] = []
    cfg = build_dataclass(EvalConfig, data, "", errors)
    tasks: list[EvalTask] = []
    for i, t in enumerate(cfg.tasks if isinstance(cfg.tasks, list) else []):
        if isinstance(t, str):
            t = {"name": t}
        if not isinstance(t, dict):
            errors.append(f"tasks[{i}]: expected a mapping like {{name: gsm8k, limit: 100}}, got {t!r}")
            continue
        et = build_dataclass(EvalTask, t, f"tasks[{i}]", errors)
        if et.name not in TASKS:
            errors.append(
                f"tasks[{i}].name: unknown task '{et.name}'.{did_you_mean(et.name, TASKS.names())} "
                f"Available: {', '.join(TASKS.names())}"
            )
        else:
            TASKS.get(et.name).check_params(et.params, f"tasks[{i}].params", errors)
        tasks.append(et)
    labels = [t.label or t.name for t in tasks]
    for lab in {x for x in labels if labels.count(x) > 1}:
        errors.append(f"tasks: '{lab}' appears twice; give one of them a distinct `label`")
    if not tasks and not errors:
        errors.append("tasks: give at least one task, e.g. tasks: [{name: gsm8k}]")
    bad_k = [k for k in cfg.ks if not isinstance(k, int) or isinstance(k, bool) or k < 1]
    if bad_k:
        errors.append(f"ks: expected positive integers, got {bad_k}")
    if cfg.checkpoint and cfg.mlflow_run:
        errors.append("checkpoint / mlflow_run: give one source of trained weights, not both")
    if cfg.checkpoint and not (Path(cfg.checkpoint) / "config.yaml").exists():
        errors.append(f"checkpoint: {cfg.checkpoint} is not an ES run folder (no config.yaml there)")
    if errors:
        raise ConfigError(errors, source)
    cfg.tasks = tasks
    return cfg


def load_eval_config(name_or_path: str | None, overrides: list[str] | None = None) -> EvalConfig:
    """A YAML path or built-in eval config name (eval-easy, eval-hard, eval-quick), plus --set overrides."""
    name = name_or_path or "eval-quick"
    p = Path(name)
    if not p.is_file():
        p = BUILTIN_CONFIG_DIR / f"{name}.yaml"
    if not p.is_file():
        names = sorted(q.stem for q in BUILTIN_CONFIG_DIR.glob("eval-*.yaml"))
        raise ConfigError(
            [f"{name}: no such file or built-in eval config.{did_you_mean(name, names)} Built-in: {', '.join(names)}"]
        )
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"YAML syntax error: {e}"], str(p)) from None
    data = deep_merge(copy.deepcopy(data), parse_overrides(overrides))
    return eval_config_from_dict(data, str(p))
