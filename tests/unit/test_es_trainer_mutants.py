"""Guards the mutants of esbatch/es/trainer.py and esbatch/es/__init__.py that the other ES tests left alive
(mutation testing, issue 12 item 7): every field and metric of an es_step record against values worked out by
hand from a scripted backend double (one process, two static ranks, two dynamic ranks), the extra diversity
responses counted per prompt and sample, diversity_seed's pinned values, replay's perturb/restore cycles, the
ESTrainer methods the lifecycle calls, the ES config check, and the exact texts of the errors.

No model is loaded: the backend double answers each member with a verdict fixed by hand per prompt."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import esbatch.es.trainer as trainer_mod
from esbatch.backends import SamplingParams
from esbatch.backends.base import ESBackend, Generation, PopulationOutput, UpdateStats
from esbatch.config import config_from_dict
from esbatch.es import ES
from esbatch.es.config import ESConfig, backend_setup
from esbatch.es.core import draw_population
from esbatch.es.replay import member_cycles, replay
from esbatch.es.trainer import ESTrainer, diversity_seed, es_step, replica_orders
from esbatch.metrics import diversity_metrics
from esbatch.perturb.update import UpdateSpec
from esbatch.train.problems import load_problems
from esbatch.train.ranks import Ranks
from esbatch.train.rundir import RunFolderError
from esbatch.train.schedule import batch_indices

SEED, SIGMA, ALPHA, N, B = 11, 0.05, 0.02, 4, 3
REWARD = {"correct": 1.0, "format": 0.25, "missing": -0.5}
R = {"C": 1.0, "W": 0.25, "M": -0.5}
# member i's verdict on prompt x of the batch (reward pass): C correct, W a wrong digit, M no digit
PATTERN = ["CCC", "WMC", "MMW", "CWM"]
REWARDS = [1.0, 0.25, -0.25, 0.25]  # the mean of R over each row, by hand
# member i's verdicts on prompt x of its m - 1 = 2 extra (diversity) responses
EXTRA = [["CM", "WW", "MC"], ["CC", "MM", "CW"], ["WM", "MC", "CC"], ["MM", "CC", "WC"]]
GEN_S, PR_S, IDLE_S, PARAMS = 2.0, 0.5, 0.25, 1000
STATS = UpdateStats(0.125, 0.375, 0.0625)


def _cfg(temperature=0.75, es_updates=4, **es):
    return config_from_dict(
        {
            "run": {"seed": SEED},
            "model": {"name": "nobody/no-model"},  # a hub id: never loaded by the double
            "task": {"name": "toy:DigitTask", "heldout_size": 0},
            "generation": {"temperature": temperature, "top_p": 0.5, "max_new_tokens": 6},
            "reward": REWARD,
            "es": {"population_size": N, "sigma": SIGMA, "alpha": ALPHA, "batch_size": B, "updates": es_updates, **es},
        }
    )


def _z(rewards, eps_num=1e-8):
    """z-scores as App. G.1 writes them: population std, + eps_num (es.eps_num, default 1e-8)."""
    r = [float(x) for x in rewards]
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
    return [(x - mean) / (std + eps_num) for x in r]


class Scripted(ESBackend):
    """An ES backend double: member i (found by its direction seed and scale) answers prompt x with PATTERN[i][x]
    when asked with its own generation seed (the reward pass; n_tokens 1 + i + 2x), and with the first n of
    EXTRA[i][x] when asked with diversity_seed of it (the diversity pass; n_tokens 10 + sample).
    Records every evaluate_population, perturb, restore and update call; fixed timings and parameter count."""

    def __init__(self, members, *, gen_s=GEN_S, params=PARAMS, counts=True, restore_mode="exact"):
        self.index = {(m.seed, m.sign * SIGMA): i for i, m in enumerate(members)}
        self.gen_seeds = [m.gen_seed for m in members]
        self.gen_s, self.params, self.counts, self.restore_mode = gen_s, params, counts, restore_mode
        self.calls, self.log, self.specs, self.gold = [], [], [], {}

    def learn(self, probs):
        self.gold = {p: ex.answer for p, ex in zip(probs.train_prompts, probs.train)}

    def _text(self, letter, prompt):
        gold = self.gold[prompt]
        return {"C": gold, "W": str((int(gold) + 1) % 10), "M": "no digit"}[letter]

    def evaluate_population(self, members, prompts, sampling, claim=None):
        self.calls.append({"members": list(members), "prompts": list(prompts), "sampling": sampling, "claim": claim})
        order = list(range(len(members))) if claim is None else sorted(iter(claim, None))
        gens = []
        for k in order:
            seed, scale, gen_seed = members[k]
            i = self.index[(seed, scale)]
            if gen_seed == self.gen_seeds[i]:
                assert sampling.n == 1
                gens.append([Generation(self._text(PATTERN[i][x], p), 1 + i + 2 * x) for x, p in enumerate(prompts)])
            else:
                assert gen_seed == diversity_seed(self.gen_seeds[i]) and sampling.n in (1, 2)
                gens.append(
                    [
                        Generation(self._text(EXTRA[i][x][s], p), 10 + s)
                        for x, p in enumerate(prompts)
                        for s in range(sampling.n)
                    ]
                )
        return PopulationOutput(gens, generation_s=self.gen_s, perturb_restore_s=PR_S, idle_s=IDLE_S, members=order)

    def num_parameters(self):
        return self.params

    def count_tokens(self, texts):
        return [len(t) for t in texts] if self.counts else None

    @classmethod
    def for_es(cls, cfg):
        raise NotImplementedError

    def chat_prompt(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts, sampling, seed):
        raise AssertionError("es_step generates through evaluate_population")

    def perturb(self, seed, scale):
        self.log.append(("perturb", seed, scale))

    def restore(self):
        self.log.append(("restore",))

    def update(self, spec):
        self.specs.append(spec)
        self.log.append(("update", list(spec.seeds), list(spec.weights), spec.alpha, spec.n))
        return STATS

    def center_state_dict(self):
        return {"w": "center"}

    def load_center(self, state):
        self.log.append(("load_center", state))

    def save_pretrained(self, path):
        self.log.append(("save_pretrained", path))

    def checksum(self):
        return 12.5

    def memory_report(self):
        return {"master": 3.0}


class TwoRanks(Ranks):
    """Rank `rank` of two without torch.distributed: gather fills the other rank's members from `others`;
    claimer hands out `claims` in turn (the members a shared counter gave this rank)."""

    def __init__(self, rank, others, claims=()):
        super().__init__(rank, 2)
        self.others, self.claims, self.gathers, self.claimers = others, list(claims), [], []

    def claimer(self, n, key):
        self.claimers.append((n, key))
        it = iter(self.claims)
        return lambda: next(it, None)

    def gather_tensors(self, local):
        return [torch.tensor(x, dtype=torch.float64) for x in self.others_samples] + list(local)

    def gather(self, n, local, width):
        self.gathers.append((n, {i: list(v) for i, v in local.items()}, width))
        assert not set(local) & set(self.others[width])
        rows = {**{i: list(v) for i, v in local.items()}, **self.others[width]}
        return [rows[i] for i in range(n)]


def _setup(t, **es):
    cfg = _cfg(**es)
    members = draw_population(SEED, t, N, "one_point", "independent")
    b = Scripted(members)
    probs = load_problems(cfg, b)
    b.learn(probs)
    return cfg, members, b, probs


# ----------------------------------------------------------------------------- one process


def test_one_process_record_and_metrics_equal_the_hand_values():
    t = 2
    cfg, members, b, probs = _setup(t, eps_num=0.125)  # not the default: the step must pass it on
    rec = es_step(cfg, b, probs, t)
    epoch, idx = batch_indices(SEED, t, len(probs.train), B)
    prompts = [probs.train_prompts[i] for i in idx]
    (call,) = b.calls
    assert call == {
        "members": [(m.seed, m.sign * SIGMA, m.gen_seed) for m in members],
        "prompts": prompts,
        "sampling": SamplingParams(0.75, 0.5, 6),
        "claim": None,
    }
    z = _z(REWARDS, 0.125)
    mean = sum(REWARDS) / N
    m = rec.pop("metrics")
    assert rec == {
        "t": t,
        "batch": idx,
        "seeds": [x.seed for x in members],
        "signs": [1] * N,
        "gen_seeds": [x.gen_seed for x in members],
        "sigma": SIGMA,
        "rewards": REWARDS,
        "z": pytest.approx(z, rel=1e-12),
        "update_seeds": [x.seed for x in members],
        "update_weights": pytest.approx(z, rel=1e-12),
        "alpha": ALPHA,
        "n": N,
    }
    (spec,) = b.specs
    assert (list(spec.seeds), spec.alpha, spec.n) == ([x.seed for x in members], ALPHA, N)
    tokens = sum(1 + i + 2 * x for i in range(N) for x in range(B))  # 54
    prompt_len = sum(len(p) for p in prompts) / B
    gen_len = tokens / (N * B)
    flops = 2 * PARAMS * N * B * (prompt_len + gen_len) + 4 * PARAMS * N + 2 * PARAMS * N
    assert 0.0 <= m["time/update_s"] < 5.0
    assert m == {
        "reward/mean": mean,
        "reward/std": pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in REWARDS) / N), rel=1e-12),
        "reward/min": -0.25,
        "reward/max": 1.0,
        "update/l2": 0.125,
        "update/changed_fraction": 0.375,
        "update/rel_distance_from_theta0": 0.0625,
        "time/generation_s": GEN_S,
        "time/perturb_restore_s": PR_S,
        "time/engine_idle_s": IDLE_S,
        "time/update_s": m["time/update_s"],
        "time/total_s": pytest.approx(GEN_S + PR_S + m["time/update_s"], rel=1e-12),
        "tokens/generated": 54,
        "tokens/per_s": 27.0,
        "epoch": epoch,
        "score/errors": 0.0,
        "score/error_rate": 0.0,
        "update/flops": pytest.approx(flops, rel=1e-12),
    }
    assert tokens == 54 and isinstance(m["tokens/generated"], int)


def test_the_batch_continues_the_stream_after_earlier_pipeline_stages():
    # run.data_before [[2, 5]]: 2 updates of 5 took positions 0..9 of epoch 0's permutation of the 40 examples
    cfg = _cfg()
    cfg.run.data_before = [[2, 5]]
    members = draw_population(SEED, 0, N, "one_point", "independent")
    b = Scripted(members)
    probs = load_problems(cfg, b)
    b.learn(probs)
    assert len(probs.train) == 40
    rec = es_step(cfg, b, probs, 0)
    assert rec["batch"] == np.random.default_rng([SEED, 0, 0xDA7A]).permutation(40)[10:13].tolist()
    assert rec["metrics"]["epoch"] == 0
    # the 30 examples left of epoch 0 take 10 updates of 3: update 10 is the first of epoch 1
    b = Scripted(draw_population(SEED, 10, N, "one_point", "independent"))
    b.learn(probs)
    rec = es_step(cfg, b, probs, 10)
    assert rec["batch"] == np.random.default_rng([SEED, 1, 0xDA7A]).permutation(40)[0:3].tolist()
    assert rec["metrics"]["epoch"] == 1


def test_reward_std_is_the_population_std_of_unequal_rewards():
    # rewards 1, 0.25, -0.25, 0.25: mean 5/16, squared deviations (11/16)^2 + 2 (1/16)^2 + (9/16)^2 = 204/256
    cfg, _, b, probs = _setup(0)
    m = es_step(cfg, b, probs, 0)["metrics"]
    assert m["reward/std"] == pytest.approx(math.sqrt(204 / 256 / 4), rel=1e-12)


def test_no_generation_time_gives_zero_tokens_per_second():
    cfg, members, _, _ = _setup(0)
    b = Scripted(members, gen_s=0.0)
    probs = load_problems(cfg, b)
    b.learn(probs)
    m = es_step(cfg, b, probs, 0)["metrics"]
    assert m["tokens/per_s"] == 0.0 and m["time/generation_s"] == 0.0 and m["tokens/generated"] == 54


@pytest.mark.parametrize(("params", "counts"), [(None, True), (PARAMS, False), (0, True)])
def test_no_flops_without_a_parameter_count_or_token_counts(params, counts):
    cfg, members, _, _ = _setup(0)
    b = Scripted(members, params=params, counts=counts)
    probs = load_problems(cfg, b)
    b.learn(probs)
    assert "update/flops" not in es_step(cfg, b, probs, 0)["metrics"]


def test_dynamic_dispatch_in_one_process_is_the_static_plan():
    cfg, members, b, probs = _setup(1, dispatch="dynamic")
    rec = es_step(cfg, b, probs, 1)
    (call,) = b.calls
    assert call["claim"] is None and len(call["members"]) == N
    assert rec["rewards"] == REWARDS and "time/rank_wait_s" not in rec["metrics"]


# ----------------------------------------------------------------------------- two ranks


def test_static_rank_1_of_2_evaluates_members_1_and_3_and_gathers_the_rest():
    t = 3
    cfg, members, b, probs = _setup(t)
    ranks = TwoRanks(1, {5: {0: [0.5, 7.0, 0.0, 0, 0], 2: [0.0, 5.0, 0.0, 0, 1]}})
    rec = es_step(cfg, b, probs, t, ranks)
    (call,) = b.calls
    assert call["members"] == [(members[i].seed, SIGMA, members[i].gen_seed) for i in (1, 3)]
    assert call["claim"] is None
    # local rows of members 1 and 3: rewards (1/4 - 1/2 + 1) / 3 and (1 + 1/4 - 1/2) / 3, tokens sum_x 1 + i + 2x
    ((n, local, width),) = ranks.gathers
    assert (n, width) == (N, 5)
    # reward, tokens, verifier exceptions, replica (rank 1's one engine: replica 1), place in its order
    assert local == {1: [0.25, 12, 0, 1, 0], 3: [0.25, 18, 0, 1, 1]}
    assert "replicas" not in rec  # es.restore: exact: who evaluated whom changes nothing
    rewards = [0.5, 0.25, 0.0, 0.25]
    assert rec["rewards"] == rewards
    assert rec["z"] == pytest.approx(_z(rewards), rel=1e-12)
    m = rec["metrics"]
    assert m["tokens/generated"] == 7 + 12 + 5 + 18 and isinstance(m["tokens/generated"], int)
    assert m["tokens/per_s"] == pytest.approx(42 / GEN_S / 2, rel=1e-12)
    assert 0.0 <= m["time/rank_wait_s"] < 5.0


def test_dynamic_rank_takes_the_members_its_claim_hands_out():
    t = 5
    cfg, members, b, probs = _setup(t, dispatch="dynamic")
    ranks = TwoRanks(0, {5: {1: [0.75, 4.0, 0.0, 1, 0], 3: [-0.5, 6.0, 0.0, 1, 1]}}, claims=[2, 0])
    rec = es_step(cfg, b, probs, t, ranks)
    assert ranks.claimers == [(N, f"es/{t}")]
    (call,) = b.calls
    assert call["members"] == [(m.seed, SIGMA, m.gen_seed) for m in members]  # the whole population is offered
    assert callable(call["claim"])
    ((_, local, _),) = ranks.gathers
    assert local == {0: [1.0, 9, 0, 0, 0], 2: [-0.25, 15, 0, 0, 1]}  # keyed by the index the claim handed out
    assert rec["rewards"] == [1.0, 0.75, -0.25, -0.5]
    assert rec["metrics"]["tokens/generated"] == 9 + 4 + 15 + 6


# ----------------------------------------------------------------------------- diversity


def _p(i, m=3):
    """p_i(x) by counting: the reward response and the first m - 1 extra ones, of m."""
    return [((PATTERN[i][x] == "C") + sum(c == "C" for c in EXTRA[i][x][: m - 1])) / m for x in range(B)]


FIRST = [[float(c == "C") for c in row] for row in PATTERN]  # the reward response's verdict, 0/1


def test_diversity_counts_each_prompts_own_extra_samples():
    t = 4
    cfg, members, b, probs = _setup(t, diversity={"every": 2, "samples": 3})
    rec = es_step(cfg, b, probs, t)
    _, idx = batch_indices(SEED, t, len(probs.train), B)
    reward_call, extra_call = b.calls
    assert extra_call["members"] == [(m.seed, SIGMA, diversity_seed(m.gen_seed)) for m in members]
    assert extra_call["prompts"] == [probs.train_prompts[i] for i in idx]
    assert extra_call["sampling"] == SamplingParams(0.75, 0.5, 6, n=2)
    assert extra_call["claim"] is None
    p = [_p(i) for i in range(N)]
    # by hand (first response + the two extra ones, of 3): prompt x takes extra samples 2x and 2x + 1
    np.testing.assert_allclose(p, [[2 / 3, 1 / 3, 2 / 3], [2 / 3, 0, 2 / 3], [0, 1 / 3, 2 / 3], [1 / 3, 2 / 3, 1 / 3]])
    assert rec["diversity"] == {"p": p, "samples": 3, "first": FIRST}  # the same integer counts over 3: exact
    m = rec["metrics"]
    want = diversity_metrics(p, _z(REWARDS), FIRST, 3)
    assert "cov_weight" in want
    # leave-one-out by hand: p without the reward's response = the extra ones' share, of 2
    loo = [[sum(c == "C" for c in EXTRA[i][x]) / 2 for x in range(B)] for i in range(N)]
    z = np.asarray(_z(REWARDS))
    want_loo = np.mean([np.mean((z - z.mean()) * (np.array(col) - np.mean(col))) for col in zip(*loo)])
    assert m["diversity/cov_weight_loo"] == pytest.approx(want_loo, rel=1e-9, abs=1e-12)
    for k, v in want.items():
        assert m[f"diversity/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert m["tokens/diversity"] == N * B * (10 + 11)
    assert 0.0 <= m["time/diversity_s"] < 5.0
    # the reward, the weights and the update are the first pass's
    assert rec["rewards"] == REWARDS and b.specs[0].weights == pytest.approx(_z(REWARDS), rel=1e-12)
    assert m["tokens/generated"] == 54


def test_diversity_only_on_updates_divisible_by_every_and_never_when_off():
    cfg, _, b, probs = _setup(3, diversity={"every": 2, "samples": 3})
    rec = es_step(cfg, b, probs, 3)
    assert "diversity" not in rec and len(b.calls) == 1
    assert not any(k.startswith(("diversity/", "time/diversity", "tokens/diversity")) for k in rec["metrics"])
    cfg, _, b, probs = _setup(0)  # every: 0 (off), even at t = 0
    assert "diversity" not in es_step(cfg, b, probs, 0) and len(b.calls) == 1


def test_diversity_with_two_samples_takes_one_extra_response_per_prompt():
    cfg, members, b, probs = _setup(0, diversity={"every": 1, "samples": 2})
    rec = es_step(cfg, b, probs, 0)
    _, extra_call = b.calls
    assert extra_call["sampling"] == SamplingParams(0.75, 0.5, 6, n=1)
    p = [_p(i, m=2) for i in range(N)]
    # by hand: member 0 [1, 1/2, 1/2], 1 [1/2, 0, 1], 2 [0, 0, 1/2], 3 [1/2, 1/2, 0]
    assert p == [[1, 0.5, 0.5], [0.5, 0, 1], [0, 0, 0.5], [0.5, 0.5, 0]]
    assert rec["diversity"] == {"p": p, "samples": 2, "first": FIRST}
    assert rec["metrics"]["tokens/diversity"] == N * B * 10


def test_diversity_with_one_sample_has_no_extra_pass_and_zero_extra_tokens():
    cfg, _, b, probs = _setup(0, diversity={"every": 1, "samples": 1})
    rec = es_step(cfg, b, probs, 0)
    assert len(b.calls) == 1
    assert rec["diversity"] == {"p": FIRST, "samples": 1, "first": FIRST}
    assert rec["metrics"]["tokens/diversity"] == 0
    assert "diversity/cov_weight_loo" not in rec["metrics"]  # one sample: nothing is left out


def test_diversity_on_rank_1_of_2_sends_its_rows_and_takes_the_others():
    t = 2
    cfg, members, b, probs = _setup(t, diversity={"every": 1, "samples": 3})
    other_p = {0: [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 40.0], 2: [0.0, 1 / 3, 1.0, 0.0, 0.0, 1.0, 30.0]}
    ranks = TwoRanks(1, {5: {0: [0.5, 7.0, 0.0, 0, 0], 2: [0.0, 5.0, 0.0, 0, 1]}, 2 * B + 1: other_p})
    rec = es_step(cfg, b, probs, t, ranks)
    _, extra_call = b.calls
    assert extra_call["members"] == [(members[i].seed, SIGMA, diversity_seed(members[i].gen_seed)) for i in (1, 3)]
    (_, (n, local, width)) = ranks.gathers
    assert (n, width) == (N, 2 * B + 1)
    assert set(local) == {1, 3}
    for i in (1, 3):
        assert local[i][:B] == pytest.approx(_p(i), abs=1e-15)
        assert local[i][B : 2 * B] == FIRST[i]
        assert local[i][2 * B] == B * (10 + 11)
    assert rec["diversity"]["p"] == [other_p[0][:B], _p(1), other_p[2][:B], _p(3)]
    assert rec["diversity"]["first"] == [other_p[0][B : 2 * B], FIRST[1], other_p[2][B : 2 * B], FIRST[3]]
    assert rec["metrics"]["tokens/diversity"] == 40 + 63 + 30 + 63


# ----------------------------------------------------------------------------- diversity_seed


def test_diversity_seed_pinned_values():
    # blake2b(b"es-diversity/<g>", digest_size=4), little-endian, mod 2^31 (values computed once with hashlib)
    assert diversity_seed(0) == 1416289593
    assert diversity_seed(7) == 1328999790
    assert diversity_seed(123456789) == 2552436734 - 2**31  # the modulus matters for this one


# ----------------------------------------------------------------------------- replay


def _records():
    return [
        {
            "t": 0,
            "seeds": [5, 5, 9],
            "signs": [1, -1, 1],
            "sigma": 0.5,
            **UpdateSpec([5, 9], [0.25, -1.0], 0.1, 3).to_dict(),
        },
        {"t": 1, "seeds": [4], "signs": [-1], "sigma": 0.125, **UpdateSpec([4], [2.0], 0.2, 1).to_dict()},
    ]


def test_inplace_replay_redoes_each_members_perturb_restore_before_its_update():
    b = Scripted([], restore_mode="inplace")
    replay(b, _records())
    assert b.log == [
        ("perturb", 5, 0.5),
        ("restore",),
        ("perturb", 5, -0.5),
        ("restore",),
        ("perturb", 9, 0.5),
        ("restore",),
        ("update", [5, 9], [0.25, -1.0], 0.1, 3),
        ("perturb", 4, -0.125),
        ("restore",),
        ("update", [4], [2.0], 0.2, 1),
    ]


def test_exact_replay_only_updates_and_needs_no_sigma():
    b = Scripted([])
    recs = _records()
    del recs[0]["sigma"]
    replay(b, recs)
    assert b.log == [("update", [5, 9], [0.25, -1.0], 0.1, 3), ("update", [4], [2.0], 0.2, 1)]


def test_inplace_replay_of_a_record_without_sigma_names_the_update():
    b = Scripted([], restore_mode="inplace")
    recs = _records()
    del recs[1]["sigma"]
    with pytest.raises(ValueError) as e:
        replay(b, recs)
    assert str(e.value) == (
        "log.jsonl: update 1 records no sigma, which replaying es.restore: inplace needs (each member's scale is "
        "sign * sigma); this log was not written by an inplace run"
    )
    assert b.log[-1] == ("update", [5, 9], [0.25, -1.0], 0.1, 3)  # the first update went through


def _engines(records_replicas):
    return [{**r, "replicas": records_replicas} for r in _records()[:1]]


def test_inplace_replay_gives_each_engine_the_cycles_of_the_replica_it_stands_for():
    b = Engines([], restore_mode="inplace")
    recs = _engines([[1], [2, 0], [], []])  # 4 replicas; members 5+, 5-, 9+ (scales 0.5, -0.5, 0.5)
    replay(b, recs, first_replica=1)
    assert b.log == [("cycles", [[(9, 0.5), (5, 0.5)], []]), ("update", [5, 9], [0.25, -1.0], 0.1, 3)]
    assert member_cycles(recs[0], 3, 1) == [[]]
    assert member_cycles(recs[0], 0, 1) == [[(5, -0.5)]]


@pytest.mark.parametrize(
    "replicas", [[[0, 0], [1, 2]], [[0], [1]], [[0, 1, 2, 3]], [[0, 1], [2, 2]], [[0, True], [2]], [[0, "1"], [2]]]
)
def test_a_damaged_replica_list_is_refused_instead_of_replayed(replicas):
    """Every member is perturbed and restored by exactly one replica: a list that repeats, drops or invents a
    member (or holds a non-integer) is a damaged log, and replaying it would silently rebuild other weights."""
    with pytest.raises(RunFolderError, match=r"update 0 lists its replicas' members as .*not each of its 3 members"):
        member_cycles(_engines(replicas)[0], 0, 1)
    assert member_cycles(_engines([[2, 0], [1]])[0], 0, 2) == [[(9, 0.5), (5, 0.5)], [(5, -0.5)]]  # a valid one


def test_inplace_replay_on_more_replicas_than_logged_names_the_fix():
    recs = _engines([[0, 1], [2]])
    with pytest.raises(ValueError) as e:
        replay(Engines([], restore_mode="inplace"), recs, first_replica=1)
    assert str(e.value) == (
        "log.jsonl: update 0 records the members of 2 replica(s) (engines x ranks), and replaying replicas 1..2 "
        "needs more: resume an es.restore: inplace run with the engines and ranks it ran with (backend.engines, "
        "run.nproc_per_node, run.nodes)"
    )


def test_a_log_from_before_replicas_were_recorded_is_one_replica_in_member_order():
    assert member_cycles(_records()[0], 0, 1) == [[(5, 0.5), (5, -0.5), (9, 0.5)]]


def test_replica_orders_sorts_each_replicas_members_by_their_place():
    rows = [[0.5, 1, 0, 1, 1], [0.0, 1, 0, 0, 0], [1.0, 1, 0, 1, 0], [0.2, 1, 0, 2, 0]]
    assert replica_orders(rows, 4) == [[1], [2, 0], [3], []]


class Engines(Scripted):
    """Two engines (replicas) in this process: member k of the call on engine k % 2, in reverse order; fixed
    weight samples per engine; cycles logged."""

    replicas = 2
    SAMPLES = ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])

    def evaluate_population(self, members, prompts, sampling, claim=None):
        out = super().evaluate_population(members, prompts, sampling, claim)
        ks = list(range(len(out.members)))
        out.replicas = [[k for k in reversed(ks) if k % 2 == e] for e in range(2)]
        return out

    def cycles(self, members):
        self.log.append(("cycles", [list(m) for m in members]))

    def replica_samples(self):
        return [torch.tensor(x, dtype=torch.float64) for x in self.SAMPLES]


def test_inplace_step_over_two_ranks_logs_each_replicas_members_and_how_far_they_differ():
    """Rank 1 of 2 with 2 engines is replicas 2 and 3: members 1 and 3 (its k = 0, 1) ran on engines 0 and 1;
    rank 0's rows put member 2 then 0 on its engine 0 (replica 0). The four replicas' samples differ by hand."""
    t = 3
    cfg, members, _, probs = _setup(t, restore="inplace")
    b = Engines(members)
    b.learn(probs)
    ranks = TwoRanks(1, {5: {0: [0.5, 7.0, 0.0, 0, 1], 2: [0.0, 5.0, 0.0, 0, 0]}})
    ranks.others_samples = [[1.0, 2.25, 3.0], [1.0, 2.0, 3.0]]  # replicas 0 and 1
    b.SAMPLES = ([1.0, 2.0, 3.5], [1.0, 2.0, 3.0])  # replicas 2 and 3
    rec = es_step(cfg, b, probs, t, ranks)
    ((_, local, _),) = ranks.gathers
    assert {i: row[3:] for i, row in local.items()} == {1: [2, 0], 3: [3, 0]}
    assert rec["replicas"] == [[2, 0], [], [1], [3]]
    m = rec["metrics"]
    assert {k: v for k, v in m.items() if k.startswith("replicas/")} == {
        "replicas/count": 4.0,
        "replicas/sampled": 3.0,
        "replicas/differing_fraction": pytest.approx(2 / 3, abs=1e-15),  # coordinates 1 and 2
        "replicas/max_abs_diff": 0.5,  # coordinate 2: 3.5 - 3.0
        # replica 2 against replica 0: differences 0, -0.25, 0.5 (replicas 1 and 3: 0, -0.25, 0)
        "replicas/rms_diff": pytest.approx(math.sqrt((0.0625 + 0.25) / 3), abs=1e-15),
    }


def test_inplace_in_one_process_logs_its_order_and_measures_nothing():
    cfg, members, b, probs = _setup(1, restore="inplace")
    rec = es_step(cfg, b, probs, 1)
    assert rec["replicas"] == [[0, 1, 2, 3]]
    assert not any(k.startswith("replicas/") for k in rec["metrics"])


# ----------------------------------------------------------------------------- ESTrainer


class FakeRunDir:
    def __init__(self, ckpt=None):
        self.ckpt, self.calls = ckpt, []

    def load_center(self):
        return self.ckpt

    def center_t(self):
        return None if self.ckpt is None else self.ckpt[1]

    def save_center(self, state, t):
        self.calls.append(("save_center", state, t))

    def write_export(self, save, t):
        self.calls.append(("write_export", save, t))


def _trainer(rd=None, ranks=None, **es):
    cfg, members, b, probs = _setup(0, **es)
    tr = ESTrainer(cfg, rd or FakeRunDir(), ranks or Ranks())
    tr.backend, tr.probs = b, probs
    return tr, b


def test_setup_builds_the_configured_backend_and_returns_the_budget(monkeypatch):
    asked = []

    class Built(Scripted):
        @classmethod
        def for_es(cls, cfg):
            asked.append(cfg)
            return cls([])

    def get(name):
        asked.append(name)
        return Built

    monkeypatch.setattr(trainer_mod, "BACKENDS", SimpleNamespace(get=get))
    cfg = config_from_dict(
        {
            "model": {"name": "nobody/no-model"},
            "task": {"name": "toy:DigitTask", "params": {"size": 39}, "heldout_size": 0},
            "es": {"population_size": N, "batch_size": B, "epochs": 2},
        }
    )
    tr = ESTrainer(cfg, FakeRunDir(), Ranks())
    assert tr.setup() == 26  # 2 epochs of ceil(39 / 3) = 13 batches
    assert asked == [cfg.backend.name, backend_setup(cfg)]
    assert isinstance(tr.backend, Built) and tr.n_train == 39 == len(tr.probs.train)


def test_inplace_in_one_process_sets_up(monkeypatch):
    monkeypatch.setattr(trainer_mod, "BACKENDS", SimpleNamespace(get=lambda name: Built))

    class Built(Scripted):
        @classmethod
        def for_es(cls, cfg):
            return cls([])

    assert ESTrainer(_cfg(restore="inplace"), FakeRunDir(), Ranks()).setup() == 4
    assert ESTrainer(_cfg(), FakeRunDir(), Ranks(0, 2)).setup() == 4  # exact restore over two ranks
    assert ESTrainer(_cfg(restore="inplace"), FakeRunDir(), Ranks(1, 2)).setup() == 4  # each rank its round-off


def test_inplace_replicas_replay_everything_from_theta0_and_skip_the_checksum():
    """Rank 1 of 2 with 2 engines (replicas 2, 3): the checkpoint holds replica 0's center, so it is not loaded;
    every record is replayed, each engine its own replica's cycles; the ranks' checksums differ by design."""
    cfg = _cfg(restore="inplace")
    tr = ESTrainer(cfg, FakeRunDir(({"w": "saved"}, 1)), Ranks(1, 2))
    tr.backend = b = Engines([], restore_mode="inplace")
    recs = [{**r, "replicas": [[0], [1], [2], []] if r["t"] == 0 else [[], [], [], [0]]} for r in _records()]
    assert tr.restore(recs) == 2 and tr.saved_at == 1
    assert b.log == [
        ("cycles", [[(9, 0.5)], []]),
        ("update", [5, 9], [0.25, -1.0], 0.1, 3),
        ("cycles", [[], [(4, -0.125)]]),
        ("update", [4], [2.0], 0.2, 1),
    ]
    assert tr.checksum() is None
    tr.ranks = Ranks()  # two engines in one process differ too
    assert tr.checksum() is None
    tr.backend = Scripted([], restore_mode="inplace")  # one replica: its checkpoint and checksum as before
    assert tr.checksum() == 12.5


def test_restore_without_a_checkpoint_replays_every_record():
    tr, b = _trainer()
    assert tr.restore(_records()) == 2
    assert tr.saved_at == 0
    assert [e[0] for e in b.log] == ["update", "update"]


def test_restore_from_a_checkpoint_loads_it_and_replays_the_records_after_it():
    tr, b = _trainer(rd=FakeRunDir(({"w": "saved"}, 1)))
    assert tr.restore(_records()) == 2
    assert tr.saved_at == 1
    assert b.log == [("load_center", {"w": "saved"}), ("update", [4], [2.0], 0.2, 1)]


def test_step_is_es_step_with_the_trainers_ranks(monkeypatch):
    ranks = Ranks(0, 1)
    tr, b = _trainer(ranks=ranks)
    seen = []
    monkeypatch.setattr(trainer_mod, "es_step", lambda *a: seen.append(a) or "record")
    assert tr.step(7) == "record"
    assert seen == [(tr.cfg, b, tr.probs, 7, ranks)]


@pytest.mark.parametrize(
    ("mode", "lead", "final", "want"),
    [
        ("every", True, False, [("save_center", {"w": "center"}, 6)]),
        ("every", False, True, []),
        ("final", True, False, []),
        ("final", True, True, "export"),
        ("final", False, True, []),
        ("none", True, True, []),
    ],
)
def test_save_follows_checkpoint_center(mode, lead, final, want):
    rd = FakeRunDir()
    tr, _ = _trainer(rd=rd, ranks=Ranks(0 if lead else 1, 2))
    tr.cfg.checkpoint.center = mode
    tr.save(6, final)
    if want == "export":
        assert rd.calls == [("write_export", tr.export, 6)]
    else:
        assert rd.calls == want


def test_the_small_trainer_methods(monkeypatch, tmp_path):
    tr, b = _trainer()
    assert ESTrainer.label == "ES"
    monkeypatch.setattr(trainer_mod, "evaluate_heldout", lambda *a: {"args": a})
    assert tr.evaluate() == {"args": (tr.cfg, b, tr.probs)}
    assert tr.generator() is b
    assert tr.center_state() == {"w": "center"}
    assert tr.checksum() == 12.5
    assert tr.postfix({"reward/mean": 0.12345, "time/total_s": 4.56}) == {"reward": "0.123", "s/upd": "4.6"}
    tr.export(tmp_path / "out")
    assert b.log[-1] == ("save_pretrained", tmp_path / "out")
    assert tr.summary() == {"memory": {"master": 3.0}}
    assert tr.tags() == tr.probs.task.tracking_tags()
    closed = []
    b.close = lambda: closed.append(True)
    tr.close()
    assert closed == [True]
    ESTrainer(tr.cfg, FakeRunDir(), Ranks()).close()  # never set up: no backend, nothing to close


# ----------------------------------------------------------------------------- esbatch/es/__init__.py


def test_es_algorithm_class_attributes_and_trainer():
    assert (ES.name, ES.section, ES.config, ES.replays_log) == ("es", "es", ESConfig, True)
    assert ES.inert(("es", "grpo", "pipeline")) == ("grpo", "pipeline")
    assert set(ES.resumable) == {"updates", "epochs", "diversity.every", "diversity.samples"}
    cfg = _cfg()
    session = SimpleNamespace(rd=FakeRunDir(), ranks=Ranks(1, 3))
    tr = ES.trainer(cfg, session)
    assert isinstance(tr, ESTrainer)
    assert (tr.cfg, tr.rd, tr.ranks) == (cfg, session.rd, session.ranks)


@pytest.mark.parametrize(
    ("samples", "temperature", "bad"), [(4, 0.0, True), (2, 0.0, True), (1, 0.0, False), (4, 0.5, False)]
)
def test_es_check_needs_sampling_for_several_diversity_samples(samples, temperature, bad):
    cfg = _cfg()
    cfg.es.diversity.samples, cfg.generation.temperature = samples, temperature
    errors = []
    ES.check(cfg, errors)
    want = (
        f"es.diversity.samples: {samples} responses per member and prompt need sampling, but generation.temperature "
        "is 0 (greedy: every response is the same); use samples: 1 or a temperature > 0"
    )
    assert errors == ([want] if bad else [])


def test_es_check_runs_the_common_checks_too():
    cfg = _cfg()
    cfg.es.updates = None  # neither updates nor epochs
    errors = []
    ES.check(cfg, errors)
    assert errors == ["es.updates / es.epochs: set exactly one training budget (e.g. es.updates: 300)"]


@pytest.mark.parametrize(
    ("field", "key", "value"),
    [
        ("batch_size", "generation.batch_size", 7),
        ("track_drift", "tracking.drift", False),
        ("seed", "run.seed", 12345),
        ("hang_timeout_s", "run.hang_timeout_s", 12.5),
        ("restore", "es.restore", "inplace"),
        ("noise", "es.noise", "philox-rademacher"),
        ("master", "es.master", "host"),
        ("perturbation", "es.perturbation", "lowrank"),
        ("rank", "es.rank", 3),
        ("lowrank_vectors", "es.lowrank_vectors", "frozen"),
        ("dispatch", "es.dispatch", "dynamic"),
    ],
)
def test_every_backend_setting_comes_from_its_config_key(field, key, value):
    """backend_setup reads each ESSetup field from its own key (and the model and backend sections whole)."""
    import dataclasses

    from esbatch.backends.config import ESSetup

    section, name = key.split(".")
    cfg = _cfg()
    default = getattr(backend_setup(cfg), field)
    assert default != value
    setattr(getattr(cfg, section), name, value)
    setup = backend_setup(cfg)
    assert getattr(setup, field) == value and (setup.model, setup.backend) == (cfg.model, cfg.backend)
    assert {f.name for f in dataclasses.fields(ESSetup)} == {"model", "backend", *PARAMS_OF_SETUP}


PARAMS_OF_SETUP = (
    "batch_size",
    "track_drift",
    "seed",
    "hang_timeout_s",
    "restore",
    "noise",
    "master",
    "perturbation",
    "rank",
    "lowrank_vectors",
    "dispatch",
)


def test_every_rank_stops_when_the_verifier_failures_of_all_ranks_pass_the_limit():
    """Rank 1 scores its members without an exception, but rank 0 reports 5 of its 6 responses raised: 5 of 12
    is above 0.4, so rank 1 stops too (the ranks must not split between stopping and waiting)."""
    from esbatch.tasks.verify import ScoringError

    cfg, members, b, probs = _setup(3)
    cfg.reward.max_score_errors = 0.4
    ranks = TwoRanks(1, {5: {0: [0.5, 7.0, 2.0, 0, 0], 2: [0.0, 5.0, 3.0, 0, 1]}})
    with pytest.raises(ScoringError, match=r"raised on 5 of the 12 responses .* Last one \(this process\): on another"):
        es_step(cfg, b, probs, 3, ranks)
    cfg.reward.max_score_errors = 5 / 12  # exactly at the limit: logged, not stopped
    rec = es_step(cfg, b, probs, 3, ranks)
    assert (rec["metrics"]["score/errors"], rec["metrics"]["score/error_rate"]) == (5.0, 5 / 12)
