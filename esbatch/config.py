"""Typed, validated run configs: YAML -> dataclasses, checked before any model loads.

Every field carries help text and its constraints in ``metadata``. ``load_config`` collects
*all* problems at once and raises ``ConfigError`` whose lines name the YAML path of the key,
say why it is wrong and list the valid choices ("did you mean" for misspelt keys).
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from esbatch.registry import did_you_mean

BUILTIN_CONFIG_DIR = Path(__file__).parent / "configs"

# What a resumed run may change: budgets and bookkeeping, never what the logged updates depend on.
RESUME_OVERRIDABLE = {
    "es.updates",
    "es.epochs",
    "grpo.updates",
    "grpo.epochs",
    "run.threads",
    "backend.engines",  # how many vLLM engines share the population does not change the result
    "eval.every",
    "checkpoint.every",
    "tracking.log_model",
}


class ConfigError(ValueError):
    """One or more invalid config entries; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        head = f"invalid config {source}" if source else "invalid config"
        super().__init__(head + ":\n" + "\n".join(f"  - {e}" for e in errors))


def _f(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with help text and constraints (choices, gt, ge, le, lt)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})


# ----------------------------------------------------------------------------- sections


@dataclass
class RunConfig:
    name: str = _f("quickstart", "Run name; the run directory is <output_dir>/<name>.")
    seed: int = _f(0, "Master seed: perturbation seeds, generation seeds and data order derive from it.")
    output_dir: str = _f("esbatch-runs", "Folder holding run directories (config, checkpoints, logs).")
    threads: int = _f(0, "torch CPU threads (0 = leave torch's default).", ge=0)
    nproc_per_node: int = _f(
        1,
        "Processes on this node; torchrun is started for > 1. ES: the population is split over them (only "
        "rewards are exchanged). GRPO: data-parallel ranks.",
        ge=1,
    )


@dataclass
class ModelConfig:
    name: str = _f(
        "smollm2-135m-instruct",
        "Registered model alias (see `esbatch ls`), a local HF model directory, a hub id, or a .gguf file.",
    )
    gguf_file: str | None = _f(None, "GGUF file name inside `name` (a directory or hub id).")
    revision: str | None = _f(None, "Hub revision (branch, tag or commit) when `name` is a hub id.")
    device: str = _f("auto", "Where the live weights sit: auto (cuda if available), cpu, cuda, cuda:N.")
    dtype: str = _f(
        "float32",
        "Compute dtype of the live weights. With bfloat16/float16 an fp32 master copy keeps small updates.",
        choices=("float32", "bfloat16", "float16"),
    )
    init_weights: str | None = _f(
        None, "Start from these fp32 weights (center.safetensors of an earlier run or pipeline stage)."
    )


@dataclass
class TaskConfig:
    name: str = _f("arithmetic", 'Registered task (see `esbatch ls`) or your own "package.module:Class".')
    params: dict = _f({}, "Task-specific options, checked against the task's constructor.")
    data_path: str | None = _f(None, "Local file (jsonl/json/parquet/csv) used instead of the hub dataset.")
    train_size: int | None = _f(None, "Training problems to use (None = all / the task's default).", ge=1)
    heldout_size: int = _f(64, "Held-out problems scored greedily during training (0 = none).", ge=0)
    few_shot: int = _f(0, "Solved demonstrations placed before each question as chat turns.", ge=0)
    system_prompt: str | None = _f(None, "Override the task family's system prompt (paper App. G.5).")


@dataclass
class GenerationConfig:
    temperature: float = _f(0.7, "Sampling temperature (0 = greedy).", ge=0.0)
    top_p: float = _f(1.0, "Nucleus sampling mass.", gt=0.0, le=1.0)
    max_new_tokens: int = _f(256, "Generated tokens per response at most.", ge=1)
    batch_size: int = _f(64, "Prompts per generate() call (memory bound, not a hyperparameter).", ge=1)


@dataclass
class RewardConfig:
    correct: float = _f(1.0, "Reward for a verifier-correct answer (paper App. G.1: 1).")
    format: float = _f(0.1, "Reward for a well-formatted but wrong answer (paper: 0.1).")
    missing: float = _f(0.0, "Reward when the required answer format is missing (paper: 0).")


@dataclass
class ESConfig:
    population_size: int = _f(8, "N: evaluations per update (antithetic: N/2 +/- pairs).", ge=2)
    sigma: float = _f(1e-3, "Perturbation scale sigma.", gt=0.0)
    alpha: float = _f(5e-4, "Center-update scale alpha in theta += alpha/N sum z_i eps_i.", gt=0.0)
    normalization: str = _f(
        "zscore", "Reward normalization across the population.", choices=("zscore", "none", "centered_rank")
    )
    eps_num: float = _f(1e-8, "epsilon_num added to the reward std in z-scoring.", ge=0.0)
    estimator: str = _f(
        "one_point",
        "one_point: N directions; antithetic: N/2 directions each at +sigma and -sigma.",
        choices=("one_point", "antithetic"),
    )
    generation_seeds: str = _f(
        "independent",
        "Which members share a sampling seed: every member its own; the +/- members of an "
        "antithetic pair (common random numbers); or the whole population of an update.",
        choices=("independent", "antithetic_pairs", "population"),
    )
    batch_size: int = _f(16, "B: prompts in the shared mini-batch of each update.", ge=1)
    updates: int | None = _f(None, "Training budget in updates (set this or `epochs`).", ge=1)
    epochs: float | None = _f(None, "Training budget in epochs over the training split.", gt=0.0)


@dataclass
class GRPOConfig:
    group_size: int = _f(8, "G: responses per prompt (TRL num_generations=8; the paper pairs G=8 with ES N=32).", ge=2)
    batch_size: int = _f(8, "B: prompts per optimizer step, across all ranks.", ge=1)
    learning_rate: float = _f(1e-6, "AdamW learning rate (TRL default 1e-6).", gt=0.0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0.0)
    epsilon: float = _f(0.2, "Lower (and default upper) clip of the PPO ratio (TRL/PPO 0.2).", gt=0.0)
    epsilon_high: float | None = _f(None, "Separate upper clip (DAPO clip-higher, e.g. 0.28); None = epsilon.", gt=0.0)
    beta: float = _f(0.0, "KL penalty weight (k3 estimator); 0 = no reference model is loaded (TRL default).", ge=0.0)
    scale_rewards: str = _f(
        "group",
        "Advantage scale: group std (GRPO), batch std, or none (Dr. GRPO).",
        choices=("group", "batch", "none"),
    )
    loss_aggregation: str = _f(
        "token_mean",
        "token_mean (DAPO/verl), seq_mean_token_mean (original GRPO), seq_mean_token_sum (Dr. GRPO).",
        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"),
    )
    max_grad_norm: float = _f(1.0, "Gradient clipping (DeepSpeed gradient_clipping).", gt=0.0)
    zero_stage: int = _f(
        2, "DeepSpeed ZeRO stage 0-2 (3 would shard the weights the generator reads on every rank).", ge=0, le=2
    )
    updates: int | None = _f(None, "Training budget in optimizer steps (set this or `epochs`).", ge=1)
    epochs: float | None = _f(None, "Training budget in epochs over the training split.", gt=0.0)


@dataclass
class PipelineConfig:
    stages: list = _f([], "Algorithms run one after the other, each from the previous one's weights: [es, grpo].")
    split: list | None = _f(None, "Share of the total budget per stage (default: equal), e.g. [0.5, 0.5].")
    updates: int | None = _f(None, "Total update budget shared by the stages.", ge=1)


@dataclass
class EvalConfig:
    every: int = _f(0, "Score the center greedily on the held-out set every k updates (0 = start/end only).", ge=0)
    max_new_tokens: int | None = _f(None, "Token limit for held-out scoring (None = generation.max_new_tokens).", ge=1)


@dataclass
class TrackingConfig:
    uri: str | None = _f(None, "MLflow tracking URI (None = sqlite store <output_dir>/mlflow.db).")
    experiment: str = _f("esbatch", "MLflow experiment name.")
    log_model: bool = _f(False, "Save the final center in HF format as a run artifact.")
    drift: bool = _f(True, "Keep an fp32 copy of theta_0 to log the center's relative distance from it.")
    parent_run_id: str | None = _f(None, "Nest this run's MLflow run under this one (pipelines set it).")


@dataclass
class CheckpointConfig:
    every: int = _f(10, "Save the fp32 center every k updates; updates since are replayed from the log.", ge=1)


@dataclass
class BackendConfig:
    name: str = _f("hf", "Generation backend (see `esbatch ls`): hf, or vllm (imported only when chosen).")
    engines: int = _f(
        1, "vllm: engines on this node; the population is sharded over them (one GPU each on GPU nodes).", ge=1
    )
    gpu_memory_utilization: float = _f(0.85, "vllm: fraction of each GPU an engine may use.", gt=0, le=1)
    enable_sleep_mode: bool = _f(False, "vllm: allow engines to release GPU memory between phases (sleep/wake_up).")
    kv_cache_gb: int = _f(2, "vllm on CPU: KV cache size per engine in whole GiB (VLLM_CPU_KVCACHE_SPACE).", ge=1)
    max_model_len: int | None = _f(None, "vllm: context length to reserve KV cache for (default: the model's).")
    prefix_caching: bool = _f(True, "vllm: reuse shared prompt prefixes; reset after every weight change.")
    cuda_graphs: bool = _f(True, "vllm on GPU: capture CUDA graphs (false = eager mode). Ignored on CPU.")


@dataclass
class TrainConfig:
    algorithm: str = _f(
        "es", "Training algorithm (pipeline: the stages of `pipeline`).", choices=("es", "grpo", "pipeline")
    )
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    es: ESConfig = field(default_factory=ESConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def total_updates(self, n_train: int) -> int:
        """The budget in updates: `<algorithm>.updates`, or epochs x ceil(n_train / B) (keep-tail batches)."""
        algo = self.grpo if self.algorithm == "grpo" else self.es
        if algo.updates is not None:
            return algo.updates
        per_epoch = -(-n_train // algo.batch_size)
        return max(1, round(algo.epochs * per_epoch))


# ----------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    """Check ``value`` against annotation ``tp``; returns the (possibly converted) value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path, errors)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping of {_type_name(tp)} fields, got {type(value).__name__}")
            return tp()
        return _build(tp, value, path, errors)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    elif tp is list or origin is list:
        if isinstance(value, list):
            return value
    else:  # pragma: no cover - a schema bug, not a user error
        raise TypeError(f"unsupported config type {tp} at {path}")
    want = "mapping" if (tp is dict or origin is dict) else "list" if (tp is list or origin is list) else _type_name(tp)
    if value is None:
        errors.append(f"{path}: must be set (expected {want}, got null)")
    else:
        errors.append(f"{path}: expected {want}, got {type(value).__name__} {value!r}")
    return None


def _check(value: Any, meta: dict[str, Any], path: str, errors: list[str]) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices and value not in choices:
        errors.append(
            f"{path}: {value!r} is not a valid choice.{did_you_mean(str(value), choices)} Valid: {', '.join(choices)}"
        )
    for key, ok, word in (
        ("gt", lambda v, b: v > b, ">"),
        ("ge", lambda v, b: v >= b, ">="),
        ("lt", lambda v, b: v < b, "<"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if key in meta and isinstance(value, (int, float)) and not ok(value, meta[key]):
            errors.append(f"{path}: must be {word} {meta[key]} (got {value!r})")


def _build(cls: type, data: dict[str, Any], prefix: str, errors: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            errors.append(
                f"{path}: unknown key.{did_you_mean(str(key), list(fields))} "
                f"Valid keys{' of ' + prefix if prefix else ''}: {', '.join(fields)}"
            )
            continue
        coerced = _coerce(value, hints[key], path, errors)
        _check(coerced, dict(fields[key].metadata), path, errors)
        kwargs[key] = coerced
    try:
        return cls(**{k: v for k, v in kwargs.items() if v is not None or _optional(hints[k])})
    except TypeError as e:  # pragma: no cover
        errors.append(f"{prefix}: {e}")
        return cls()


def build_dataclass(cls: type, data: dict[str, Any], prefix: str, errors: list[str]) -> Any:
    """Validate ``data`` against any dataclass declared with ``_f`` fields (used for launcher profiles too)."""
    return _build(cls, data, prefix, errors)


def _optional(tp: Any) -> bool:
    return type(None) in typing.get_args(tp)


def _cross_checks(cfg: TrainConfig, errors: list[str]) -> None:
    """Constraints that involve several fields or the registries."""
    from esbatch.backends import BACKENDS
    from esbatch.tasks import TASKS

    es = cfg.es
    algo = cfg.algorithm
    if algo == "pipeline":
        p = cfg.pipeline
        bad = [s for s in p.stages if s not in ("es", "grpo")]
        if not p.stages or bad:
            errors.append(f"pipeline.stages: expected a list of es / grpo, e.g. [es, grpo]; got {p.stages!r}")
        if p.updates is None:
            errors.append("pipeline.updates: set the total update budget the stages share (e.g. 300)")
        elif p.updates < len(p.stages):
            errors.append(f"pipeline.updates: {p.updates} updates cannot be split over {len(p.stages)} stages")
        if p.split is not None and (
            len(p.split) != len(p.stages) or not all(isinstance(x, (int, float)) and x > 0 for x in p.split)
        ):
            errors.append(f"pipeline.split: expected {len(p.stages)} positive shares, one per stage; got {p.split!r}")
    else:
        budget = cfg.grpo if algo == "grpo" else es
        if (budget.updates is None) == (budget.epochs is None):
            errors.append(f"{algo}.updates / {algo}.epochs: set exactly one training budget (e.g. {algo}.updates: 300)")
    if es.estimator == "antithetic" and es.population_size % 2:
        errors.append(
            f"es.population_size: antithetic pairs need an even N (got {es.population_size}); "
            f"use {es.population_size + 1} or estimator: one_point"
        )
    dev = cfg.model.device
    if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        errors.append(f"model.device: {dev!r} is not a device. Valid: auto, cpu, cuda, cuda:N")
    if es.generation_seeds == "antithetic_pairs" and es.estimator != "antithetic":
        errors.append(
            "es.generation_seeds: 'antithetic_pairs' needs es.estimator: antithetic "
            "(valid for one_point: independent, population)"
        )
    if cfg.task.name not in TASKS:
        errors.append(
            f"task.name: unknown task '{cfg.task.name}'.{did_you_mean(cfg.task.name, TASKS.names())} "
            f"Available: {', '.join(TASKS.names())}"
        )
    else:
        TASKS.get(cfg.task.name).check_params(cfg.task.params, "task.params", errors)
    if cfg.backend.name != "vllm" and cfg.backend.engines != 1:
        errors.append(
            f"backend.engines: {cfg.backend.engines} engines need backend.name: vllm (the {cfg.backend.name} backend "
            "holds one model); to split the population over processes set run.nproc_per_node instead"
        )
    if cfg.backend.name not in BACKENDS:
        errors.append(
            f"backend.name: unknown backend '{cfg.backend.name}'.{did_you_mean(cfg.backend.name, BACKENDS.names())} "
            f"Available: {', '.join(BACKENDS.names())}"
        )


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    """Turn ["es.sigma=0.01", "task.params.digits=3"] into a nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set {item!r}: expected key.sub=value, e.g. --set es.sigma=0.01"])
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set {item!r}: '{p}' is set to a value and used as a section"])
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "params":
            out[k] = deep_merge(out[k], v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def resolve_config_path(name_or_path: str) -> Path:
    """A file path, or the name of a built-in config (see `esbatch ls`)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    builtin = BUILTIN_CONFIG_DIR / f"{name_or_path}.yaml"
    if builtin.exists():
        return builtin
    names = builtin_configs()
    raise ConfigError(
        [
            f"{name_or_path}: no such file and no built-in config of that name."
            f"{did_you_mean(name_or_path, names)} Built-in configs: {', '.join(names)}"
        ]
    )


def builtin_configs() -> list[str]:
    return sorted(p.stem for p in BUILTIN_CONFIG_DIR.glob("*.yaml"))


def config_from_dict(data: dict[str, Any], source: str | None = None) -> TrainConfig:
    """Validate a plain dict; raises ConfigError listing every problem."""
    errors: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError([f"top level: expected a mapping, got {type(data).__name__}"], source)
    cfg = _build(TrainConfig, data, "", errors)
    if not errors:
        _cross_checks(cfg, errors)
    if errors:
        raise ConfigError(errors, source)
    return cfg


def load_config(name_or_path: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Load a YAML config (path or built-in name, default: quickstart), apply --set overrides, validate."""
    path = resolve_config_path(name_or_path or "quickstart")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"YAML syntax error: {e}"], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError([f"top level: expected a mapping, got {type(data).__name__}"], str(path))
    data = deep_merge(data, parse_overrides(overrides))
    return config_from_dict(data, str(path))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"es": {"sigma": 1}} -> {"es.sigma": 1}; used for MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def describe(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every field: the reference table printed by `esbatch validate --schema`."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_ = f.metadata.get("help", "")
        if "choices" in f.metadata:
            help_ += f" Choices: {', '.join(f.metadata['choices'])}."
        rows.append((key, tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", ""), default, help_))
    return rows
