r"""The Appendix E protocol: evaluate each objective at theta + sigma eps, theta and theta - sigma eps.

Objectives (App. E.3), one scalar per observation (:mod:`esbatch.diagnose.kappa`; default sizes Table 13's):
``regenerated``: the reward (App. G.1) of a response generated afresh at each point, with generation seeds
``common`` to the three points or ``independent`` (the positive point keeps the common one); ``sst2-ce``:
-log p(label word | prompt) on fixed examples (32 examples x 4 directions: our split of the paper's 128
observations); ``fixed``: responses generated once at theta, rescored at each point (``fixed-logprob``,
``fixed-seqloss``, ``fixed-grpo``: the surrogate of :mod:`esbatch.grpo.core`). Weights move through the ES backend
(``perturb(seed, +-sigma)`` / ``restore()``), so the directions are the training noise, the same at every sigma,
and centre evaluations are shared. Scoring objectives need the ``hf`` backend (docs/diagnostics.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from esbatch.diagnose.kappa import KappaStats, kappa_stats
from esbatch.grpo.config import GRPOConfig
from esbatch.tasks import TASKS
from esbatch.train.config import TrainConfig

OBJECTIVES = ("regenerated", "sst2-ce", "fixed")
SEED_MODES = ("common", "independent")
FIXED_NAMES = ("fixed-logprob", "fixed-seqloss", "fixed-grpo")
#: objective -> (label in tables and plots, coupling)
LABELS = {
    "sst2-ce": "SST-2 supervised CE",
    "fixed-logprob": "fixed rollout: mean token log-prob",
    "fixed-seqloss": "fixed rollout: sequence loss",
    "fixed-grpo": "fixed rollout: GRPO surrogate",
    "regenerated": "regenerated-rollout reward",
}


@dataclass
class KappaProtocol:
    """The protocol's sizes and scales; defaults are Table 13's (App. E.4)."""

    sigmas: list[float] = field(default_factory=lambda: [1e-4, 1e-3, 1e-2])
    objectives: list[str] = field(default_factory=lambda: list(OBJECTIVES))
    seed_modes: list[str] = field(default_factory=lambda: list(SEED_MODES))
    prompts: int = 16  # regenerated rollouts
    seeds: int = 16
    directions: int = 4
    fixed_prompts: int = 16
    fixed_seeds: int = 8
    fixed_directions: int = 4
    sst2_examples: int = 32  # x sst2_directions = 128 pooled observations (App. E.4)
    sst2_directions: int = 4
    supervised_task: str = "sst2"
    supervised_data: str | None = None  # local file instead of the hub dataset
    score_batch_size: int = 8  # sequences per forward pass when scoring (logits are [batch, length, vocab])

    def errors(self) -> list[str]:
        """Every problem with these settings, each naming the option, why, and what is valid."""
        errs = []
        if not self.sigmas:
            errs.append("--sigmas: give at least one perturbation scale, e.g. --sigmas 1e-4 1e-3 1e-2")
        errs += [f"--sigmas: {s} is not a positive finite scale (e.g. 1e-3)" for s in self.sigmas if not 0 < s < 1e30]
        for name, valid, got in (
            ("--objectives", OBJECTIVES, self.objectives),
            ("--seed-modes", SEED_MODES, self.seed_modes),
        ):
            errs += [f"{name}: unknown '{x}'; valid: {', '.join(valid)}" for x in got if x not in valid]
            if not got:
                errs.append(f"{name}: give at least one of {', '.join(valid)}")
        sizes = {
            "--prompts": self.prompts,
            "--seeds": self.seeds,
            "--directions": self.directions,
            "--fixed-prompts": self.fixed_prompts,
            "--fixed-seeds": self.fixed_seeds,
            "--fixed-directions": self.fixed_directions,
            "--sst2-examples": self.sst2_examples,
            "--sst2-directions": self.sst2_directions,
            "--score-batch-size": self.score_batch_size,
        }
        errs += [f"{k}: {v} must be at least 1" for k, v in sizes.items() if v < 1]
        if "fixed" in self.objectives and self.fixed_seeds < 2:
            errs.append(f"--fixed-seeds: {self.fixed_seeds}; the GRPO surrogate's group advantage needs at least 2")
        for what, n in (
            ("regenerated", self.prompts * self.seeds * self.directions),
            ("fixed", self.fixed_prompts * self.fixed_seeds * self.fixed_directions),
            ("sst2-ce", self.sst2_examples * self.sst2_directions),
        ):
            if what in self.objectives and 0 < n < 2:
                errs.append(f"{what}: {n} pooled observation(s); a variance needs at least 2 (raise the sizes)")
        return errs


def direction_seeds(run_seed: int, n: int) -> list[int]:
    """n 32-bit direction seeds (the ES noise's seed space), the same prefix for every n."""
    return [int(s) for s in np.random.default_rng([run_seed, 0x4B]).integers(0, 2**32, size=n, dtype=np.uint64)]


def generation_seed(run_seed: int, s: int, point: str, mode: str) -> int:
    """The generation seed of seed index s at point '+', '0' or '-': one per s in ``common`` mode; in
    ``independent`` mode the centre and negative points get their own (the positive point keeps the common one)."""
    offset = 0 if mode == "common" or point == "+" else {"0": 1, "-": 2}[point]
    return int(np.random.default_rng([run_seed, 0x6E, s, offset]).integers(0, 2**31))


@dataclass
class Cell:
    """One row of the result: an objective under one coupling at one sigma, with its pooled observations."""

    objective: str
    coupling: str
    sigma: float
    plus: list[float]
    center: list[float]
    minus: list[float]
    keys: list[tuple[int, int, int]]  # (item, seed index, direction index) of each observation

    @property
    def label(self) -> str:
        return LABELS[self.objective]

    def stats(self) -> KappaStats:
        return kappa_stats(self.plus, self.center, self.minus)


# ----------------------------------------------------------------------------- scoring helpers


def completion_logprobs(
    model: Any, pairs: list[tuple[list[int], list[int]]], temperature: float, batch_size: int
) -> list[Any]:
    """log pi(y_t | x, y_<t) of each completion token, one 1-d fp32 tensor per (prompt ids, completion ids).

    Sequences are right-padded (positions then start at 0 for every row, as unpadded), and only each
    completion's rows of the logits are turned into log-probs (esbatch/grpo/core.py:token_logprobs)."""
    import torch

    from esbatch.grpo.core import token_logprobs

    device = next(model.parameters()).device
    out: list[Any] = []
    with torch.no_grad():
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            width = max(len(p) + len(c) for p, c in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            attn = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, (p, c) in enumerate(chunk):
                ids[r, : len(p) + len(c)] = torch.tensor(p + c)
                attn[r, : len(p) + len(c)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits
            for r, (p, c) in enumerate(chunk):
                if not c:
                    out.append(torch.zeros(0))
                    continue
                z = logits[r, len(p) - 1 : len(p) - 1 + len(c)].unsqueeze(0)
                out.append(token_logprobs(z, torch.tensor(c, device=device).unsqueeze(0), temperature)[0].cpu())
            del logits
    return out


def label_ce(model: Any, pairs: list[tuple[list[int], list[int]]], batch_size: int) -> list[float]:
    """Supervised cross-entropy of each target: -sum_t log p(y_t | x, y_<t) over the label word's tokens y
    (temperature 1: the plain CE a ZO fine-tuner such as MeZO minimizes)."""
    return [-float(lp.sum()) for lp in completion_logprobs(model, pairs, 1.0, batch_size)]


def fixed_objectives(
    logp: list[Any], old_logp: list[Any], advantages: list[float], eps_low: float, eps_high: float | None
) -> dict[str, list[float]]:
    """The three fixed-rollout objectives of each response from its token log-probs at the evaluated point
    (``logp``) and at the theta that generated it (``old_logp``)."""
    import torch

    from esbatch.grpo.core import clipped_surrogate

    out: dict[str, list[float]] = {k: [] for k in FIXED_NAMES}
    for lp, old, a in zip(logp, old_logp, advantages):
        n = max(1, lp.numel())
        out["fixed-logprob"].append(float(lp.sum()) / n)
        out["fixed-seqloss"].append(-float(lp.sum()))
        mask = torch.ones(1, lp.numel())
        loss, _ = clipped_surrogate(lp[None], old[None], torch.tensor([a]), mask, eps_low, eps_high)
        out["fixed-grpo"].append(float(loss.sum()) / n)
    return out


def scoring_model(backend: Any) -> tuple[Any, Any]:
    """The HF model and tokenizer behind an ES backend (the scoring objectives need the logits)."""
    model, tok = getattr(backend, "model", None), getattr(backend, "tok", None)
    if model is None or tok is None or not callable(model):
        raise ValueError(
            f"objectives sst2-ce and fixed score tokens with the model's logits, which backend "
            f"{type(backend).__name__} does not expose; use backend.name: hf, or --objectives regenerated"
        )
    return model, tok


# ----------------------------------------------------------------------------- the protocol


class _Points:
    """Moves the backend to a point and back: ('0',) is the centre, (sigma, d, +1 / -1) a perturbed one."""

    def __init__(self, backend: Any, dir_seeds: list[int]) -> None:
        self.backend, self.dir_seeds = backend, dir_seeds

    def at(self, point: tuple, fn: Callable[[], Any]) -> Any:
        if point == ("0",):
            return fn()
        sigma, d, sign = point
        self.backend.perturb(self.dir_seeds[d], sign * sigma)
        try:
            return fn()
        finally:
            self.backend.restore()


def _points(sigmas: list[float], n_dirs: int) -> list[tuple]:
    return [("0",)] + [(s, d, sign) for s in sigmas for d in range(n_dirs) for sign in (1, -1)]


def _regen_seeds(run_seed: int, proto: KappaProtocol, kind: str) -> list[int]:
    """The distinct generation seeds the regenerated objective needs at a point of this kind ('+', '0', '-')."""
    return sorted({generation_seed(run_seed, s, kind, m) for s in range(proto.seeds) for m in proto.seed_modes})


def planned_evaluations(cfg: TrainConfig, proto: KappaProtocol) -> int:
    """Generate or score calls the protocol makes (the progress bar's total)."""
    total, perturbed = 0, 2 * len(proto.sigmas)
    if "regenerated" in proto.objectives:
        n = {k: len(_regen_seeds(cfg.run.seed, proto, k)) for k in "+0-"}
        total += n["0"] + len(proto.sigmas) * proto.directions * (n["+"] + n["-"])
    if "fixed" in proto.objectives:
        total += proto.fixed_seeds + 1 + perturbed * proto.fixed_directions
    if "sst2-ce" in proto.objectives:
        total += 1 + perturbed * proto.sst2_directions
    return total


def run_kappa(
    cfg: TrainConfig, proto: KappaProtocol, backend: Any, tick: Callable[[int], None] = lambda n: None
) -> list[Cell]:
    """All cells of the diagnostic for a validated run config ``cfg`` on ``backend`` (an ESBackend at theta).

    ``tick(n)`` is called after every n generate/score calls (a progress bar)."""
    cells: list[Cell] = []
    seed = cfg.run.seed
    if "regenerated" in proto.objectives:
        cells += _regenerated(cfg, proto, backend, seed, tick)
    if "sst2-ce" in proto.objectives:
        cells += _supervised(proto, backend, seed, tick)
    if "fixed" in proto.objectives:
        cells += _fixed(cfg, proto, backend, seed, tick)
    return cells


def _prompts(cfg: TrainConfig, backend: Any, n: int) -> tuple[Any, list[Any], list[str]]:
    from esbatch.train.problems import load_problems

    probs = load_problems(cfg, backend)
    if len(probs.train) < n:
        raise ValueError(
            f"task {cfg.task.name}: {len(probs.train)} training problems, the protocol needs {n} prompts "
            "(lower --prompts / --fixed-prompts or use a larger task.train_size)"
        )
    return probs.task, probs.train[:n], probs.train_prompts[:n]


def _regenerated(
    cfg: TrainConfig, proto: KappaProtocol, backend: Any, seed: int, tick: Callable[[int], None]
) -> list[Cell]:
    from esbatch.backends.base import SamplingParams
    from esbatch.train.problems import reward_of

    task, exs, prompts = _prompts(cfg, backend, proto.prompts)
    g = cfg.generation
    sampling = SamplingParams(g.temperature, g.top_p, g.max_new_tokens)
    points = _Points(backend, direction_seeds(seed, proto.directions))
    rewards: dict[tuple[tuple, int], list[float]] = {}  # (point, generation seed) -> reward per prompt

    def generate(gen_seed: int) -> list[float]:
        gens = backend.generate(prompts, sampling, gen_seed)
        tick(1)
        return [reward_of(task.score(x.text, ex), cfg) for x, ex in zip(gens, exs)]

    for point in _points(proto.sigmas, proto.directions):
        kind = "0" if point == ("0",) else ("+" if point[2] > 0 else "-")
        wanted = _regen_seeds(seed, proto, kind)

        def run_point(wanted: list[int] = wanted) -> dict[int, list[float]]:
            return {gs: generate(gs) for gs in wanted}

        for gs, r in points.at(point, run_point).items():
            rewards[(point, gs)] = r

    cells = []
    for mode in proto.seed_modes:
        for sigma in proto.sigmas:
            cell = Cell("regenerated", mode, sigma, [], [], [], [])
            for d in range(proto.directions):
                for s in range(proto.seeds):
                    p = rewards[((sigma, d, 1), generation_seed(seed, s, "+", mode))]
                    c = rewards[(("0",), generation_seed(seed, s, "0", mode))]
                    m = rewards[((sigma, d, -1), generation_seed(seed, s, "-", mode))]
                    for i in range(proto.prompts):
                        cell.plus.append(p[i])
                        cell.center.append(c[i])
                        cell.minus.append(m[i])
                        cell.keys.append((i, s, d))
            cells.append(cell)
    return cells


def _supervised(proto: KappaProtocol, backend: Any, seed: int, tick: Callable[[int], None]) -> list[Cell]:
    model, tok = scoring_model(backend)
    task = TASKS.get(proto.supervised_task)(proto.supervised_data)
    if not hasattr(task, "target"):
        raise ValueError(
            f"--supervised-task {proto.supervised_task}: the task has no target() (the reply the CE scores); use sst2"
        )
    exs = task.splits(proto.sst2_examples, 0, 0, seed)["train"]
    if len(exs) < proto.sst2_examples:
        raise ValueError(
            f"{proto.supervised_data or proto.supervised_task}: {len(exs)} examples, --sst2-examples asks for "
            f"{proto.sst2_examples}"
        )
    pairs = []
    for ex in exs:
        prompt = backend.chat_prompt(task.messages(ex, []))
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        pairs.append((p_ids, tok(task.target(ex), add_special_tokens=False)["input_ids"]))
    points = _Points(backend, direction_seeds(seed, proto.sst2_directions))

    def ce() -> list[float]:
        out = label_ce(model, pairs, proto.score_batch_size)
        tick(1)
        return out

    values = {pt: points.at(pt, ce) for pt in _points(proto.sigmas, proto.sst2_directions)}
    cells = []
    for sigma in proto.sigmas:
        cell = Cell("sst2-ce", "fixed batch", sigma, [], [], [], [])
        for d in range(proto.sst2_directions):
            for i in range(len(pairs)):
                cell.plus.append(values[(sigma, d, 1)][i])
                cell.center.append(values[("0",)][i])
                cell.minus.append(values[(sigma, d, -1)][i])
                cell.keys.append((i, 0, d))
        cells.append(cell)
    return cells


def _fixed(cfg: TrainConfig, proto: KappaProtocol, backend: Any, seed: int, tick: Callable[[int], None]) -> list[Cell]:
    import torch

    from esbatch.backends.base import SamplingParams
    from esbatch.grpo.core import group_advantages
    from esbatch.train.problems import reward_of

    model, tok = scoring_model(backend)
    task, exs, prompts = _prompts(cfg, backend, proto.fixed_prompts)
    g = cfg.generation
    temperature = g.temperature or 1.0
    sampling = SamplingParams(g.temperature, g.top_p, g.max_new_tokens)
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    pairs, rewards = [], torch.zeros(len(prompts), proto.fixed_seeds)
    responses: list[list[Any]] = []
    for s in range(proto.fixed_seeds):  # the frozen rollouts, generated once at theta
        gens = backend.generate(prompts, sampling, generation_seed(seed, s, "+", "common"))
        tick(1)
        responses.append(gens)
        for i, (x, ex) in enumerate(zip(gens, exs)):
            ids = x.token_ids if x.token_ids is not None else tok(x.text, add_special_tokens=False)["input_ids"]
            pairs.append((prompt_ids[i], list(ids)))
            rewards[i, s] = reward_of(task.score(x.text, ex), cfg)
    adv = group_advantages(rewards, cfg.section(GRPOConfig).scale_rewards)  # [prompts, seeds]; pairs are seed-major
    advantages = [float(adv[i, s]) for s in range(proto.fixed_seeds) for i in range(len(prompts))]
    points = _Points(backend, direction_seeds(seed, proto.fixed_directions))

    def logprobs() -> list[Any]:
        out = completion_logprobs(model, pairs, temperature, proto.score_batch_size)
        tick(1)
        return out

    at_points = {pt: points.at(pt, logprobs) for pt in _points(proto.sigmas, proto.fixed_directions)}
    old = at_points[("0",)]
    values = {
        pt: fixed_objectives(lp, old, advantages, cfg.section(GRPOConfig).epsilon, cfg.section(GRPOConfig).epsilon_high)
        for pt, lp in at_points.items()
    }
    cells = []
    for name in FIXED_NAMES:
        for sigma in proto.sigmas:
            cell = Cell(name, "fixed rollouts", sigma, [], [], [], [])
            for d in range(proto.fixed_directions):
                for k in range(len(pairs)):
                    cell.plus.append(values[(sigma, d, 1)][name][k])
                    cell.center.append(values[("0",)][name][k])
                    cell.minus.append(values[(sigma, d, -1)][name][k])
                    cell.keys.append((k % len(prompts), k // len(prompts), d))
            cells.append(cell)
    return cells
