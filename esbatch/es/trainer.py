"""Full-parameter ES training (paper App. G.1), readable top to bottom.

Per update t:  draw N members from (seed, t) -> for each: perturb in place, generate one response per
prompt of the shared mini-batch, score, restore the center -> normalize the N mean rewards ->
theta += alpha/N sum_i z_i eps_i -> append the update to log.jsonl -> log metrics.
"""

from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esbatch.backends import BACKENDS, GenerationBackend, SamplingParams
from esbatch.config import TrainConfig, flatten
from esbatch.es.checkpoint import RunDir
from esbatch.es.core import direction_weights, draw_population, normalize
from esbatch.es.distributed import Ranks, init_ranks
from esbatch.es.schedule import batch_indices
from esbatch.tasks import TASKS, Example, Task, Verdict

SINGLE = Ranks()  # one process: no torch.distributed


@dataclass
class Problems:
    """A task's splits rendered into chat prompts once."""

    task: Task
    train: list[Example]
    heldout: list[Example]
    train_prompts: list[str]
    heldout_prompts: list[str]


def load_problems(cfg: TrainConfig, backend: GenerationBackend) -> Problems:
    task = TASKS.get(cfg.task.name)(cfg.task.data_path, **cfg.task.params)
    sp = task.splits(cfg.task.train_size, cfg.task.heldout_size, cfg.task.few_shot, cfg.run.seed)
    demos = sp["demo"]

    def render(exs: list[Example]) -> list[str]:
        return [backend.chat_prompt(task.messages(e, demos, cfg.task.system_prompt)) for e in exs]

    return Problems(task, sp["train"], sp["heldout"], render(sp["train"]), render(sp["heldout"]))


def reward_of(verdict: Verdict, cfg: TrainConfig) -> float:
    r = cfg.reward
    return {Verdict.CORRECT: r.correct, Verdict.WRONG: r.format, Verdict.MISSING: r.missing}[verdict]


def evaluate_heldout(cfg: TrainConfig, backend: GenerationBackend, probs: Problems) -> dict[str, float]:
    """Greedy accuracy and mean reward of the current center on the held-out problems."""
    if not probs.heldout:
        return {}
    sampling = SamplingParams(0.0, 1.0, cfg.eval.max_new_tokens or cfg.generation.max_new_tokens)
    gens = backend.generate(probs.heldout_prompts, sampling, seed=0)
    verdicts = [probs.task.score(g.text, ex) for g, ex in zip(gens, probs.heldout)]
    n = len(verdicts)
    return {
        "heldout/accuracy": sum(v is Verdict.CORRECT for v in verdicts) / n,
        "heldout/reward": sum(reward_of(v, cfg) for v in verdicts) / n,
        "heldout/format_rate": sum(v is not Verdict.MISSING for v in verdicts) / n,
    }


def es_step(
    cfg: TrainConfig, backend: GenerationBackend, probs: Problems, t: int, ranks: Ranks = SINGLE
) -> dict[str, Any]:
    """Evaluate the population of update t and apply the update; returns the log record.

    With several ranks each evaluates members rank, rank + W, ...; the rewards are all-gathered and every
    rank applies the same update (esbatch/es/distributed.py).
    """
    es, gen = cfg.es, cfg.generation
    sampling = SamplingParams(gen.temperature, gen.top_p, gen.max_new_tokens)
    epoch, idx = batch_indices(cfg.run.seed, t, len(probs.train), es.batch_size)
    prompts = [probs.train_prompts[i] for i in idx]
    members = draw_population(cfg.run.seed, t, es.population_size, es.estimator, es.generation_seeds)
    mine = ranks.mine(len(members))
    pop = backend.evaluate_population(
        [(members[i].seed, members[i].sign * es.sigma, members[i].gen_seed) for i in mine], prompts, sampling
    )
    local = {}
    for i, gens in zip(mine, pop.generations):
        scores = [reward_of(probs.task.score(g.text, probs.train[j]), cfg) for g, j in zip(gens, idx)]
        local[i] = (sum(scores) / len(scores), sum(g.n_tokens for g in gens))
    gathered = ranks.gather(len(members), local, width=2)
    rewards = [r for r, _ in gathered]
    n_tokens = int(sum(k for _, k in gathered))
    t_gen, t_move = pop.generation_s, pop.perturb_restore_s
    z = normalize(rewards, es.normalization, es.eps_num)
    seeds, weights = direction_weights(members, z)
    t4 = time.perf_counter()
    stats = backend.update(seeds, weights, es.alpha, es.population_size)
    t_upd = time.perf_counter() - t4
    ranks.check_in_sync(backend.checksum() if ranks.world > 1 else None, t)
    n = len(rewards)
    mean = sum(rewards) / n
    flops = _update_flops(backend, prompts, n_tokens, es.population_size)
    metrics = {
        "reward/mean": mean,
        "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "reward/min": min(rewards),
        "reward/max": max(rewards),
        "update/l2": stats.update_l2,
        "update/changed_fraction": stats.changed_fraction,
        "update/rel_distance_from_theta0": stats.rel_distance,
        "time/generation_s": t_gen,
        "time/perturb_restore_s": t_move,
        "time/update_s": t_upd,
        "time/total_s": t_gen + t_move + t_upd,
        "tokens/generated": n_tokens,
        "tokens/per_s": n_tokens / t_gen / ranks.world if t_gen else 0.0,  # per rank (rank 0's time)
        "epoch": epoch,
        **({"flops/update": flops} if flops is not None else {}),
    }
    return {
        "t": t,
        "alpha": es.alpha,
        "n": es.population_size,
        "batch": idx,
        "seeds": [m.seed for m in members],
        "signs": [m.sign for m in members],
        "gen_seeds": [m.gen_seed for m in members],
        "rewards": rewards,
        "z": z.tolist(),
        "update_seeds": seeds,
        "update_weights": weights,
        "metrics": metrics,
    }


def replay(backend: GenerationBackend, records: list[dict[str, Any]]) -> None:
    """Re-apply logged updates to the center: same seeds, same weights, same arithmetic -> same bits."""
    for r in records:
        backend.update(r["update_seeds"], r["update_weights"], r["alpha"], r["n"])


# Set by `esbatch train`'s SIGTERM handler; the loop stops between updates (an exception raised inside an
# MLflow sqlite call could leave its database locked, and the run could then not be marked KILLED).
STOP = threading.Event()


def _update_flops(backend: GenerationBackend, prompts: list[str], gen_tokens: int, n: int) -> float | None:
    """App. G.2 accounting of this update with its real token counts (esbatch/grpo/flops.py)."""
    from esbatch.grpo.flops import es_flops

    params, counts = backend.num_parameters(), backend.count_tokens(prompts)
    if not params or not counts:
        return None
    return es_flops(params, n, len(prompts), sum(counts) / len(counts), gen_tokens / (n * len(prompts)))["total"]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    tracker: Any | None = None,
    run_name: str | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run (or resume) ES training into ``run_dir``; returns a summary dict.

    ``run_name`` and ``tags`` go to the MLflow run (a sweep passes its label, parent run and SLURM ids).
    """
    import torch
    from tqdm.auto import tqdm

    from esbatch.tracking import MLflowTracker, NullTracker, default_tracking_uri, parent_tag, run_tags

    rd = RunDir(run_dir)
    if rd.exists() and not resume:
        raise FileExistsError(
            f"{rd.path} already holds a run. Resume it with `esbatch train --resume {rd.path}`, "
            f"or pick another name with --set run.name=..."
        )
    ranks = init_ranks()  # a world of one unless started by torchrun or a multi-task SLURM job
    lead = ranks.lead  # rank 0 writes the run folder and MLflow; every rank computes the same center
    if lead:
        rd.path.mkdir(parents=True, exist_ok=True)
        if not resume:
            rd.config.write_text(cfg.to_yaml())
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)

    t_start = time.perf_counter()
    uri = cfg.tracking.uri or default_tracking_uri(cfg.run.output_dir)
    if not lead:
        tracker = NullTracker()  # rank 0 holds the MLflow run
    elif tracker is None:
        tracker = MLflowTracker(uri, cfg.tracking.experiment, Path(cfg.run.output_dir) / "mlartifacts")
    backend = BACKENDS.get(cfg.backend.name).from_config(cfg)
    probs = load_problems(cfg, backend)
    total = cfg.total_updates(len(probs.train))
    ranks.barrier()  # the lead has written the folder; everyone reads the same records below

    # ---- resume: newest center checkpoint + replay of the logged updates after it
    records = rd.updates() if resume else []
    ckpt = rd.load_center() if resume else None
    t_ckpt = 0
    if ckpt is not None:
        state, t_ckpt = ckpt
        backend.load_center(state)
    replay(backend, records[t_ckpt:])
    start = len(records)
    ranks.check_in_sync(backend.checksum() if ranks.world > 1 else None, start - 1)

    # ---- tracking
    meta = rd.read_meta()
    run_id = tracker.start(
        run_name or cfg.run.name,
        flatten(cfg.to_dict()),
        {
            **run_tags(),
            "algorithm": "es",
            "world_size": str(ranks.world),
            **(tags or {}),
            **parent_tag(cfg.tracking.parent_run_id),
        },
        run_id=meta.get("mlflow_run_id") if resume else None,
    )
    if lead:
        rd.write_meta(mlflow_run_id=run_id, tracking_uri=uri, total_updates=total, status="running")
        if not resume:
            tracker.log_artifact(rd.config)
    last = tracker.last_step("reward/mean") if resume else -1
    for r in records[max(last, 0) :]:  # updates finished but not yet logged (step = t + 1) when the run died
        tracker.log_metrics(r["metrics"], step=r["t"] + 1)

    done_evals = {e["t"] for e in rd.evals()}

    def maybe_eval(t: int, force: bool = False) -> dict[str, float]:
        due = force or (cfg.eval.every and t % cfg.eval.every == 0)
        if not lead or not due or t in done_evals or not probs.heldout:
            return {}
        scores = evaluate_heldout(cfg, backend, probs)
        rd.append_eval({"t": t, **scores})
        tracker.log_metrics(scores, step=t)
        done_evals.add(t)
        return scores

    maybe_eval(0, force=True)
    last_eval = {}
    bar = tqdm(total=total, initial=start, desc="ES", unit="upd", disable=not (progress and lead), dynamic_ncols=True)
    status = "FAILED"
    try:
        for t in range(start, total):
            if STOP.is_set():  # SIGTERM asked us to stop: do it here, never inside an MLflow write
                raise KeyboardInterrupt
            rec = es_step(cfg, backend, probs, t, ranks)
            m = rec["metrics"]
            if lead:
                rd.append_update(rec)  # the durable record: written before anything else
                tracker.log_metrics({**m, "memory/peak_rss_mb": peak_rss_mb()}, step=t + 1)
                if (t + 1) % cfg.checkpoint.every == 0 or t + 1 == total:
                    rd.save_center(backend.center_state_dict(), t + 1)
                    t_ckpt = t + 1
            last_eval = maybe_eval(t + 1, force=(t + 1 == total)) or last_eval
            post = {"reward": f"{m['reward/mean']:.3f}", "s/upd": f"{m['time/total_s']:.1f}"}
            if last_eval:
                post["heldout"] = f"{last_eval['heldout/accuracy']:.3f}"
            bar.set_postfix(post)
            bar.update(1)
        if lead and t_ckpt != total:  # died after the last update was logged, before its checkpoint
            rd.save_center(backend.center_state_dict(), total)
        maybe_eval(total, force=True)  # no-op unless the final evaluation was lost the same way
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, or submitit's exit after a requeue
        status = "KILLED"
        raise
    finally:
        bar.close()
        if status != "FINISHED":
            if lead:
                rd.write_meta(status=status.lower())
            tracker.end(status)
            backend.close()
        ranks.close(ok=status == "FINISHED")
    if not lead:
        backend.close()
        return {"run_dir": str(rd.path), "updates": total, "rank": ranks.rank, "wall_s": time.perf_counter() - t_start}

    tracker.log_artifact(rd.log)
    if rd.eval_log.exists():
        tracker.log_artifact(rd.eval_log)
    if cfg.tracking.log_model:
        final = rd.path / "final_model"
        backend.save_pretrained(final)
        tracker.log_artifacts(final, "final_model")
    memory = backend.memory_report()
    backend.close()
    evals = sorted(rd.evals(), key=lambda e: e["t"])
    rd.write_meta(status="finished")
    tracker.end("FINISHED")
    return {
        "run_dir": str(rd.path),
        "updates": total,
        "tracking_uri": uri,
        "mlflow_run_id": run_id,
        "experiment_id": tracker.experiment_id,
        "wall_s": time.perf_counter() - t_start,
        "heldout_first": evals[0] if evals else None,
        "heldout_last": evals[-1] if evals else None,
        "memory": memory,
        "peak_rss_mb": peak_rss_mb(),
    }
