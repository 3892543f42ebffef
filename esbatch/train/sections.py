"""The sections of a run config that every algorithm reads: run, model, task, generation, reward, eval,
tracking, checkpoint, backend. Each is a schema (esbatch/schema.py): typed fields with help text and checks.
An algorithm's own section lives in its package (es/config.py, grpo/config.py, pipeline.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from esbatch.backends.config import BackendConfig
from esbatch.models import ModelConfig, context_length, model_problem
from esbatch.registry import did_you_mean
from esbatch.schema import Invalid, Schema, expects, folder_name, output_folder, setting, stage_spans
from esbatch.tasks import TASKS

# What a resumed run may change in the shared sections (algorithms add theirs: Algorithm.resumable): budgets
# and bookkeeping, never what the logged updates depend on.
RESUMABLE = (
    "run.hang_timeout_s",
    "run.threads",
    "run.keep_freed_memory",  # where memory comes from, never a value
    "reward.max_score_errors",  # when to stop, never what an update computes
    "backend.engines",  # how many vLLM engines share the population does not change the result
    "eval.every",
    "eval.tasks",  # in-training evaluations and snapshots read the weights, never change them
    "eval.samples",
    "eval.temperature",
    "eval.top_p",
    "eval.ks",
    "checkpoint.every",
    "checkpoint.snapshots",
    "tracking.log_model",
)


# ----------------------------------------------------------------------------- shared sections


@dataclass
class RunConfig:
    name: str = setting("run", "Run name; the run directory is <output_dir>/<name>.", check=folder_name)
    seed: int = setting(
        0, "Master seed: perturbation seeds, generation seeds and data order derive from it.", ge=0, le=2**32 - 1
    )
    output_dir: str = setting(
        "esbatch-runs", "Folder holding run directories (config, checkpoints, logs).", check=output_folder
    )
    threads: int = setting(0, "torch CPU threads (0 = leave torch's default).", ge=0)
    keep_freed_memory: bool = setting(
        True,
        "On CPU: glibc keeps freed blocks under 1 GiB in the process, so a step does not fault its memory in "
        "again; RSS stays at its peak (esbatch/train/memory.py). Changes no result.",
    )
    nproc_per_node: int = setting(
        1,
        "Processes on this node; torchrun is started for > 1. ES: the population is split over them (only "
        "rewards are exchanged). GRPO: data-parallel ranks.",
        ge=1,
    )
    data_before: list = setting(
        [],
        "Data schedule consumed by earlier pipeline stages, [[updates, batch_size], ...]: this run continues the "
        "same shuffled stream instead of restarting it (set by the pipeline; empty for a single run).",
        check=stage_spans,
    )
    hang_timeout_s: float = setting(
        3600.0,
        "Longest any one phase of an update (generation and scoring, a collective, a checkpoint, a held-out "
        "evaluation) may take before the run is declared hung and ends with exit code 75 (resumable). Set it "
        "well above your slowest update; loading the model is not timed.",
        gt=0,
    )


#: The longest system prompt, in characters (see TaskConfig.system_prompt).
MAX_SYSTEM_PROMPT = 20_000


@expects(f"a string of at most {MAX_SYSTEM_PROMPT:,} characters, or null")
def system_prompt(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or len(v) > MAX_SYSTEM_PROMPT):
        raise Invalid(f"got {type(v).__name__} of {len(v):,} characters" if isinstance(v, str) else f"got {v!r}")
    return v


@dataclass
class TaskConfig:
    name: str = setting("arithmetic", 'Registered task (see `esbatch ls`) or your own "package.module:Class".')
    params: dict = setting({}, "Task-specific options, checked against the task's constructor.")
    data_path: str | None = setting(None, "Local file (jsonl/json/parquet/csv) used instead of the hub dataset.")
    train_size: int | None = setting(None, "Training problems to use (None = all / the task's default).", ge=1)
    heldout_size: int = setting(64, "Held-out problems scored greedily during training (0 = none).", ge=0)
    few_shot: int = setting(0, "Solved demonstrations placed before each question as chat turns.", ge=0)
    system_prompt: str | None = setting(
        None,
        "Override the task family's system prompt (paper App. G.5); at most 20,000 characters (a few thousand "
        "tokens: a longer one leaves no room in the context and exhausts memory).",
        check=system_prompt,
    )


@dataclass
class GenerationConfig:
    temperature: float = setting(0.7, "Sampling temperature (0 = greedy).", ge=0.0)
    top_p: float = setting(1.0, "Nucleus sampling mass.", gt=0.0, le=1.0)
    max_new_tokens: int = setting(256, "Generated tokens per response at most.", ge=1)
    batch_size: int = setting(64, "Prompts per generate() call (memory bound, not a hyperparameter).", ge=1)


@dataclass
class RewardConfig:
    correct: float = setting(1.0, "Reward for a verifier-correct answer (paper App. G.1: 1).")
    format: float = setting(0.1, "Reward for a well-formatted but wrong answer (paper: 0.1).")
    missing: float = setting(0.0, "Reward when the required answer format is missing (paper: 0).")
    max_score_errors: float = setting(
        0.05,
        "A verifier exception scores the response WRONG and is counted (score/errors). Above this share of an "
        "update's responses the run stops, naming the task and the exception (our choice). 1 = never stop.",
        ge=0.0,
        le=1.0,
    )


def ks_errors(ks: list[int], n: int, ks_key: str, n_key: str) -> list[str]:
    """Pass@K and Maj@K need K samples per problem: a K above the sample count would be dropped from the tables."""
    over = [k for k in ks if k > n]
    if not over:
        return []
    return [
        f"{ks_key}: K = {', '.join(map(str, over))} exceed {n_key} = {n}: Pass@K and Maj@K need at least K samples per "
        f"problem. Drop them (valid: K <= {n}) or raise {n_key} to {max(over)}"
    ]


@expects("a list of positive integers, e.g. [1, 16, 32]")
def ks_list(v: Any) -> list[int]:
    if not isinstance(v, list) or not v:
        raise Invalid(f"got {v!r}")
    bad = [k for k in v if not isinstance(k, int) or isinstance(k, bool) or k < 1]
    if bad:
        raise Invalid(f"expected positive integers, got {bad}")
    return v


@dataclass
class EvalTask(Schema):
    shorthand: ClassVar[str] = "name"  # `- gsm8k` in the task list means {name: gsm8k}
    validate_always: ClassVar[bool] = True

    name: str = setting("gsm8k", "Registered task (see `esbatch ls`).")
    label: str | None = setting(None, "Column/row name in the tables (default: the task name).")
    params: dict = setting({}, "Task constructor parameters (as in training configs).")
    data_path: str | None = setting(None, "Local data file instead of the hub dataset.")
    limit: int | None = setting(
        None,
        "Evaluate the first `limit` problems only (None = the whole split; a generated task without a dataset "
        "draws 500).",
        ge=1,
    )
    max_new_tokens: int | None = setting(
        None,
        "Per-task token limit (eval configs: default sampling.max_new_tokens; in-training evals: "
        "eval.max_new_tokens, else generation.max_new_tokens).",
        ge=1,
    )
    few_shot: int = setting(0, "Solved demonstrations before each question (the paper evaluates zero-shot).", ge=0)

    def validate(self, path: str, errors: list[str]) -> None:
        if self.name not in TASKS:
            errors.append(
                f"{path}.name: unknown task '{self.name}'.{did_you_mean(self.name, TASKS.names())} "
                f"Available: {', '.join(TASKS.names())}"
            )
        else:
            TASKS.get(self.name).check_params(self.params, f"{path}.params", errors)
            TASKS.get(self.name).check_data_path(self.data_path, f"{path}.data_path", errors)


@dataclass
class InTrainingEvalConfig:
    every: int = setting(
        0,
        "Evaluate the center every k updates (0 = start/end only): greedy on the held-out set, and sampled on "
        "`tasks` when given.",
        ge=0,
    )
    max_new_tokens: int | None = setting(
        None, "Token limit for held-out scoring and `tasks` (None = generation.max_new_tokens).", ge=1
    )
    tasks: list[EvalTask] = setting(
        [],
        "Other tasks scored at every evaluation (paper Figure 2(a-b)): `samples` responses per problem, logged as "
        "eval/<label>/pass_at_<k>, maj_at_<k>, entropy, format. Entries as in an eval config's `tasks` (a mapping "
        "or just a task name). Empty: the held-out evaluation only.",
    )
    samples: int = setting(32, "`tasks`: responses per problem (paper G.4: 32).", ge=1)
    temperature: float = setting(0.6, "`tasks`: sampling temperature (paper G.4: 0.6).", gt=0.0)
    top_p: float = setting(1.0, "`tasks`: nucleus sampling mass.", gt=0.0, le=1.0)
    ks: list = setting([1, 16, 32], "`tasks`: K values of Pass@K and Maj@K (each <= samples).", check=ks_list)

    def validate(self, path: str, errors: list[str]) -> None:
        labels = [t.label or t.name for t in self.tasks]
        for lab in sorted({x for x in labels if labels.count(x) > 1}):
            errors.append(f"{path}.tasks: '{lab}' appears twice; give one of them a distinct `label`")
        if self.tasks:
            errors.extend(ks_errors(self.ks, self.samples, f"{path}.ks", f"{path}.samples"))


@expects(
    "an MLflow store: sqlite:///PATH, http(s)://HOST:PORT, a database URI (postgresql://...), databricks, or unset "
    "(the sqlite store <output_dir>/mlflow.db)"
)
def tracking_uri(v: Any) -> str | None:
    """A tracking URI MLflow will open. A file store (file:PATH or a bare path) is refused here, before any work,
    because MLflow 3 refuses it only when the run logs (an eval: after all its generation) unless
    MLFLOW_ALLOW_FILE_STORE=true."""
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise Invalid(f"got {v!r}")
    file_store = urlparse(v).scheme in ("", "file") and v != "databricks"
    if file_store and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        raise Invalid(f"{v!r} is an MLflow file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE=true")
    return v


@dataclass
class TrackingConfig:
    uri: str | None = setting(
        None, "MLflow tracking URI (None = sqlite store <output_dir>/mlflow.db).", check=tracking_uri
    )
    experiment: str = setting("esbatch", "MLflow experiment name.")
    log_model: bool = setting(False, "Save the final center in HF format as a run artifact.")
    drift: bool = setting(
        True,
        "Log update/rel_distance_from_theta0 = ||theta_t - theta_0|| / ||theta_0|| every update, from an fp32 copy "
        "of theta_0 (4 bytes/param; ES: beside the center, GRPO: on CPU, rank 0). Off: ES does not log it, GRPO "
        "logs it at checkpoints and the last step by reading the base model's safetensors tensor by tensor.",
    )
    parent_run_id: str | None = setting(None, "Nest this run's MLflow run under this one (pipelines set it).")


@expects("a list of update counts (integers >= 1), e.g. [50, 100]")
def update_list(v: Any) -> list[int]:
    if not isinstance(v, list):
        raise Invalid(f"got {v!r}")
    bad = [k for k in v if not isinstance(k, int) or isinstance(k, bool) or k < 1]
    if bad:
        raise Invalid(f"expected integers >= 1, got {bad}")
    return sorted(set(v))


CENTER_MODES = ("every", "final", "none")  # checkpoint.center


@dataclass
class CheckpointConfig:
    center: str = setting(
        "every",
        "How an ES run keeps its center on disk (its seed log, log.jsonl, is always kept: theta_0 plus the log "
        "rebuilds any center bit for bit). every: center.safetensors every `every` updates and at the end (fp32, 4 "
        "bytes/param; es.restore: inplace, the compute dtype); a resume loads it and replays the updates since. "
        "final: no center file; at the end the final model is exported in the compute dtype (model.dtype, e.g. "
        "bfloat16: 2 bytes/param) as the HF folder final_model/, which `esbatch eval --checkpoint RUN` evaluates. "
        "none: no weights on disk at all. With final or none a resumed run replays every logged update from "
        "theta_0 (the base model plus model.init_weights), and readers that need the fp32 center (esbatch eval "
        "without an up-to-date final_model/, analyze drift, threshold, center) rebuild it by the same replay. "
        "GRPO and pipelines need every (GRPO's updates cannot be replayed; stages hand over center.safetensors). "
        "`esbatch sweep FILE --dry-run` prints the disk each choice needs.",
        choices=CENTER_MODES,
    )
    every: int = setting(
        10,
        "Save the center every k updates (fp32; es.restore: inplace, the live compute-dtype weights); updates "
        "since are replayed from the log. With checkpoint.center: final or none, ES saves no center (GRPO's "
        "DeepSpeed checkpoints still follow this).",
        ge=1,
    )
    snapshots: list = setting(
        [],
        "Also keep the center after these updates as snapshots/center-<T>.safetensors (evaluable with `esbatch "
        "eval --checkpoint RUN --at T`). GRPO needs them for intermediate centers; ES can also rebuild any center "
        "from its log (`esbatch center RUN --at T`).",
        check=update_list,
    )


def model_errors(model: ModelConfig, errors: list[str], token_limits: dict[str, int | None] | None = None) -> None:
    """model.name must resolve (aliases and local folders now; hub ids when loaded); init_weights must exist;
    each of ``token_limits`` (key -> max_new_tokens) must be at most the model's context where its files say it
    (a limit over it cannot be generated: prompt and answer share the context)."""
    if why := model_problem(model.name, model.gguf_file):
        errors.append(f"model.name: {why}")
    elif token_limits and (context := context_length(model.name, model.gguf_file, model.revision)):
        for key, limit in token_limits.items():
            if limit is not None and limit > context:
                errors.append(
                    f"{key}: {limit} tokens do not fit the context of {model.name} ({context} tokens, shared with "
                    f"the prompt): give at most {context}, less by the prompt's length"
                )
    if model.init_weights and not Path(model.init_weights).expanduser().is_file():
        errors.append(f"model.init_weights: {model.init_weights} is not a file (a center.safetensors)")


SHARED_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "model": ModelConfig,
    "task": TaskConfig,
    "generation": GenerationConfig,
    "reward": RewardConfig,
    "eval": InTrainingEvalConfig,
    "tracking": TrackingConfig,
    "checkpoint": CheckpointConfig,
    "backend": BackendConfig,
}
