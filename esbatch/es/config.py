"""The ``es`` section of a run config: ES's settings with their help text, and the checks across sections that
concern ES (run by ``ES.check`` for an ES run and for the ES stage of a pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from esbatch.backends.config import ESSetup
from esbatch.schema import setting
from esbatch.train.config import TrainConfig

# es.noise (esbatch/perturb/noise.py:NOISES; spelled here so reading a config needs no torch)
NOISES = ("philox-gauss", "philox-rademacher", "legacy-cpu")
LEGACY_NOISE = "legacy-cpu"  # runs recorded before es.noise existed
# es.perturbation and es.lowrank_vectors (esbatch/perturb/lowrank.py)
PERTURBATIONS = ("full", "lowrank")
LOWRANK_VECTORS = ("full", "frozen")


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
        "every perturb/restore cycle stays in the weights (resume replays the cycles). Several engines or ranks "
        "each keep their own, as in the paper (replicas/* logs how far apart; the center is replica 0's).",
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


def restore_errors(cfg: TrainConfig, errors: list[str]) -> None:
    """es.restore: inplace keeps no fp32 center: nothing that needs one goes with it (see its help)."""
    es = cfg.section(ESConfig)
    if es.restore != "inplace":
        return
    if es.master != "device":
        errors.append(
            f"es.master: {es.master} cannot go with es.restore: inplace: inplace keeps no fp32 center to move "
            "elsewhere. Use es.master: device, or es.restore: exact"
        )
    if es.diversity.every > 0:
        errors.append(
            f"es.diversity.every: {es.diversity.every} cannot run with es.restore: inplace: its second pass "
            "perturbs and restores every member again, which in place leaves extra round-off in the weights and "
            "changes the run (replay would not redo it). Use es.diversity.every: 0, or es.restore: exact"
        )


def lowrank_errors(cfg: TrainConfig, errors: list[str]) -> None:
    """es.perturbation: lowrank only where the batched low-rank forward exists (exact restore, center on device)."""
    es = cfg.section(ESConfig)
    if es.perturbation != "lowrank":
        return
    if es.master != "device":
        errors.append(
            f"es.perturbation: lowrank needs es.master: device (got {es.master}): its batched forward reads the "
            "fp32 center's factors next to the weights. Use es.master: device, or es.perturbation: full"
        )
    if es.restore != "exact":
        errors.append(
            f"es.perturbation: lowrank needs es.restore: exact (got {es.restore}): members are never written "
            "into the weights (each row adds its own perturbation), and the update is accumulated on the fp32 "
            "center. Use es.restore: exact, or es.perturbation: full"
        )


def diversity_errors(cfg: TrainConfig, errors: list[str]) -> None:
    """es.diversity.samples > 1 draws several responses per member and prompt: that needs sampling."""
    es = cfg.section(ESConfig)
    if es.diversity.samples > 1 and cfg.generation.temperature == 0:
        errors.append(
            f"es.diversity.samples: {es.diversity.samples} responses per member and prompt need sampling, "
            "but generation.temperature is 0 (greedy: every response is the same); use samples: 1 or a "
            "temperature > 0"
        )


def backend_setup(cfg: TrainConfig) -> ESSetup:
    """What the ES backend is built from (esbatch/backends/config.py), read from a validated run config."""
    es = cfg.section(ESConfig)
    return ESSetup(
        model=cfg.model,
        backend=cfg.backend,
        batch_size=cfg.generation.batch_size,
        track_drift=cfg.tracking.drift,
        seed=cfg.run.seed,
        hang_timeout_s=cfg.run.hang_timeout_s,
        restore=es.restore,
        noise=es.noise,
        master=es.master,
        perturbation=es.perturbation,
        rank=es.rank,
        lowrank_vectors=es.lowrank_vectors,
        dispatch=es.dispatch,
    )
