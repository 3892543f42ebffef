"""ES population and step checked against values written out by hand, not against a second run of the code.

- every member is evaluated at center + sign * sigma * eps(seed): antithetic members at -sigma (a backend double
  records the (seed, scale) of each evaluation; on the tiny model the perturbed weights are re-derived with the
  explicit eps formula);
- generation seeds (and direction seeds) change with the update t and the run seed.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from noise_reference import eps_tensor

from esbatch.backends.base import ESBackend, Generation, UpdateStats
from esbatch.config import config_from_dict
from esbatch.es.core import draw_population
from esbatch.es.trainer import es_step
from esbatch.tasks import Verdict
from esbatch.tasks.verify import ScoringError, guarded
from esbatch.train.problems import load_problems

SIGMA = 0.05


def _eps(seed, name, shape):
    """The default generator's direction (es.noise: philox-gauss), from the independent numpy reference."""
    return eps_tensor(seed, name, tuple(shape)).double()


def _cfg(model="nobody/no-model", **es):  # a hub id: never loaded by the double
    return config_from_dict(
        {
            "run": {"seed": 11},
            "model": {"name": str(model)},
            "task": {"name": "toy:DigitTask", "heldout_size": 0},
            "generation": {"temperature": 1.0, "max_new_tokens": 6},
            "es": {"population_size": 4, "sigma": SIGMA, "alpha": 0.02, "batch_size": 3, "updates": 4, **es},
        }
    )


class RecordingBackend(ESBackend):
    """An ES backend double without a model: it records each perturbation and generation seed, and answers
    every prompt with all ten digits (the toy task's CORRECT) when perturbed upward, with nothing (MISSING)
    when perturbed downward."""

    def __init__(self) -> None:
        self.perturbs: list[tuple[int, float]] = []
        self.gen_seeds: list[int] = []
        self.specs = []
        self.scale = 0.0

    @classmethod
    def for_es(cls, cfg):
        return cls()

    def chat_prompt(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts, sampling, seed):
        self.gen_seeds.append(seed)
        text = "0123456789" if self.scale > 0 else ""
        return [Generation(text, 3) for _ in prompts]

    def perturb(self, seed, scale):
        assert self.scale == 0.0, "perturb without restore"
        self.perturbs.append((seed, scale))
        self.scale = scale

    def restore(self):
        self.scale = 0.0

    def update(self, spec):
        self.specs.append(spec)
        return UpdateStats(0.0, 0.0)

    def center_state_dict(self):
        return {}

    def load_center(self, state):
        pass

    def save_pretrained(self, path):
        pass


def test_antithetic_members_are_evaluated_at_plus_then_minus_sigma():
    cfg = _cfg(estimator="antithetic")
    b = RecordingBackend()
    rec = es_step(cfg, b, load_problems(cfg, b), 0)
    s0, s1 = rec["seeds"][0], rec["seeds"][2]
    assert s0 != s1
    assert rec["signs"] == [1, -1, 1, -1]
    assert rec["seeds"] == [s0, s0, s1, s1]
    # what the backend was actually asked to evaluate: +sigma then -sigma of each direction
    assert b.perturbs == [(s0, SIGMA), (s0, -SIGMA), (s1, SIGMA), (s1, -SIGMA)]
    # +sigma answers correctly (reward 1), -sigma says nothing (reward 0): z = +-0.5 / (0.5 + 1e-8)
    assert rec["rewards"] == [1.0, 0.0, 1.0, 0.0]
    z = 0.5 / (0.5 + 1e-8)
    assert rec["z"] == pytest.approx([z, -z, z, -z], rel=1e-12)
    (spec,) = b.specs
    assert list(spec.seeds) == [s0, s1]
    assert list(spec.weights) == pytest.approx([2 * z, 2 * z], rel=1e-12)  # w = z(+) - z(-)


def test_one_point_members_are_all_evaluated_at_plus_sigma():
    cfg = _cfg(estimator="one_point")
    b = RecordingBackend()
    rec = es_step(cfg, b, load_problems(cfg, b), 0)
    assert len(set(rec["seeds"])) == 4 and rec["signs"] == [1, 1, 1, 1]
    assert b.perturbs == [(s, SIGMA) for s in rec["seeds"]]
    assert rec["rewards"] == [1.0, 1.0, 1.0, 1.0]


def test_generation_seeds_used_by_the_step_change_with_t():
    cfg = _cfg(generation_seeds="independent")
    b = RecordingBackend()
    probs = load_problems(cfg, b)
    per_t = []
    for t in range(3):
        b.gen_seeds.clear()
        rec = es_step(cfg, b, probs, t)
        assert b.gen_seeds == rec["gen_seeds"]  # the logged seeds are the ones generated with
        assert len(set(b.gen_seeds)) == 4  # independent: one per member
        per_t.append(set(b.gen_seeds))
    assert not (per_t[0] & per_t[1]) and not (per_t[1] & per_t[2]) and not (per_t[0] & per_t[2])


@pytest.mark.parametrize(
    "estimator, mode",
    [("one_point", "independent"), ("one_point", "population")]
    + [("antithetic", m) for m in ("independent", "antithetic_pairs", "population")],
)
def test_draw_population_matches_the_explicit_formula_and_varies_with_t(estimator, mode):
    n, run_seed = 6, 5
    seen_gens, seen_dirs = [], []
    for t in range(4):
        members = draw_population(run_seed, t, n, estimator, mode)
        n_dirs = n // 2 if estimator == "antithetic" else n
        dirs = np.random.default_rng([run_seed, t, 0xE5]).integers(0, 2**32, size=n_dirs, dtype=np.uint64)
        gens = np.random.default_rng([run_seed, t, 0x6E]).integers(0, 2**31, size=n, dtype=np.uint64)
        if estimator == "antithetic":
            want_seeds = [int(d) for d in dirs for _ in (0, 1)]
            want_signs = [1, -1] * (n // 2)
        else:
            want_seeds, want_signs = [int(d) for d in dirs], [1] * n
        want_gens = {
            "independent": [int(g) for g in gens],
            "antithetic_pairs": [int(gens[2 * (j // 2)]) for j in range(n)],
            "population": [int(gens[0])] * n,
        }[mode]
        assert [m.seed for m in members] == want_seeds
        assert [m.sign for m in members] == want_signs
        assert [m.gen_seed for m in members] == want_gens
        seen_gens.append(set(want_gens))
        seen_dirs.append(set(want_seeds))
    for a in range(4):
        for c in range(a + 1, 4):
            assert not (seen_gens[a] & seen_gens[c]), f"generation seeds repeat between t={a} and t={c}"
            assert not (seen_dirs[a] & seen_dirs[c]), f"direction seeds repeat between t={a} and t={c}"
    # and with the run seed
    other = draw_population(run_seed + 1, 0, n, estimator, mode)
    assert {m.gen_seed for m in other}.isdisjoint(seen_gens[0])
    assert {m.seed for m in other}.isdisjoint(seen_dirs[0])


def test_perturbed_tiny_model_weights_are_center_plus_sign_sigma_eps(tiny_model_dir, tiny_backend_factory):
    cfg = _cfg(tiny_model_dir, estimator="antithetic", generation_seeds="antithetic_pairs")
    b = tiny_backend_factory()
    probs = load_problems(cfg, b)
    c0 = {n: x.double().clone() for n, x in b.master.items()}
    seen = []
    real_generate = b.generate

    def generate(prompts, sampling, seed):  # the weights each member generates with
        seen.append({n: b.params[n].double().clone() for n in c0})
        return real_generate(prompts, sampling, seed)

    b.generate = generate
    rec = es_step(cfg, b, probs, 0)
    assert len(seen) == 4 and rec["signs"] == [1, -1, 1, -1]
    for i, (sign, seed) in enumerate(zip([1, -1, 1, -1], rec["seeds"])):
        for name, c in c0.items():
            want = c + sign * SIGMA * _eps(seed, name, c.shape)
            torch.testing.assert_close(seen[i][name], want, rtol=0, atol=2e-6, msg=f"member {i} {name}")


@pytest.mark.parametrize(
    ("limit", "stops"),
    [(0.0, True), (0.5, False), (0.49, True), (1.0, False)],  # half the 12 responses raise: 0.5 is at the limit
)
def test_a_verifier_that_raises_is_counted_and_stops_the_run_past_its_limit(limit, stops):
    """The scorer raises on every response of the members perturbed upward (half of the N x B): each is scored
    WRONG and counted; above reward.max_score_errors the update stops before it is applied, naming the task."""
    cfg = _cfg(estimator="antithetic")
    cfg.reward.max_score_errors = limit
    b = RecordingBackend()
    probs = load_problems(cfg, b)
    task = probs.task

    def fragile(response, ex):
        if response:
            raise ValueError("cannot parse " + response[:4])
        return type(task).score(task, response, ex)

    task.score = guarded(SimpleNamespace(score=fragile), "score", Verdict.WRONG, probs.errors.add)  # as load_problems
    if stops:
        with pytest.raises(ScoringError) as e:
            es_step(cfg, b, probs, 0)
        msg = str(e.value)
        assert "task toy:DigitTask: its verifier raised on 6 of the 12 responses" in msg
        assert f"reward.max_score_errors = {limit:g}" in msg and "ValueError: cannot parse 0123" in msg
        assert b.specs == []  # nothing applied: a resume redoes this update
    else:
        rec = es_step(cfg, b, probs, 0)
        assert (rec["metrics"]["score/errors"], rec["metrics"]["score/error_rate"]) == (6.0, 0.5)
        assert len(b.specs) == 1 and rec["rewards"] == pytest.approx([0.1, 0.0, 0.1, 0.0])  # raised -> WRONG (0.1)
