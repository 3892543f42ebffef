"""Full-parameter ES training (paper App. G.1), readable top to bottom.

Per update t:  draw N members from (seed, t) -> for each: perturb in place, generate one response per
prompt of the shared mini-batch, score, restore the center -> normalize the N mean rewards ->
theta += alpha/N sum_i z_i eps_i -> the record (seeds, rewards, weights, metrics) the lifecycle appends to
log.jsonl. The rest of a run (folder, MLflow, checkpoints, held-out scores, resume) is
esbatch/train/lifecycle.py. The ES state is theta_0 plus the log: resume loads the newest center
checkpoint and replays the logged updates after it (no generation), so a killed run ends bit-identical;
with checkpoint.center: final or none there is no center file and resume replays every update from theta_0.
With es.restore: inplace the weights also carry every perturb/restore round-off, so replay redoes each
update's perturb/restore cycles (members in logged order, their seeds and signed scales) before the update.
Several replicas (vLLM engines, ranks) each keep their own round-off, as the paper's engines did: the record
logs each replica's members in order, the step logs how far the replicas' weights differ (replicas/*), and
resume replays every replica from theta_0 (the center checkpoint holds replica 0's).

Diagnostic updates (``es.diversity``, paper Section 3.1) also record each member's success share p_i(x) on each
prompt: after the population is scored, a second pass regenerates m - 1 more responses per member and prompt
(own seeds, same perturbations, exact restore) before the update. The reward, the weights and the update are
those of the first pass, so the option never changes the center; replay ignores the extra record field.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from esbatch.backends import BACKENDS, ESBackend, PerturbedMember, SamplingParams
from esbatch.es.config import ESConfig, backend_setup
from esbatch.es.core import Member, direction_weights, draw_population, normalize
from esbatch.es.replay import replay
from esbatch.metrics import diversity_metrics
from esbatch.perturb.inplace import divergence as replica_divergence
from esbatch.perturb.update import UpdateSpec
from esbatch.tasks import Verdict
from esbatch.train.config import TrainConfig
from esbatch.train.flops import es_flops
from esbatch.train.lifecycle import Trainer
from esbatch.train.problems import Problems, check_scoring, evaluate_heldout, load_problems, reward_of
from esbatch.train.ranks import Ranks
from esbatch.train.rundir import RunDir
from esbatch.train.schedule import batch_indices, schedule_start

SINGLE = Ranks()  # one process: no torch.distributed


def es_step(cfg: TrainConfig, backend: ESBackend, probs: Problems, t: int, ranks: Ranks = SINGLE) -> dict[str, Any]:
    """Evaluate the population of update t and apply the update; returns the log record.

    With several ranks each evaluates members rank, rank + W, ... (es.dispatch: static) or the members it takes
    from a shared counter (dynamic); the rewards are all-gathered and every rank applies the same update
    (esbatch/train/ranks.py).
    """
    es, gen = cfg.section(ESConfig), cfg.generation
    sampling = SamplingParams(gen.temperature, gen.top_p, gen.max_new_tokens)
    n = len(probs.train)
    epoch, idx = batch_indices(cfg.run.seed, t, n, es.batch_size, schedule_start(n, cfg.run.data_before))
    prompts = [probs.train_prompts[i] for i in idx]
    members = draw_population(cfg.run.seed, t, es.population_size, es.estimator, es.generation_seeds)
    scaled = [PerturbedMember(m.seed, m.sign * es.sigma, m.gen_seed) for m in members]
    if es.dispatch == "dynamic" and ranks.world > 1:  # the ranks take members from a shared counter
        pop = backend.evaluate_population(scaled, prompts, sampling, claim=ranks.claimer(len(members), f"es/{t}"))
        index = list(range(len(members)))  # the claim hands out indices into members
    else:
        index = ranks.mine(len(members))
        pop = backend.evaluate_population([scaled[i] for i in index], prompts, sampling)
    mine = [index[k] for k in pop.members]
    # replica (this rank's engines follow the ranks before it) and place in its order of each member evaluated here
    replicas = pop.replicas or [pop.members]  # a backend that does not say: one replica, in member order
    first = ranks.rank * backend.replicas
    where = {index[k]: (first + e, pos) for e, ks in enumerate(replicas) for pos, k in enumerate(ks)}
    local, verdicts = {}, {}
    for i, gens in zip(mine, pop.generations):
        before = probs.errors.count
        verdicts[i] = [probs.task.score(g.text, probs.train[j]) for g, j in zip(gens, idx)]
        scores = [reward_of(v, cfg) for v in verdicts[i]]
        local[i] = (sum(scores) / len(scores), sum(g.n_tokens for g in gens), probs.errors.count - before, *where[i])
    t0 = time.perf_counter()
    gathered = ranks.gather(len(members), local, width=5)
    t_wait = time.perf_counter() - t0  # this rank waiting for the others to finish their members
    rewards = [row[0] for row in gathered]
    n_tokens = int(sum(row[1] for row in gathered))
    scoring = check_scoring(cfg, probs, int(sum(row[2] for row in gathered)), len(members) * len(idx))  # every rank
    z = normalize(rewards, es.normalization, es.eps_num)
    diversity = None
    if es.diversity.every and t % es.diversity.every == 0:  # before the update: p_i(x) of this population
        diversity = population_success(cfg, backend, probs, members, idx, verdicts, mine, ranks)
    seeds, weights = direction_weights(members, z)
    spec = UpdateSpec(seeds, weights, es.alpha, es.population_size)
    t0 = time.perf_counter()
    stats = backend.update(spec)
    t_upd = time.perf_counter() - t0
    n_replicas, inplace = ranks.world * backend.replicas, es.restore == "inplace"
    apart = {}  # in place, each replica keeps its own round-off: how far apart they are now
    if inplace and n_replicas > 1:
        apart = replica_divergence(ranks.gather_tensors(backend.replica_samples()))
    metrics = {
        **_reward_metrics(rewards),
        "update/l2": stats.update_l2,
        "update/changed_fraction": stats.changed_fraction,
        "update/rel_distance_from_theta0": stats.rel_distance,
        "time/generation_s": pop.generation_s,
        "time/perturb_restore_s": pop.perturb_restore_s,
        "time/engine_idle_s": pop.idle_s,
        "time/update_s": t_upd,
        "time/total_s": pop.generation_s + pop.perturb_restore_s + t_upd,
        **({"time/rank_wait_s": t_wait} if ranks.world > 1 else {}),
        "tokens/generated": n_tokens,
        "tokens/per_s": n_tokens / pop.generation_s / ranks.world if pop.generation_s else 0.0,  # per rank
        "epoch": epoch,
        **scoring,
        **_flops(backend, prompts, n_tokens, es.population_size),
        **apart,
    }
    record = {
        "t": t,
        "batch": idx,
        "seeds": [m.seed for m in members],
        "signs": [m.sign for m in members],
        "gen_seeds": [m.gen_seed for m in members],
        "sigma": es.sigma,  # with signs: each member's scale, which replay needs under es.restore: inplace
        "rewards": rewards,
        "z": z.tolist(),
        **spec.to_dict(),
        "metrics": metrics,
    }
    if inplace:  # each replica's members in the order it perturbed and restored them (replay redoes them)
        record["replicas"] = replica_orders(gathered, n_replicas)
    if diversity is not None:
        p, first, extra_s, extra_tokens = diversity
        m = es.diversity.samples
        record["diversity"] = {"p": p, "samples": m, "first": first}
        metrics.update({f"diversity/{k}": v for k, v in diversity_metrics(p, z, first, m).items()})
        metrics.update({"time/diversity_s": extra_s, "tokens/diversity": extra_tokens})
    return record


def diversity_seed(gen_seed: int) -> int:
    """The sampling seed of a member's extra diversity responses: a pure function of its generation seed, apart
    from the generation seeds draw_population hands out (those come from a numpy stream)."""
    digest = hashlib.blake2b(f"es-diversity/{gen_seed}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % 2**31


def population_success(
    cfg: TrainConfig,
    backend: ESBackend,
    probs: Problems,
    members: list[Member],
    idx: list[int],
    verdicts: dict[int, list[Verdict]],
    mine: list[int],
    ranks: Ranks = SINGLE,
) -> tuple[list[list[float]], list[list[float]], float, int]:
    """p_i(x): the share of m = es.diversity.samples responses of member i to prompt x that the verifier scores
    CORRECT, as [members][prompts] in record order; the 0/1 verdict of the first of them (the reward's) in the same
    shape (leave-one-out p, esbatch/metrics.py); the seconds and tokens the extra responses took.

    The first of the m is the response the reward was computed from (``verdicts``: those of ``mine``, the
    members this rank evaluated); the other m - 1 come from a second pass over the same members with
    sampling.n = m - 1 and diversity_seed.
    """
    es, gen = cfg.section(ESConfig), cfg.generation
    m = es.diversity.samples
    hits = {i: [float(v is Verdict.CORRECT) for v in verdicts[i]] for i in mine}
    tokens = dict.fromkeys(mine, 0)
    t0 = time.perf_counter()
    if m > 1:
        extra = SamplingParams(gen.temperature, gen.top_p, gen.max_new_tokens, n=m - 1)
        pop = backend.evaluate_population(
            [
                PerturbedMember(members[i].seed, members[i].sign * es.sigma, diversity_seed(members[i].gen_seed))
                for i in mine
            ],
            [probs.train_prompts[j] for j in idx],
            extra,
        )
        for i, gens in zip([mine[k] for k in pop.members], pop.generations):
            for k, g in enumerate(gens):  # prompt-major: prompt k // (m - 1)
                x = k // (m - 1)
                hits[i][x] += float(probs.task.score(g.text, probs.train[idx[x]]) is Verdict.CORRECT)
            tokens[i] = sum(g.n_tokens for g in gens)
    b = len(idx)
    local = {
        i: [*(h / m for h in hits[i]), *(float(v is Verdict.CORRECT) for v in verdicts[i]), tokens[i]] for i in mine
    }
    rows = ranks.gather(len(members), local, width=2 * b + 1)
    p, first = [row[:b] for row in rows], [row[b : 2 * b] for row in rows]
    return p, first, time.perf_counter() - t0, int(sum(row[-1] for row in rows))


def replica_orders(rows: list[list[float]], n_replicas: int) -> list[list[int]]:
    """From each member's gathered row (..., replica, place in its order): each replica's members in order."""
    orders: list[list[tuple[int, int]]] = [[] for _ in range(n_replicas)]
    for i, row in enumerate(rows):
        orders[int(row[-2])].append((int(row[-1]), i))
    return [[i for _, i in sorted(o)] for o in orders]


def _reward_metrics(rewards: list[float]) -> dict[str, float]:
    n, mean = len(rewards), sum(rewards) / len(rewards)
    return {
        "reward/mean": mean,
        "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "reward/min": min(rewards),
        "reward/max": max(rewards),
    }


def _flops(backend: ESBackend, prompts: list[str], gen_tokens: int, n: int) -> dict[str, float]:
    """App. G.2 accounting of this update with its real token counts (esbatch/train/flops.py)."""
    params, counts = backend.num_parameters(), backend.count_tokens(prompts)
    if not params or not counts:
        return {}
    prompt_len, gen_len = sum(counts) / len(counts), gen_tokens / (n * len(prompts))
    return {"update/flops": es_flops(params, n, len(prompts), prompt_len, gen_len)["total"]}


class ESTrainer(Trainer):
    label = "ES"

    def __init__(self, cfg: TrainConfig, rd: RunDir, ranks: Ranks) -> None:
        self.cfg, self.rd, self.ranks = cfg, rd, ranks

    def setup(self) -> int:
        self.backend = BACKENDS.get(self.cfg.backend.name).for_es(backend_setup(self.cfg))
        self.probs = load_problems(self.cfg, self.backend)
        return self.cfg.total_updates(len(self.probs.train))

    @property
    def n_train(self) -> int:
        return len(self.probs.train)

    @property
    def replicas_differ(self) -> bool:
        """es.restore: inplace over several replicas (engines x ranks): each has its own center."""
        return self.cfg.section(ESConfig).restore == "inplace" and self.ranks.world * self.backend.replicas > 1

    def restore(self, records: list[dict[str, Any]]) -> int:
        """The center checkpoint plus the updates after it; replicas that differ all replay from theta_0 (the
        checkpoint holds replica 0 only), each its own cycles."""
        if self.replicas_differ:
            self.saved_at = self.rd.center_t() or 0
            replay(self.backend, records, self.ranks.rank * self.backend.replicas)
            return len(records)
        ckpt = self.rd.load_center()
        self.saved_at = 0
        if ckpt is not None:
            state, self.saved_at = ckpt
            self.backend.load_center(state)
        replay(self.backend, records[self.saved_at :])
        return len(records)

    def step(self, t: int) -> dict[str, Any]:
        return es_step(self.cfg, self.backend, self.probs, t, self.ranks)

    def save(self, t: int, final: bool) -> None:
        """checkpoint.center: every writes center.safetensors, final exports the last model in the compute dtype
        (final_model/), none writes nothing: the log alone rebuilds the center (restore, esbatch/eval/center.py)."""
        if not self.ranks.lead:
            return
        mode = self.cfg.checkpoint.center
        if mode == "every":
            self.rd.save_center(self.backend.center_state_dict(), t)
        elif mode == "final" and final:
            self.rd.write_export(self.export, t)

    def evaluate(self) -> dict[str, float | str]:
        return evaluate_heldout(self.cfg, self.backend, self.probs)

    def generator(self) -> ESBackend:
        return self.backend  # between updates the backend holds the center, unperturbed

    def center_state(self) -> dict[str, Any]:
        return self.backend.center_state_dict()

    def checksum(self) -> float | None:
        return None if self.replicas_differ else self.backend.checksum()  # differing replicas: es_step measures

    def postfix(self, metrics: dict[str, Any]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}", "s/upd": f"{metrics['time/total_s']:.1f}"}

    def export(self, path: Path) -> None:
        self.backend.save_pretrained(path)

    def summary(self) -> dict[str, Any]:
        return {"memory": self.backend.memory_report()}

    def tags(self) -> dict[str, str]:
        return self.probs.task.tracking_tags()

    def close(self) -> None:
        if hasattr(self, "backend"):
            self.backend.close()
