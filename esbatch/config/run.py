"""The run config: what `esbatch train` trains, as validated sections (YAML -> dataclasses).

Every field carries help text and its constraints (esbatch/schema.py). ``load_config`` collects *all*
problems at once and raises ``ConfigError`` whose lines name the YAML path of the key, say why it is wrong
and list the valid choices. Checks that concern one algorithm live with it (``Algorithm.check``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from esbatch.config.loader import find, read_yaml
from esbatch.schema import (
    ConfigError,
    Invalid,
    Schema,
    build,
    deep_merge,
    expects,
    flatten,
    folder_name,
    setting,
    stage_spans,
)
from esbatch.registry import did_you_mean

# es.noise (esbatch/perturb/noise.py:NOISES; spelled here so reading a config needs no torch)
NOISES = ("philox-gauss", "philox-rademacher", "legacy-cpu")
LEGACY_NOISE = "legacy-cpu"
# es.perturbation and es.lowrank_vectors (esbatch/perturb/lowrank.py)
PERTURBATIONS = ("full", "lowrank")
LOWRANK_VECTORS = ("full", "frozen")

# What a resumed run may change: budgets and bookkeeping, never what the logged updates depend on.
RESUME_OVERRIDABLE = {
    "run.hang_timeout_s",
    "es.updates",
    "es.epochs",
    "grpo.updates",
    "grpo.epochs",
    "run.threads",
    "backend.engines",  # how many vLLM engines share the population does not change the result
    "eval.every",
    "es.diversity.every",  # diagnostics: the center never depends on them (esbatch/es/trainer.py)
    "es.diversity.samples",
    "eval.tasks",  # in-training evaluations and snapshots read the weights, never change them
    "eval.samples",
    "eval.temperature",
    "eval.top_p",
    "eval.ks",
    "checkpoint.every",
    "checkpoint.snapshots",
    "tracking.log_model",
}
# Keys earlier esbatch versions wrote into run folders and plans; accepted and ignored so those stay resumable.
RETIRED = {("backend", "enable_sleep_mode")}


# ----------------------------------------------------------------------------- sections


@dataclass
class RunConfig:
    name: str = setting("run", "Run name; the run directory is <output_dir>/<name>.", check=folder_name)
    seed: int = setting(0, "Master seed: perturbation seeds, generation seeds and data order derive from it.")
    output_dir: str = setting("esbatch-runs", "Folder holding run directories (config, checkpoints, logs).")
    threads: int = setting(0, "torch CPU threads (0 = leave torch's default).", ge=0)
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


@dataclass
class ModelConfig:
    name: str = setting(
        "smollm2-135m-instruct",
        "Registered model alias (see `esbatch ls`), a local HF model directory, a hub id, a .gguf file, or "
        "hf://org/repo/folder (a model saved in a folder of a hub repo).",
    )
    gguf_file: str | None = setting(None, "GGUF file name inside `name` (a directory or hub id).")
    revision: str | None = setting(None, "Hub revision (branch, tag or commit) when `name` is a hub id.")
    device: str = setting("auto", "Where the live weights sit: auto (cuda if available), cpu, cuda, cuda:N.")
    dtype: str = setting(
        "float32",
        "Compute dtype of the live weights. With bfloat16/float16 an fp32 master copy keeps small updates "
        "(es.restore: exact; inplace moves the weights in this dtype).",
        choices=("float32", "bfloat16", "float16"),
    )
    init_weights: str | None = setting(
        None,
        "Start from these weights (center.safetensors of an earlier run or pipeline stage: fp32, or the compute "
        "dtype for es.restore: inplace).",
    )


@dataclass
class TaskConfig:
    name: str = setting("arithmetic", 'Registered task (see `esbatch ls`) or your own "package.module:Class".')
    params: dict = setting({}, "Task-specific options, checked against the task's constructor.")
    data_path: str | None = setting(None, "Local file (jsonl/json/parquet/csv) used instead of the hub dataset.")
    train_size: int | None = setting(None, "Training problems to use (None = all / the task's default).", ge=1)
    heldout_size: int = setting(64, "Held-out problems scored greedily during training (0 = none).", ge=0)
    few_shot: int = setting(0, "Solved demonstrations placed before each question as chat turns.", ge=0)
    system_prompt: str | None = setting(None, "Override the task family's system prompt (paper App. G.5).")


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


@dataclass
class DiversityConfig:
    every: int = setting(
        0,
        "Log the population's verifier-projected diversity (paper Section 3.1; docs/diagnostics.md) on updates t "
        "with t % every == 0: the success share p_i(x) of every member i on every prompt x goes into the update's "
        "log.jsonl record (`diversity`) and diversity/* metrics. 0 = off. Training is unchanged: the reward still "
        "comes from the one usual response per member and prompt; the extra samples cost generation time only.",
        ge=0,
    )
    samples: int = setting(
        1,
        "m: responses per member and prompt that p_i(x) counts, the reward's own response first; the other m - 1 "
        "are generated in a second pass over the population with their own seeds. 1 = no extra generation "
        "(p_i(x) is 0 or 1, which overstates the JS diversity); > 1 needs generation.temperature > 0.",
        ge=1,
    )


@dataclass
class ESConfig:
    population_size: int = setting(8, "N: evaluations per update (antithetic: N/2 +/- pairs).", ge=2)
    sigma: float = setting(1e-3, "Perturbation scale sigma.", gt=0.0)
    alpha: float = setting(
        5e-4,
        "Center-update scale alpha in theta += alpha/N sum z_i eps_i. 0 = no update (a control: with "
        "restore: inplace the weights then move by perturb/restore round-off alone).",
        ge=0.0,
    )
    normalization: str = setting(
        "zscore", "Reward normalization across the population.", choices=("zscore", "none", "centered_rank")
    )
    eps_num: float = setting(1e-8, "epsilon_num added to the reward std in z-scoring.", ge=0.0)
    estimator: str = setting(
        "one_point",
        "one_point: N directions; antithetic: N/2 directions each at +sigma and -sigma.",
        choices=("one_point", "antithetic"),
    )
    generation_seeds: str = setting(
        "independent",
        "Which members share a sampling seed: every member its own; the +/- members of an "
        "antithetic pair (common random numbers); or the whole population of an update.",
        choices=("independent", "antithetic_pairs", "population"),
    )
    batch_size: int = setting(16, "B: prompts in the shared mini-batch of each update.", ge=1)
    restore: str = setting(
        "exact",
        "How the weights are perturbed, restored and updated. exact: they follow an fp32 master copy of the "
        "center (4 bytes/param): a member is center + sigma*eps computed in fp32 and rounded once, restore copies "
        "the center back bit for bit, the update is accumulated in fp32. inplace: the paper's implementation (App. "
        "G.1): add sigma*eps to the weights in place in the compute dtype (model.dtype), subtract the same "
        "sigma*eps to restore, and add the update in the compute dtype too; no master copy, and the round-off of "
        "every perturb/restore cycle stays in the weights (resume replays the cycles). inplace needs backend.name: "
        "hf in one process (run.nproc_per_node: 1).",
        choices=("exact", "inplace"),
    )
    master: str = setting(
        "device",
        "Where es.restore: exact keeps the fp32 center (esbatch/perturb/offload.py; bytes per parameter in "
        "docs/architecture.md). device: next to the weights (+4 bytes/param there, +4 for theta_0 with "
        "tracking.drift). host: in host memory (pinned on CUDA), with a compute-dtype copy of the center next to "
        "the weights for restore: accelerator memory is inference + 2 bytes/param in bf16; on a CPU it only adds a "
        "copy. disk: in an unlinked scratch file in $TMPDIR read and written chunk by chunk: the process holds "
        "little more than inference does, at the cost of reading the center for every perturbation and restore "
        "(the CPU layout for a host short of RAM). All three give the same bits. host and disk need "
        "es.perturbation: full.",
        choices=("device", "host", "disk"),
    )
    noise: str = setting(
        "philox-gauss",
        "Generator of the directions eps(seed, tensor name) (esbatch/perturb/noise.py, docs/noise.md). "
        "philox-gauss: Gaussian from Philox4x32-10 counters and an integer quantile table, drawn in chunks on the "
        "weights' device and bit-identical on CPU and CUDA and in the hf and vllm backends. philox-rademacher: "
        "+1/-1 from the same counters. legacy-cpu: torch.randn on a CPU generator (runs made before this key; "
        "a run folder whose config.yaml lacks it resumes with legacy-cpu).",
        choices=NOISES,
    )
    perturbation: str = setting(
        "full",
        "Shape of each direction (docs/lowrank.md). full: eps(seed, tensor) on every element. lowrank (EGGROLL, "
        "arXiv 2511.16652): every matrix W (m x n) moves along A B^T / sqrt(r) with A (m x r) and B (n x r) drawn "
        "by es.noise for the derived names <tensor>#A and <tensor>#B, other tensors by es.lowrank_vectors; the "
        "whole population is then generated in batched calls (the shared x W computed once, each row adding its "
        "member's s (x B) A^T / sqrt(r)) and the update alpha/N sum_i w_i A_i B_i^T / sqrt(r) is accumulated in "
        "fp32. lowrank needs es.restore: exact and es.master: device; in backend.name: vllm each engine runs its "
        "members' requests in one batch, each token adding its own member's perturbation (eager mode).",
        choices=PERTURBATIONS,
    )
    rank: int = setting(1, "es.perturbation: lowrank: the rank r of each member's perturbation of a matrix.", ge=1)
    lowrank_vectors: str = setting(
        "full",
        "es.perturbation: lowrank: what the tensors that are not matrices (norm weights, biases) get. full: the "
        "full-rank eps(seed, tensor) of es.perturbation: full; frozen: no perturbation and no update.",
        choices=LOWRANK_VECTORS,
    )
    dispatch: str = setting(
        "static",
        "Which vLLM engine (backend.engines) and which rank (run.nproc_per_node, nodes) evaluates which member. "
        "static: member i on engine i mod E of rank i mod W, a fixed plan in which one slow engine or rank "
        "leaves the others idle until it is done. dynamic: a work queue: each engine takes the next member not "
        "yet taken as soon as it is free, and ranks take them from a counter in the process group's store "
        "(benchmarks/dispatch.py measures the idle time saved). With es.restore: exact the center is the same "
        "either way as long as every engine and rank generates the same responses for a member (same hardware "
        "and software); which rank evaluated which member then varies from run to run.",
        choices=("static", "dynamic"),
    )
    updates: int | None = setting(None, "Training budget in updates (set this or `epochs`).", ge=1)
    epochs: float | None = setting(None, "Training budget in epochs over the training split.", gt=0.0)
    diversity: DiversityConfig = field(default_factory=DiversityConfig)

    def validate(self, path: str, errors: list[str]) -> None:
        if self.estimator == "antithetic" and self.population_size % 2:
            errors.append(
                f"es.population_size: antithetic pairs need an even N (got {self.population_size}); "
                f"use {self.population_size + 1} or estimator: one_point"
            )
        if self.generation_seeds == "antithetic_pairs" and self.estimator != "antithetic":
            errors.append(
                "es.generation_seeds: 'antithetic_pairs' needs es.estimator: antithetic "
                "(valid for one_point: independent, population)"
            )


@dataclass
class GRPOConfig:
    group_size: int = setting(
        8, "G: responses per prompt (TRL num_generations=8; the paper pairs G=8 with ES N=32).", ge=2
    )
    batch_size: int = setting(8, "B: prompts per optimizer step, across all ranks.", ge=1)
    learning_rate: float = setting(1e-6, "AdamW learning rate (TRL default 1e-6).", gt=0.0)
    weight_decay: float = setting(0.0, "AdamW weight decay.", ge=0.0)
    epsilon: float = setting(0.2, "Lower (and default upper) clip of the PPO ratio (TRL/PPO 0.2).", gt=0.0)
    epsilon_high: float | None = setting(
        None, "Separate upper clip (DAPO clip-higher, e.g. 0.28); None = epsilon.", gt=0.0
    )
    beta: float = setting(
        0.0, "KL penalty weight (k3 estimator); 0 = no reference model is loaded (TRL default).", ge=0.0
    )
    scale_rewards: str = setting(
        "group",
        "Advantage scale: group std (GRPO), batch std, or none (Dr. GRPO).",
        choices=("group", "batch", "none"),
    )
    loss_aggregation: str = setting(
        "token_mean",
        "token_mean (DAPO/verl), seq_mean_token_mean (original GRPO), seq_mean_token_sum (Dr. GRPO).",
        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"),
    )
    micro_batch_size: int | None = setting(
        None,
        "Sequences (responses) per forward/backward pass on each rank; a step accumulates the gradients of "
        "ceil(its sequences / this) micro-batches before its one optimizer step, with the loss normalised over "
        "the whole batch, so the gradient equals the unbatched one. Old and reference log-probs are computed "
        "in micro-batches too. A memory setting, not a hyperparameter. None = the whole batch on this rank in "
        "one pass. TRL: per_device_train_batch_size (counted in completions) with gradient_accumulation_steps.",
        ge=1,
    )
    iterations: int = setting(
        1,
        "mu: optimizer steps per generated batch (TRL num_iterations; GRPO paper's mu). Old log-probs are "
        "computed once, before the first of them, so from the second on the ratio differs from 1 and the clip "
        "acts. 1 = on-policy, old = current log-probs detached (no extra forward).",
        ge=1,
    )
    max_grad_norm: float = setting(1.0, "Gradient clipping (DeepSpeed gradient_clipping).", gt=0.0)
    zero_stage: int = setting(
        2, "DeepSpeed ZeRO stage 0-2 (3 would shard the weights the generator reads on every rank).", ge=0, le=2
    )
    updates: int | None = setting(
        None,
        "Training budget in optimizer steps (set this or `epochs`), as TRL's max_steps counts them (global_step): "
        "with iterations = mu, a batch is generated every mu steps and a step is one logged update (log.jsonl "
        "line, MLflow step, checkpoint.every and eval.every count them too).",
        ge=1,
    )
    epochs: float | None = setting(
        None,
        "Training budget in epochs over the training split: each prompt is generated for once per epoch, so an "
        "epoch is ceil(train / batch_size) generated batches = that many x iterations optimizer steps (TRL).",
        gt=0.0,
    )


@dataclass
class PipelineConfig:
    stages: list = setting([], "Algorithms run one after the other, each from the previous one's weights: [es, grpo].")
    split: list | None = setting(None, "Share of the total budget per stage (default: equal), e.g. [0.5, 0.5].")
    updates: int | None = setting(None, "Total update budget shared by the stages.", ge=1)


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
        from esbatch.tasks import TASKS

        if self.name not in TASKS:
            errors.append(
                f"{path}.name: unknown task '{self.name}'.{did_you_mean(self.name, TASKS.names())} "
                f"Available: {', '.join(TASKS.names())}"
            )
        else:
            TASKS.get(self.name).check_params(self.params, f"{path}.params", errors)


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
    ks: list = setting(
        [1, 16, 32], "`tasks`: K values of Pass@K and Maj@K (those <= samples are logged).", check=ks_list
    )

    def validate(self, path: str, errors: list[str]) -> None:
        labels = [t.label or t.name for t in self.tasks]
        for lab in sorted({x for x in labels if labels.count(x) > 1}):
            errors.append(f"{path}.tasks: '{lab}' appears twice; give one of them a distinct `label`")


@dataclass
class TrackingConfig:
    uri: str | None = setting(None, "MLflow tracking URI (None = sqlite store <output_dir>/mlflow.db).")
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


@dataclass
class BackendConfig:
    name: str = setting("hf", "Generation backend (see `esbatch ls`): hf, or vllm (imported only when chosen).")
    engines: int = setting(
        1, "vllm: engines on this node; the population is sharded over them (one GPU each on GPU nodes).", ge=1
    )
    gpu_memory_utilization: float = setting(0.85, "vllm: fraction of each GPU an engine may use.", gt=0, le=1)
    kv_cache_gb: int = setting(2, "vllm on CPU: KV cache size per engine in whole GiB (VLLM_CPU_KVCACHE_SPACE).", ge=1)
    max_model_len: int | None = setting(None, "vllm: context length to reserve KV cache for (default: the model's).")
    prefix_caching: bool = setting(True, "vllm: reuse shared prompt prefixes; reset after every weight change.")
    cuda_graphs: bool = setting(True, "vllm on GPU: capture CUDA graphs (false = eager mode). Ignored on CPU.")
    worker_extension: str = setting(
        "esbatch.backends.vllm_worker:ESWorkerExtension",
        "vllm: the class mixed into each engine's worker that moves its weights (package.module:Class, a "
        "subclass of the default). Change it only to instrument engines, as the engine hang test does.",
    )


@dataclass
class TrainConfig(Schema):
    algorithm: str = setting(
        "es",
        'Training algorithm: es, grpo, pipeline (the stages of `pipeline`), or your own "package.module:Class".',
    )
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    es: ESConfig = field(default_factory=ESConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    eval: InTrainingEvalConfig = field(default_factory=InTrainingEvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def params(self) -> dict[str, Any]:
        """The resolved config as flat dotted keys (MLflow params)."""
        return flatten(self.to_dict())

    def algo(self) -> Any:
        """The algorithm class (esbatch/train/algorithms.py) named by ``algorithm``."""
        from esbatch.train.algorithms import ALGORITHMS

        return ALGORITHMS.get(self.algorithm)

    def total_updates(self, n_train: int) -> int:
        """The training budget in updates, given the size of the training split."""
        return self.algo().budget(self, n_train)

    def validate(self, path: str, errors: list[str]) -> None:
        """Checks across sections and against the registries (algorithms, tasks, backends, models)."""
        from esbatch.backends import BACKENDS
        from esbatch.tasks import TASKS
        from esbatch.train.algorithms import ALGORITHMS

        model_errors(self.model, errors)
        out = Path(self.run.output_dir).expanduser()
        if out.exists() and not out.is_dir():
            errors.append(f"run.output_dir: {out} is a file; give a folder (it is created if missing)")

        why = ALGORITHMS.problem(self.algorithm)
        if why:
            errors.append(f"algorithm: {why}")
        else:
            ALGORITHMS.get(self.algorithm).check(self, errors)
        dev = self.model.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            errors.append(f"model.device: {dev!r} is not a device. Valid: auto, cpu, cuda, cuda:N")
        why = TASKS.problem(self.task.name)
        if why:
            errors.append(f"task.name: {why}")
        else:
            TASKS.get(self.task.name).check_params(self.task.params, "task.params", errors)
        if self.backend.name != "vllm" and self.backend.engines != 1:
            errors.append(
                f"backend.engines: {self.backend.engines} engines need backend.name: vllm (the {self.backend.name} "
                "backend holds one model); to split the population over processes set run.nproc_per_node instead"
            )
        restore_errors(self, errors)
        lowrank_errors(self, errors)
        center_errors(self, errors)
        why = BACKENDS.problem(self.backend.name)
        if why:
            errors.append(f"backend.name: {why}")
        elif self.eval.tasks and (why := BACKENDS.unsupported(self.backend.name, "eval")):
            errors.append(f"eval.tasks: backend.name {self.backend.name} cannot serve in-training evaluations: {why}")


def restore_errors(cfg: TrainConfig, errors: list[str]) -> None:
    """es.restore: inplace only where every weight change happens in one process (see its help)."""
    trains_es = cfg.algorithm == "es" or (cfg.algorithm == "pipeline" and "es" in cfg.pipeline.stages)
    if not trains_es or cfg.es.restore != "inplace":
        return
    if cfg.backend.name != "hf":
        errors.append(
            f"es.restore: inplace runs on backend.name: hf only (got {cfg.backend.name}): the {cfg.backend.name} "
            "engines keep an fp32 center. Use backend.name: hf, or es.restore: exact"
        )
    if cfg.run.nproc_per_node > 1:
        errors.append(
            f"es.restore: inplace needs one process (got run.nproc_per_node: {cfg.run.nproc_per_node}): each rank "
            "would carry the round-off of only the members it evaluated, and the ranks' centers would drift apart. "
            "Use run.nproc_per_node: 1, or es.restore: exact"
        )
    if cfg.es.master != "device":
        errors.append(
            f"es.master: {cfg.es.master} cannot go with es.restore: inplace: inplace keeps no fp32 center to move "
            "elsewhere. Use es.master: device, or es.restore: exact"
        )
    if cfg.es.diversity.every > 0:
        errors.append(
            f"es.diversity.every: {cfg.es.diversity.every} cannot run with es.restore: inplace: its second pass "
            "perturbs and restores every member again, which in place leaves extra round-off in the weights and "
            "changes the run (replay would not redo it). Use es.diversity.every: 0, or es.restore: exact"
        )


def lowrank_errors(cfg: TrainConfig, errors: list[str]) -> None:
    """es.perturbation: lowrank only where the batched low-rank forward exists (exact restore, center on device)."""
    trains_es = cfg.algorithm == "es" or (cfg.algorithm == "pipeline" and "es" in cfg.pipeline.stages)
    if not trains_es or cfg.es.perturbation != "lowrank":
        return
    if cfg.es.master != "device":
        errors.append(
            f"es.perturbation: lowrank needs es.master: device (got {cfg.es.master}): its batched forward reads the "
            "fp32 center's factors next to the weights. Use es.master: device, or es.perturbation: full"
        )
    if cfg.es.restore != "exact":
        errors.append(
            f"es.perturbation: lowrank needs es.restore: exact (got {cfg.es.restore}): members are never written "
            "into the weights (each row adds its own perturbation), and the update is accumulated on the fp32 "
            "center. Use es.restore: exact, or es.perturbation: full"
        )


def center_errors(cfg: TrainConfig, errors: list[str]) -> None:
    """checkpoint.center: final | none rely on replaying the seed log, which only ES runs can do."""
    if cfg.checkpoint.center == "every" or cfg.algorithm == "es":
        return
    if cfg.algorithm == "pipeline":
        why = (
            "a pipeline's stages hand their weights to the next stage through center.safetensors (its "
            "model.init_weights), and a GRPO stage cannot rebuild its weights from a log"
        )
    elif cfg.algorithm == "grpo":
        why = "GRPO's updates are gradients of sampled responses and cannot be replayed from the log"
    else:
        why = f"only ES runs rebuild their center from the seed log; {cfg.algorithm} keeps its weights in files"
    errors.append(
        f"checkpoint.center: {cfg.checkpoint.center} needs algorithm: es ({why}). Use checkpoint.center: every "
        f"for algorithm: {cfg.algorithm}"
    )


def model_errors(model: ModelConfig, errors: list[str]) -> None:
    """model.name must resolve (aliases and local folders now; hub ids when loaded); init_weights must exist."""
    from esbatch.models import model_problem

    if why := model_problem(model.name, model.gguf_file):
        errors.append(f"model.name: {why}")
    if model.init_weights and not Path(model.init_weights).expanduser().is_file():
        errors.append(f"model.init_weights: {model.init_weights} is not a file (a center.safetensors)")


# ----------------------------------------------------------------------------- loading


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
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            reason = str(e).splitlines()[0]
            raise ConfigError(
                [f"--set {item!r}: the value is not valid YAML ({reason}); quote it or fix the brackets"]
            ) from None
    return out


def _drop_retired(data: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for section, key in RETIRED:
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    return data


def config_from_dict(data: dict[str, Any], source: str | None = None) -> TrainConfig:
    """Validate a plain dict; raises ConfigError listing every problem."""
    errors: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError([f"top level: expected a mapping, got {type(data).__name__}"], source)
    cfg = build(TrainConfig, _drop_retired(data), "", errors)
    if errors:
        raise ConfigError(errors, source)
    return cfg


def load_config(name_or_path: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Load a YAML run config (path or built-in name, default: quickstart), apply --set overrides, validate."""
    path = find(name_or_path or "quickstart", "config")
    data = deep_merge(read_yaml(path), parse_overrides(overrides))
    return config_from_dict(data, str(path))


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The config a run folder recorded (its config.yaml), as its updates were made: a folder written before
    ``es.noise`` existed has no such key and was trained with the legacy generator, so it gets
    ``es.noise: legacy-cpu`` rather than the default of new runs."""
    path = Path(run_dir) / "config.yaml"
    data = read_yaml(path)
    es = data.get("es") if isinstance(data.get("es"), dict) else None
    if es is None or "noise" not in es:
        data = deep_merge(data, {"es": {"noise": LEGACY_NOISE}})
    return config_from_dict(deep_merge(data, parse_overrides(overrides)), str(path))
