"""The small interface the trainers talk to, in two parts.

``Generator``: render prompts and generate (ES, GRPO and eval all use it). ``ESBackend`` adds the ES weight
moves: perturb from a seed, restore the center, apply an update (one ``UpdateSpec``), load, checksum,
without the trainer knowing how or where the weights live (one HF model, or vLLM engines).
A registered backend (esbatch/backends/__init__.py:BackendFactory) builds these for each use: ``for_es(setup)``,
``for_inference(model_cfg, center, batch_size)`` and ``for_policy(module, tokenizer, setup)``; each
ESBackend's ``for_es`` builds its own class, and the registry picks the class (by es.perturbation).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from esbatch.backends.config import BackendConfig, ESSetup
from esbatch.backends.dispatch import Claim, dispatch
from esbatch.models import ModelConfig
from esbatch.perturb.update import UpdateSpec


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 256
    n: int = 1  # samples per prompt; a backend generates them in one call (prompt encoded once)
    entropy: bool = False  # also return each response's mean token entropy
    logprobs: bool = False  # also return each sampled token's log-prob under the sampling distribution


class PerturbedMember(NamedTuple):
    """One population member as a backend evaluates it: theta = center + scale * eps(seed), responses sampled with
    ``gen_seed`` (esbatch/es/core.py:Member with its signed scale, sign * sigma). The one member type of every
    backend, read by field name; a tuple, so it travels to vLLM workers as one (es_lowrank_begin)."""

    seed: int
    scale: float
    gen_seed: int


@dataclass
class Generation:
    text: str
    n_tokens: int  # generated tokens, EOS included when it was produced
    entropy: float | None = None  # mean over the response's tokens of H(p_t), p_t = the sampling distribution
    token_ids: list[int] | None = None  # the sampled tokens (GRPO scores these, not a re-tokenized text)
    token_entropy: list[float] | None = None  # H(p_t) of each token (entropy's terms), with sampling.entropy
    # log p_t(y_t) of each sampled token, p_t = softmax(logits / T) cut to top_p as sampled (with sampling.logprobs;
    # vLLM's processed_logprobs): what GRPO's rollout correction compares with the trainer's own log-probs
    logprobs: list[float] | None = None


@dataclass
class UpdateStats:
    update_l2: float  # ||theta_{t+1} - theta_t|| of the fp32 center (es.restore inplace: of the step added)
    changed_fraction: float  # elements whose compute-dtype value actually changed
    rel_distance: float | None = None  # ||theta_t - theta_0|| / ||theta_0||, when tracked
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class PopulationOutput:
    generations: list[list[Generation]]  # per member evaluated, one list of responses (prompt-major)
    generation_s: float = 0.0  # summed over members (engines in parallel: the population's wall time, less moves)
    perturb_restore_s: float = 0.0  # engines in parallel: each engine's share
    idle_s: float = 0.0  # engine-seconds spent waiting for the slowest engine (esbatch/backends/dispatch.py)
    members: list[int] = field(default_factory=list)  # whose generations, ascending; all, in order, if not given
    # per local replica (engine), the members it evaluated in the order it did (es.restore: inplace replays them)
    replicas: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            self.members = list(range(len(self.generations)))


class Generator(ABC):
    """Generate with the current weights."""

    @abstractmethod
    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """Render chat messages with the model's own chat template, ready for generation."""

    @abstractmethod
    def generate(self, prompts: Sequence[str], sampling: SamplingParams, seed: int) -> list[Generation]:
        """``sampling.n`` responses per prompt (prompt-major: all of prompt 0's, then prompt 1's, ...),
        reproducible for a given seed and set of weights."""

    def count_tokens(self, texts: Sequence[str]) -> list[int] | None:
        """Token count of each text (for FLOP accounting); None when the backend cannot tell."""
        return None

    def num_parameters(self) -> int | None:
        """Parameters of the model (for FLOP accounting); None when unknown."""
        return None

    def close(self) -> None:
        """Release engine processes (no-op for in-process backends); the backend is unusable afterwards."""
        return None

    def load_policy(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:  # noqa: B027 - optional hook
        """A policy generator that holds its own copy of the weights loads these (HF names, the trained module's
        changed tensors) after an optimizer step; a generator reading the module itself has nothing to do."""


class ESBackend(Generator):
    """A generator whose weights follow an fp32 center that ES perturbs, restores and updates in place.

    ``restore_mode`` "inplace" (es.restore; the HF backend only): no fp32 center, the live weights are moved in
    place in their compute dtype, so restore() returns them only up to round-off (esbatch/perturb/inplace.py).
    """

    restore_mode: str = "exact"

    @classmethod
    @abstractmethod
    def for_es(cls, setup: ESSetup) -> ESBackend:
        """Build the backend (load the model) for ES training (esbatch/backends/config.py:ESSetup)."""

    @classmethod
    def for_inference(
        cls, model: ModelConfig, center: Path | None, batch_size: int, backend: BackendConfig | None = None
    ) -> Generator:
        """A generator for evaluation: ``model`` (a ModelConfig) with the weights of ``center`` if given;
        ``backend``: the eval config's backend section (engine settings), None for the defaults."""
        raise NotImplementedError(f"{cls.__name__} cannot serve evaluations")

    @classmethod
    def for_policy(cls, module: Any, tokenizer: Any, setup: ESSetup) -> Generator:
        """A generator of the policy ``module`` that gradients train (GRPO): it reads the module itself, or holds a
        copy that ``load_policy`` brings up to date. ``setup``: the model and backend sections (model.dtype: the
        module's), generation.batch_size, run.seed and run.hang_timeout_s; the ES settings are unused."""
        raise NotImplementedError(f"{cls.__name__} cannot generate from a training module")

    def evaluate_population(
        self,
        members: Sequence[PerturbedMember],
        prompts: Sequence[str],
        sampling: SamplingParams,
        claim: Claim | None = None,
    ) -> PopulationOutput:
        """Responses of each member (direction seed, scale, generation seed): theta = center + scale * eps.

        ``claim``: evaluate only the members it hands out (indices into ``members``; ranks sharing a population
        dynamically, esbatch/train/ranks.py), reported in ``members`` of the output. One member after another
        here; a backend with several engines overrides this to spread the members over them.
        """

        chain = self.chains_members

        def work(_: int, i: int) -> tuple[list[Generation], float, float]:
            m = members[i]
            t0 = time.perf_counter()
            self.perturb_next(m.seed, m.scale) if chain else self.perturb(m.seed, m.scale)
            t1 = time.perf_counter()
            gens = self.generate(prompts, sampling, m.gen_seed)
            t2 = time.perf_counter()
            if not chain:
                self.restore()
            return gens, t2 - t1, (t1 - t0) + (time.perf_counter() - t2)

        restore_s = 0.0
        try:
            done = dispatch(claim if claim is not None else range(len(members)), 1, work)
        finally:
            if chain and self.perturbed:  # one restore after the last member
                t0 = time.perf_counter()
                self.restore()
                restore_s = time.perf_counter() - t0
        res = [done.results[i] for i in done.order]
        return PopulationOutput(
            [g for g, _, _ in res],
            generation_s=sum(s for _, s, _ in res),
            perturb_restore_s=sum(s for _, _, s in res) + restore_s,
            members=done.order,
            replicas=[w.items for w in done.workers],
        )

    # True where perturb_next() can go from one member straight to the next: evaluate_population then restores
    # once, after the last member, instead of after each (a full copy of the weights saved per member)
    chains_members: bool = False

    def perturb_next(self, seed: int, scale: float) -> None:
        """theta <- center + scale * eps(seed), from the center or from another member's weights."""
        if getattr(self, "perturbed", False):
            self.restore()
        self.perturb(seed, scale)

    def checksum(self) -> float | None:
        """A cheap fingerprint of the fp32 center, equal on processes holding equal centers."""
        return None

    # ---------------------------------------------------------------- replicas (es.restore: inplace)
    # A replica is one copy of the weights that ES moves (an engine); in place, each keeps its own round-off.
    @property
    def replicas(self) -> int:
        """How many copies of the weights this backend moves (its engines)."""
        return 1

    def cycles(self, members: Sequence[Sequence[tuple[int, float]]]) -> None:
        """Redo perturb/restore cycles without generating: replica k those of ``members[k]`` ((seed, scale) each),
        in order (replay of es.restore: inplace, esbatch/es/replay.py)."""
        (mine,) = members
        for seed, scale in mine:
            self.perturb(seed, scale)
            self.restore()

    def replica_samples(self) -> list[torch.Tensor]:
        """Each replica's values at the same sampled coordinates (esbatch/perturb/inplace.py:coordinate_sample)."""
        raise NotImplementedError(f"{type(self).__name__} cannot sample its weights")

    @abstractmethod
    def perturb(self, seed: int, scale: float) -> None:
        """theta <- center + scale * eps(seed), in place. Only from the center (call restore() between)."""

    @abstractmethod
    def restore(self) -> None:
        """Put the center back: bit for bit (exact), or by subtracting the perturbation (inplace)."""

    @abstractmethod
    def update(self, spec: UpdateSpec) -> UpdateStats:
        """center <- center + alpha/N * sum_i w_i * eps(seed_i)  (esbatch/perturb/update.py:es_update)."""

    @abstractmethod
    def center_state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of the center keyed by HF parameter names: fp32 (exact), the compute dtype (inplace)."""

    @abstractmethod
    def load_center(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the center (resume from a checkpoint)."""

    @abstractmethod
    def save_pretrained(self, path: str | Path) -> None:
        """Write the center as an HF model directory (weights in the compute dtype + tokenizer)."""

    def memory_report(self) -> dict[str, float]:
        """Bytes held by the backend beyond the model itself (master copy, theta_0, ...)."""
        return {}
