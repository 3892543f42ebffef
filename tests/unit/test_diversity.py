"""Population diversity (paper Section 3.1): the verifier-projected JS diversity and the weight covariance against
formulas written out here, p_i(x) counted from a stub backend whose answers are fixed by hand, and the ES option
on the tiny model: p has the right shape and matches a re-generation, and the center is what it is without it.
"""

import math

import numpy as np
import pytest
import torch

from esbatch.backends.base import ESBackend, Generation, UpdateStats
from esbatch.config import ConfigError, config_from_dict
from esbatch.es.core import draw_population
from esbatch.es.replay import replay
from esbatch.es.trainer import diversity_seed, es_step
from esbatch.metrics import bernoulli_entropy, diversity_metrics, js_diversity, leave_one_out, weight_covariance
from esbatch.train.problems import load_problems

LN2 = math.log(2)


def _h(p):
    """Bernoulli entropy in nats, written out."""
    return -sum(q * math.log(q) for q in (p, 1 - p) if q > 0)


def _js(p):
    """JS_v averaged over prompts, from the definition: H(mean_i p_i(x)) - mean_i H(p_i(x))."""
    n, b = len(p), len(p[0])
    return sum(_h(sum(p[i][x] for i in range(n)) / n) - sum(_h(p[i][x]) for i in range(n)) / n for x in range(b)) / b


# ----------------------------------------------------------------------------- the formulas


def test_bernoulli_entropy_values():
    assert bernoulli_entropy(np.array([0.0, 1.0, 0.5])).tolist() == [0.0, 0.0, pytest.approx(LN2)]
    assert float(bernoulli_entropy(0.25)) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))


@pytest.mark.parametrize(
    ("p", "want"),
    [
        ([[0.3, 0.7], [0.3, 0.7], [0.3, 0.7]], 0.0),  # identical members
        ([[0.4, 0.9]], 0.0),  # one policy (GRPO): zero by definition
        ([[1.0], [0.0]], LN2),  # disjoint deterministic members: the maximum
        ([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], LN2),  # half solve each prompt: still the maximum
        # one of four solves: H(1/4) = 0.5623...
        ([[1.0], [0.0], [0.0], [0.0]], 0.25 * math.log(4) + 0.75 * math.log(4 / 3)),
        # pbar = 3/4: H(3/4) - (ln 2 + 0) / 2 = 0.2158...
        ([[0.5], [1.0]], 0.25 * math.log(4) + 0.75 * math.log(4 / 3) - LN2 / 2),
    ],
)
def test_js_diversity_by_hand(p, want):
    assert js_diversity(p) == pytest.approx(want, abs=1e-12)
    assert js_diversity(p) == pytest.approx(_js(p), abs=1e-12)


def test_js_diversity_of_random_populations_matches_the_definition_and_bounds():
    rng = np.random.default_rng(0)
    for _ in range(20):
        p = rng.random((int(rng.integers(1, 9)), int(rng.integers(1, 6))))
        got = js_diversity(p.tolist())
        assert got == pytest.approx(_js(p.tolist()), abs=1e-12)
        assert -1e-12 <= got <= LN2 + 1e-12


def test_weight_covariance_against_numpy():
    rng = np.random.default_rng(1)
    z, p = rng.normal(size=6), rng.random((6, 4))
    per_prompt = [np.cov(z, p[:, x], bias=True)[0, 1] for x in range(4)]  # population covariance, 1/N
    assert weight_covariance(z.tolist(), p.tolist()) == pytest.approx(float(np.mean(per_prompt)), abs=1e-12)
    # Lemma 3: w >= 0, sum w = 1 -> p_w(x) - pbar(x) = N Cov_i(w_i, p_i(x)); with w a positive affine map of z
    w = (z - z.min()) / (z - z.min()).sum()
    gain = (w @ p - p.mean(0)).mean()
    assert 6 * weight_covariance(w.tolist(), p.tolist()) == pytest.approx(gain, abs=1e-12)


def test_weight_covariance_by_hand():
    # z = (1, -1), p = ((1, 0.5), (0, 0.5)): per prompt Cov = 1/2 [(1)(1/2) + (-1)(-1/2)] = 1/2 and 0
    assert weight_covariance([1.0, -1.0], [[1.0, 0.5], [0.0, 0.5]]) == pytest.approx(0.25)


def test_diversity_metrics_by_hand():
    p = [[1.0, 0.5], [0.0, 0.5]]
    m = diversity_metrics(p, [1.0, -1.0])
    assert m["js"] == pytest.approx((LN2 + 0.0) / 2)  # prompt 0 disjoint, prompt 1 identical
    assert m["h_members"] == pytest.approx((0 + 0 + LN2 + LN2) / 4)
    assert m["p_mean"] == pytest.approx(0.5)
    assert m["pass_population"] == pytest.approx((1.0 + (1 - 0.25)) / 2)  # 1 - 0*1, 1 - 0.5*0.5
    assert m["pass_matched"] == pytest.approx((0.75 + 0.75) / 2)  # 1 - (1 - 1/2)^2 on both
    assert m["cov_weight"] == pytest.approx(0.25)
    assert "cov_weight" not in diversity_metrics(p)


@pytest.mark.parametrize(
    ("p", "z", "match"),
    [
        ([], None, "shape"),
        ([[0.5, 0.5], [0.5]], None, "ragged"),
        ([["a"]], None, "ragged"),
        ([[1.5]], None, "outside"),
        ([[float("nan")]], None, "outside"),
        ([[0.5], [0.5]], [1.0], "2 members"),
    ],
)
def test_bad_inputs_are_named(p, z, match):
    with pytest.raises(ValueError, match=match):
        diversity_metrics(p, z)


# ----------------------------------------------------------------------------- config


def _cfg(model="nobody/no-model", temperature=1.0, **es):
    return config_from_dict(
        {
            "run": {"seed": 5},
            "model": {"name": str(model)},
            "task": {"name": "toy:DigitTask", "heldout_size": 0},
            "generation": {"temperature": temperature, "max_new_tokens": 6},
            "es": {"population_size": 4, "sigma": 0.05, "alpha": 0.02, "batch_size": 3, "updates": 2, **es},
        }
    )


def test_config_defaults_off_and_bad_values_are_named():
    cfg = _cfg()
    assert (cfg.es.diversity.every, cfg.es.diversity.samples) == (0, 1)
    with pytest.raises(ConfigError, match="es.diversity.samples"):
        _cfg(diversity={"every": 1, "samples": 0})
    with pytest.raises(ConfigError, match="es.diversity.every"):
        _cfg(diversity={"every": -1})
    with pytest.raises(ConfigError, match="es.diversity.sampels"):
        _cfg(diversity={"sampels": 2})
    with pytest.raises(ConfigError, match="es.diversity.samples: 4 .* generation.temperature is 0"):
        _cfg(temperature=0.0, diversity={"every": 1, "samples": 4})
    assert _cfg(temperature=0.0, diversity={"every": 1, "samples": 1}).es.diversity.samples == 1


# ----------------------------------------------------------------------------- p_i(x) on a stub scorer


class StubBackend(ESBackend):
    """Answers fixed by hand: on the reward pass (n = 1) member i solves prompt j iff i + j is even; on the
    diversity pass (n = m - 1) every sample of members 2 and 3 is correct and none of members 0 and 1.
    CORRECT = all ten digits (the toy task), wrong = "" (MISSING). Records every generate call."""

    def __init__(self, index_of_seed):
        self.index_of_seed, self.member, self.calls = index_of_seed, None, []

    def chat_prompt(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts, sampling, seed):
        i = self.member
        self.calls.append((i, sampling.n, seed))
        out = []
        for j in range(len(prompts)):
            for _ in range(sampling.n):
                ok = (i + j) % 2 == 0 if sampling.n == 1 else i >= 2
                out.append(Generation("0123456789" if ok else "", 2))
        return out

    @classmethod
    def for_es(cls, cfg):
        raise NotImplementedError

    def perturb(self, seed, scale):
        self.member = self.index_of_seed[seed]

    def restore(self):
        self.member = None

    def update(self, spec):
        return UpdateStats(0.0, 0.0)

    def center_state_dict(self):
        return {}

    def load_center(self, state):
        pass

    def save_pretrained(self, path):
        pass


def test_p_counts_the_reward_response_and_the_extra_ones():
    cfg = _cfg(diversity={"every": 2, "samples": 3})
    members = draw_population(cfg.run.seed, 0, 4, "one_point", "independent")
    b = StubBackend({m.seed: i for i, m in enumerate(members)})
    rec = es_step(cfg, b, load_problems(cfg, b), 0)
    third = 1 / 3
    assert rec["diversity"]["samples"] == 3
    want = [[third, 0, third], [0, third, 0], [1, 2 * third, 1], [2 * third, 1, 2 * third]]
    np.testing.assert_allclose(rec["diversity"]["p"], want, rtol=0, atol=1e-12)
    # the reward is the reward pass alone: correct 1, missing 0, over the 3 prompts
    assert rec["rewards"] == pytest.approx([2 / 3, 1 / 3, 2 / 3, 1 / 3])
    # reward pass: n = 1 with the member's generation seed; diversity pass: n = 2 with diversity_seed of it
    assert b.calls[:4] == [(i, 1, m.gen_seed) for i, m in enumerate(members)]
    assert b.calls[4:] == [(i, 2, diversity_seed(m.gen_seed)) for i, m in enumerate(members)]
    met = rec["metrics"]
    assert met["diversity/js"] == pytest.approx(_js(rec["diversity"]["p"]))
    z = np.array(rec["z"])
    assert met["diversity/cov_weight"] == pytest.approx(np.cov(z, np.mean(rec["diversity"]["p"], 1), bias=True)[0, 1])
    assert met["tokens/diversity"] == 4 * 3 * 2 * 2  # members x prompts x (m - 1) x 2 tokens each
    # update 1 is not a diagnostic update (every 2): no record, no extra pass
    b.calls.clear()
    b.index_of_seed = {m.seed: i for i, m in enumerate(draw_population(cfg.run.seed, 1, 4, "one_point", "independent"))}
    rec1 = es_step(cfg, b, load_problems(cfg, b), 1)
    assert "diversity" not in rec1 and not any(k.startswith("diversity/") for k in rec1["metrics"])
    assert [n for _, n, _ in b.calls] == [1] * 4


def test_one_sample_needs_no_extra_generation():
    cfg = _cfg(diversity={"every": 1, "samples": 1})
    members = draw_population(cfg.run.seed, 0, 4, "one_point", "independent")
    b = StubBackend({m.seed: i for i, m in enumerate(members)})
    rec = es_step(cfg, b, load_problems(cfg, b), 0)
    assert len(b.calls) == 4
    assert rec["diversity"]["p"] == [[1, 0, 1], [0, 1, 0], [1, 0, 1], [0, 1, 0]]
    assert rec["metrics"]["diversity/js"] == pytest.approx(LN2)  # deterministic members, half solve each prompt


# ----------------------------------------------------------------------------- the ES option on the tiny model


def test_option_leaves_the_center_and_rewards_unchanged_and_replay_works(tiny_model_dir, tiny_backend_factory):
    off, on = _cfg(tiny_model_dir), _cfg(tiny_model_dir, diversity={"every": 1, "samples": 3})
    a, b, c = tiny_backend_factory(), tiny_backend_factory(), tiny_backend_factory()
    probs = load_problems(off, a)
    recs_off = [es_step(off, a, probs, t) for t in range(2)]
    recs_on = [es_step(on, b, probs, t) for t in range(2)]
    for r0, r1 in zip(recs_off, recs_on):
        for key in ("batch", "seeds", "signs", "gen_seeds", "rewards", "z", "update_seeds", "update_weights"):
            assert r0[key] == r1[key], key
        assert "diversity" not in r0
        p = r1["diversity"]["p"]
        assert np.array(p).shape == (4, 3)
        assert all(0 <= v <= 1 and abs(3 * v - round(3 * v)) < 1e-12 for row in p for v in row)  # thirds
    assert all(torch.equal(a.master[n], b.master[n]) for n in a.master)
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)
    replay(c, recs_on)  # the log of the run with the option replays to the same center
    assert all(torch.equal(b.master[n], c.master[n]) for n in b.master)


def test_p_matches_a_regeneration_of_the_member_responses(tiny_model_dir, tiny_backend_factory):
    from esbatch.backends import SamplingParams
    from esbatch.tasks import Verdict

    cfg = _cfg(tiny_model_dir, diversity={"every": 1, "samples": 3})
    b, fresh = tiny_backend_factory(), tiny_backend_factory()
    probs = load_problems(cfg, b)
    rec = es_step(cfg, b, probs, 0)
    prompts = [probs.train_prompts[i] for i in rec["batch"]]
    total = 0
    for i in range(4):
        fresh.perturb(rec["seeds"][i], rec["signs"][i] * cfg.es.sigma)
        first = fresh.generate(prompts, SamplingParams(1.0, 1.0, 6), rec["gen_seeds"][i])
        more = fresh.generate(prompts, SamplingParams(1.0, 1.0, 6, n=2), diversity_seed(rec["gen_seeds"][i]))
        fresh.restore()
        for x, j in enumerate(rec["batch"]):
            texts = [first[x].text, more[2 * x].text, more[2 * x + 1].text]
            hits = sum(probs.task.score(t, probs.train[j]) is Verdict.CORRECT for t in texts)
            assert rec["diversity"]["p"][i][x] == pytest.approx(hits / 3)
            total += hits
    assert rec["metrics"]["diversity/p_mean"] == pytest.approx(total / (4 * 3 * 3))
    assert rec["metrics"]["diversity/js"] == pytest.approx(_js(rec["diversity"]["p"]))


# ----------------------------------------------------------------------------- GRPO: the group success share


def _grpo(tiny_model_dir, iterations=1, world=1):
    from types import SimpleNamespace

    from esbatch.grpo.trainer import GRPOTrainer
    from esbatch.tasks import TASKS
    from esbatch.train.problems import Problems
    from esbatch.train.ranks import Ranks

    cfg = config_from_dict(
        {
            "algorithm": "grpo",
            "model": {"name": str(tiny_model_dir)},
            "task": {"name": "toy:DigitTask", "heldout_size": 0},
            "generation": {"temperature": 1.0, "max_new_tokens": 4},
            "grpo": {"group_size": 3, "batch_size": 2, "updates": 2, "iterations": iterations},
        }
    )
    task = TASKS.get("toy:DigitTask")(None, size=4)
    train = task.splits(4, 0, 0, 0)["train"]
    tr = GRPOTrainer(cfg, None, Ranks(0, world), "cpu")
    tr.probs = Problems(task, train, [], [e.question for e in train], [])
    tr.engine = SimpleNamespace(module=torch.nn.Linear(1, 1), get_global_grad_norm=lambda: 0.0)
    return tr, train


class GroupGen:
    """G = 3 answers per prompt: prompt 0 of a call gets correct, missing, correct; the others all missing."""

    def generate(self, prompts, sampling, seed):
        texts = [["0123456789", "", "0123456789"]] + [["", "", ""]] * (len(prompts) - 1)
        return [Generation(t, 1, token_ids=[5]) for row in texts for t in row[: sampling.n]]


def test_grpo_sample_scores_correctness_per_response(tiny_model_dir):
    tr, _ = _grpo(tiny_model_dir)
    tr.gen = GroupGen()
    _, rewards, correct = tr._sample([0, 1], 0)
    assert correct.tolist() == [[True, False, True], [False, False, False]]
    assert rewards.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]  # the rewards are what they were


def test_grpo_record_holds_the_group_success_share_on_generated_steps_only(tiny_model_dir):
    tr, _ = _grpo(tiny_model_dir, iterations=2)
    correct = torch.tensor([[True, False, True], [False, False, False]])
    batch = {"rewards": torch.zeros(2, 3), "t_gen": 1.0, "correct": correct, "batch": [3, 1], "weight": 1.0}
    tr._rollouts = lambda index: {**batch, "index": index}
    sums = ("entropy_sum", "kl_sum", "clip_sum", "tokens", "loss", "gen_tokens", "flops")
    tr._learn = lambda b, first: dict.fromkeys(sums + ("logp_diff_sum", "logp_diff_max", "capped", "is_tokens"), 0.0)
    tr._weights_checksum = lambda: 1.0
    tr._gather = lambda local: torch.tensor([local], dtype=torch.float64)
    rec = tr.step(0)
    assert rec["diversity"] == {"p": [[pytest.approx(2 / 3), 0.0]], "batch": [3, 1], "samples": 3}
    m = rec["metrics"]
    assert m["diversity/js"] == 0.0  # one policy
    assert m["diversity/p_mean"] == pytest.approx(1 / 3)
    assert m["diversity/h_members"] == pytest.approx(_h(2 / 3) / 2)
    rec1 = tr.step(1)  # mu = 2: the second step trains on the same rollouts
    assert "diversity" not in rec1 and "diversity/js" not in rec1["metrics"]


def test_grpo_group_success_interleaves_the_ranks_shares(tiny_model_dir):
    tr, _ = _grpo(tiny_model_dir, world=2)
    # batch [7, 3, 5] over 2 ranks: rank 0 holds prompts 7 and 5 (batch positions 0, 2), rank 1 holds 3 (position 1)
    b = {"correct": torch.tensor([[True, True, True], [False, False, True]]), "weight": 1.0, "batch": [7, 3, 5]}
    tr._gather = lambda local: torch.tensor([local, [0.0, float("nan")]], dtype=torch.float64)
    assert tr._group_success(b) == [1.0, 0.0, pytest.approx(1 / 3)]
    # a rank standing in with weight 0 (short tail batch) reports nothing
    seen = []
    tr._gather = lambda local: (seen.append(local), torch.tensor([[0.5], local], dtype=torch.float64))[1]
    tr.ranks.rank = 1
    assert tr._group_success({**b, "weight": 0.0, "batch": [9]}) == [0.5]
    assert len(seen) == 1 and len(seen[0]) == 1 and math.isnan(seen[0][0])


def test_leave_one_out_removes_the_reward_response_from_p():
    """Two members, m = 4 samples, each with 1 correct of its 3 extra responses; member 0's reward response was
    correct, member 1's wrong, so z favours member 0. The full p credits that same response and shows a positive
    covariance; left out, the members succeed equally and the covariance is 0 (the bias, by construction)."""
    p = [[2 / 4], [1 / 4]]
    first = [[1.0], [0.0]]
    np.testing.assert_allclose(leave_one_out(p, first, 4), [[1 / 3], [1 / 3]])  # (4 p - first) / 3, by hand
    z = [1.0, -1.0]
    m = diversity_metrics(p, z, first, 4)
    assert m["cov_weight"] == pytest.approx(0.5 * (1 * (2 / 4 - 3 / 8) + (-1) * (1 / 4 - 3 / 8)))  # 0.125
    assert m["cov_weight_loo"] == pytest.approx(0.0, abs=1e-15)
    assert "cov_weight_loo" not in diversity_metrics(p, z, first, 1)  # one sample: nothing is left


@pytest.mark.parametrize(
    ("first", "samples", "match"),
    [([[1.0]], 4, "shape"), ([[0.5], [1.0]], 4, "other than 0 and 1"), ([[1.0], [0.0]], 1, "samples >= 2")],
)
def test_leave_one_out_names_bad_inputs(first, samples, match):
    with pytest.raises(ValueError, match=match):
        leave_one_out([[0.25], [0.75]], first, samples)
