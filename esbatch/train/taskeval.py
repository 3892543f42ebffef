"""Sampled evaluation on other tasks, shared by `esbatch eval` and in-training evaluation (paper Figure 2(a-b)).

The pieces both use: few-shot demonstrations outside the evaluated problems, parallel scoring, and
per-task Pass@K / Maj@K / entropy from scored rows. ``TaskEvals`` is the in-training part: at every
evaluation of a run (``eval.every``, start and end) the current weights answer ``eval.samples`` sampled
responses per problem of each ``eval.tasks`` entry, and the scores come back as ``eval/<label>/...``
metrics. The generation seed depends only on (run seed, task label, update), so a resumed run logs the
same numbers, and the RNG states are put back afterwards, so training never sees that an evaluation ran.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from esbatch.metrics import mean_metrics, problem_metrics
from esbatch.tasks import TASKS
from esbatch.tasks.verify import guarded_answer_key, guarded_score, guarded_score_many
from esbatch.train.config import TrainConfig

PROBLEM_SEED = 0  # which problems and demonstrations: those `esbatch eval` scores with sampling.seed 0


def score_responses(task: Any, texts: list[str], exs: list[Any], workers: int) -> tuple[list[str], list[str | None]]:
    """Verdicts and answer keys, scored in parallel threads (math-verify and the code sandbox block). A task
    that raises costs only that response (WRONG, key None) and a warning line, not the eval."""
    if hasattr(task, "score_many"):
        verdicts = [str(v) for v in guarded_score_many(task, texts, exs)]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            verdicts = [str(v) for v in pool.map(lambda a: guarded_score(task, *a), zip(texts, exs))]

    with ThreadPoolExecutor(max_workers=workers) as pool:
        keys = list(pool.map(lambda a: guarded_answer_key(task, *a), zip(texts, exs)))
    return verdicts, keys


def few_shot_demos(task: Any, k: int, exs: list[Any], seed: int) -> list[Any]:
    """k solved demonstrations from the task's demo pool, never one of the evaluated questions."""
    if not k:
        return []
    asked = {e.question for e in exs}
    pool = task.splits(0, 0, k + len(asked), 10_007 + seed)["demo"]
    demos = [d for d in pool if d.question not in asked][:k]
    if len(demos) < k:
        raise ValueError(f"{type(task).__name__}: only {len(demos)} demonstrations outside the evaluated problems")
    return demos


def task_metrics(rows: list[dict[str, Any]], ks: list[int]) -> dict[str, float]:
    """Mean over problems of Pass@1, Pass@K, Maj@K, entropy, format rate (and greedy, F1 when present)."""
    per = []
    for r in rows:
        correct = [smp["verdict"] == "correct" for smp in r["samples"]]
        m = problem_metrics(correct, [smp["key"] for smp in r["samples"]], ks, [smp["entropy"] for smp in r["samples"]])
        if "greedy" in r:
            m["greedy"] = float(r["greedy"]["verdict"] == "correct")
        m["format"] = sum(smp["verdict"] != "missing" for smp in r["samples"]) / len(r["samples"])
        if "f1" in r["samples"][0]:  # token F1 (HotpotQA), mean over responses
            m["f1"] = sum(smp["f1"] for smp in r["samples"]) / len(r["samples"])
        per.append(m)
    out = mean_metrics(per)
    out["problems"] = len(rows)
    return out


def metric_name(label: str, col: str) -> str:
    """MLflow allows no '@': (GSM8K, pass@16) -> GSM8K/pass_at_16; other odd characters become '_'."""
    return re.sub(r"[^\w\-. :/]", "_", f"{label}/{col.replace('@', '_at_')}")


def eval_seed(seed: int, label: str, t: int) -> int:
    """The generation seed of one task's evaluation after update ``t``: fixed, whatever ran before."""
    return int.from_bytes(hashlib.blake2b(f"intrain/{seed}/{label}/{t}".encode(), digest_size=4).digest(), "little")


@contextmanager
def rng_untouched() -> Any:
    """Run a block and put every RNG it may draw from back as it was (torch CPU and CUDA, numpy, random)."""
    import torch

    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class TaskEvals:
    """The ``eval.tasks`` of a run config, loaded once (problems and demonstrations) and scored on demand."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg, self.ev = cfg, cfg.eval
        self._loaded: list[tuple[Any, Any, list[Any], list[Any]]] | None = None
        self._prompts: dict[int, list[str]] = {}

    def __bool__(self) -> bool:
        return bool(self.ev.tasks)

    def _load(self) -> list[tuple[Any, Any, list[Any], list[Any]]]:
        if self._loaded is None:
            self._loaded = []
            for et in self.ev.tasks:
                task = TASKS.get(et.name)(et.data_path, **et.params)
                exs = task.eval_examples(et.limit, PROBLEM_SEED)
                exs = exs[: et.limit] if et.limit else exs
                self._loaded.append((et, task, exs, few_shot_demos(task, et.few_shot, exs, PROBLEM_SEED)))
        return self._loaded

    def __call__(self, generator: Any, t: int) -> dict[str, float]:
        """Every task's metrics for the weights ``generator`` holds after update ``t`` (eval/<label>/...)."""
        from esbatch.backends.base import SamplingParams

        ev, out = self.ev, {}
        workers = min(8, os.cpu_count() or 1)
        for j, (et, task, exs, demos) in enumerate(self._load()):
            label = et.label or et.name
            if j not in self._prompts:  # rendered with the generator's chat template, once
                self._prompts[j] = [generator.chat_prompt(task.messages(ex, demos, None)) for ex in exs]
            max_new = et.max_new_tokens or ev.max_new_tokens or self.cfg.generation.max_new_tokens
            sampling = SamplingParams(ev.temperature, ev.top_p, max_new, n=ev.samples, entropy=True)
            t0 = time.perf_counter()
            with rng_untouched():
                gens = generator.generate(self._prompts[j], sampling, eval_seed(self.cfg.run.seed, label, t))
            gen_s = time.perf_counter() - t0
            owners = [ex for ex in exs for _ in range(ev.samples)]
            verdicts, keys = score_responses(task, [g.text for g in gens], owners, workers)
            smp = [{"verdict": v, "key": k, "entropy": g.entropy} for g, v, k in zip(gens, verdicts, keys)]
            rows = [{"samples": smp[i * ev.samples : (i + 1) * ev.samples]} for i in range(len(exs))]
            m = task_metrics(rows, list(ev.ks)) if rows else {}
            for col, v in m.items():
                if col != "problems":
                    out[f"eval/{metric_name(label, col)}"] = v
            out[f"eval/{metric_name(label, 'time_s')}"] = time.perf_counter() - t0
            out[f"eval/{metric_name(label, 'generation_s')}"] = gen_s
        return out
