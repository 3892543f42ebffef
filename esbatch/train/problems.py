"""What every algorithm trains on: a task's problems rendered into prompts, rewards, held-out scoring."""

from __future__ import annotations

from dataclasses import dataclass, field

from esbatch.backends.base import Generator, SamplingParams
from esbatch.tasks import TASKS, Example, Task, Verdict
from esbatch.tasks.verify import ScoringError, guarded, guarded_score, scoring_warning
from esbatch.train.config import TrainConfig


@dataclass
class ScoreErrors:
    """The training verifier's exceptions (each scored WRONG): how many so far, and the last one."""

    count: int = 0
    last: str = ""

    def add(self, e: BaseException) -> None:
        self.count += 1
        self.last = f"{type(e).__name__}: {str(e)[:200]}"


@dataclass
class Problems:
    """A task's splits rendered into chat prompts once."""

    task: Task
    train: list[Example]
    heldout: list[Example]
    train_prompts: list[str]
    heldout_prompts: list[str]
    errors: ScoreErrors = field(default_factory=ScoreErrors)  # of task.score on training responses


def load_problems(cfg: TrainConfig, generator: Generator) -> Problems:
    """The training and held-out problems of ``cfg.task``, prompted with ``generator``'s chat template."""
    task = TASKS.get(cfg.task.name)(cfg.task.data_path, **cfg.task.params)
    errors = ScoreErrors()
    task.score = guarded(task, "score", Verdict.WRONG, errors.add)  # an exception is a WRONG, counted (check_scoring)
    sp = task.splits(cfg.task.train_size, cfg.task.heldout_size, cfg.task.few_shot, cfg.run.seed)
    demos = sp["demo"]

    def render(exs: list[Example]) -> list[str]:
        return [generator.chat_prompt(task.messages(e, demos, cfg.task.system_prompt)) for e in exs]

    return Problems(task, sp["train"], sp["heldout"], render(sp["train"]), render(sp["heldout"]), errors)


def check_scoring(cfg: TrainConfig, probs: Problems, errors: int, scored: int) -> dict[str, float]:
    """An update's verifier failures as metrics; a ScoringError (the run stops before the update is applied, so a
    resume redoes it) when ``errors`` of the ``scored`` training responses (all ranks) pass reward.max_score_errors."""
    limit = cfg.reward.max_score_errors
    if scored and errors / scored > limit:
        raise ScoringError(
            f"task {cfg.task.name}: its verifier raised on {errors} of the {scored} responses of this update, more "
            f"than reward.max_score_errors = {limit:g} of them; each was scored WRONG, so the rewards are not the "
            f"task's. Last one (this process): {probs.errors.last or 'on another rank'}. Fix the task's score() "
            "(the warnings above show its failures) and resume the run, or raise reward.max_score_errors."
        )
    return {"score/errors": float(errors), "score/error_rate": errors / scored if scored else 0.0}


def reward_of(verdict: Verdict, cfg: TrainConfig) -> float:
    """The paper's reward (App. G.1): correct 1, well-formatted but wrong 0.1, no answer 0 (configurable)."""
    r = cfg.reward
    rewards = {Verdict.CORRECT: r.correct, Verdict.WRONG: r.format, Verdict.MISSING: r.missing}
    try:
        return rewards[verdict]
    except (KeyError, TypeError):  # a task returned something that is not a Verdict: scored as WRONG
        scoring_warning("reward_of", "not a Verdict", f"a task's score returned {verdict!r:.80}; counted as WRONG")
        return r.format


HELDOUT_CORRECT = "heldout/correct"
"""Key of an eval.jsonl record's per-problem verdicts: one character per held-out problem, in order, "1" correct,
"0" not. Not a metric (tracking skips it); it pairs two evaluations problem by problem (esbatch/aggregate/paired.py)."""


def evaluate_heldout(cfg: TrainConfig, generator: Generator, probs: Problems) -> dict[str, float | str]:
    """Greedy accuracy, mean reward and format rate of the current weights on the held-out problems, and the
    per-problem verdicts under ``HELDOUT_CORRECT``."""
    if not probs.heldout:
        return {}
    sampling = SamplingParams(0.0, 1.0, cfg.eval.max_new_tokens or cfg.generation.max_new_tokens)
    gens = generator.generate(probs.heldout_prompts, sampling, seed=0)
    verdicts = [guarded_score(probs.task, g.text, ex) for g, ex in zip(gens, probs.heldout)]
    n = len(verdicts)
    return {
        "heldout/accuracy": sum(v is Verdict.CORRECT for v in verdicts) / n,
        "heldout/reward": sum(reward_of(v, cfg) for v in verdicts) / n,
        "heldout/format_rate": sum(v is not Verdict.MISSING for v in verdicts) / n,
        HELDOUT_CORRECT: "".join("1" if v is Verdict.CORRECT else "0" for v in verdicts),
    }
