"""One ES step through the trainer on the tiny model: the center moves by exactly alpha/N sum z_i s_i eps_i."""

import pytest
import torch
from noise_reference import eps_tensor
from toy import run_page_sections

from esbatch.config import config_from_dict
from esbatch.es.core import normalize
from esbatch.es.replay import replay
from esbatch.es.trainer import es_step
from esbatch.train.problems import load_problems


def _eps(seed, name, shape):
    """The default generator's direction (es.noise: philox-gauss), from the independent numpy reference."""
    return eps_tensor(seed, name, tuple(shape)).double()


def cfg_for(model_dir, **es):
    return config_from_dict(
        {
            "model": {"name": str(model_dir)},
            "task": {"name": "toy:DigitTask", "heldout_size": 0},
            "generation": {"temperature": 1.0, "max_new_tokens": 6},
            "es": {"population_size": 4, "sigma": 0.05, "alpha": 0.02, "batch_size": 3, "updates": 2, **es},
        }
    )


@pytest.mark.parametrize(
    "es",
    [
        {},
        {"normalization": "none"},
        {"normalization": "centered_rank"},
        {"estimator": "antithetic", "generation_seeds": "antithetic_pairs"},
        {"estimator": "antithetic"},
    ],
)
def test_step_applies_the_explicit_update(tiny_model_dir, tiny_backend_factory, es):
    cfg = cfg_for(tiny_model_dir, **es)
    b = tiny_backend_factory()
    probs = load_problems(cfg, b)
    c0 = {n: t.double().clone() for n, t in b.master.items()}
    rec = None
    for t in range(3):  # find an update where rewards differ (random text)
        c0 = {n: x.double().clone() for n, x in b.master.items()}
        rec = es_step(cfg, b, probs, t)
        if len(set(rec["rewards"])) > 1:
            break
    assert len(rec["rewards"]) == 4 and len(set(rec["rewards"])) > 1
    z = normalize(rec["rewards"], cfg.es.normalization, cfg.es.eps_num)
    assert rec["z"] == pytest.approx(z.tolist())
    if cfg.es.estimator == "antithetic":
        assert rec["signs"] == [1, -1, 1, -1] and rec["seeds"][0] == rec["seeds"][1]
        assert (rec["gen_seeds"][0] == rec["gen_seeds"][1]) == (cfg.es.generation_seeds == "antithetic_pairs")
    for name, theta in b.master.items():
        expect = c0[name] + cfg.es.alpha / 4 * sum(
            zi * s * _eps(seed, name, theta.shape) for zi, s, seed in zip(z, rec["signs"], rec["seeds"])
        )
        torch.testing.assert_close(theta.double(), expect, rtol=0, atol=2e-6)


def test_replay_of_the_log_reproduces_the_center_bit_for_bit(tiny_model_dir, tiny_backend_factory):
    cfg = cfg_for(tiny_model_dir)
    a, b = tiny_backend_factory(), tiny_backend_factory()
    probs = load_problems(cfg, a)
    recs = [es_step(cfg, a, probs, t) for t in range(2)]
    replay(b, recs)
    assert all(torch.equal(a.master[n], b.master[n]) for n in a.master)
    assert all(torch.equal(a.params[n], b.params[n]) for n in a.params)


def test_member_reward_is_the_mean_verifier_reward_of_its_perturbed_generations(tiny_model_dir, tiny_backend_factory):
    from esbatch.backends import SamplingParams
    from esbatch.train.problems import reward_of

    cfg = cfg_for(tiny_model_dir)
    b, fresh = tiny_backend_factory(), tiny_backend_factory()
    probs = load_problems(cfg, b)
    rec = es_step(cfg, b, probs, 0)
    sampling = SamplingParams(1.0, 1.0, 6)
    prompts = [probs.train_prompts[i] for i in rec["batch"]]
    for j in range(4):
        fresh.perturb(rec["seeds"][j], rec["signs"][j] * cfg.es.sigma)
        gens = fresh.generate(prompts, sampling, rec["gen_seeds"][j])
        fresh.restore()
        scores = [reward_of(probs.task.score(g.text, probs.train[i]), cfg) for g, i in zip(gens, rec["batch"])]
        assert rec["rewards"][j] == pytest.approx(sum(scores) / len(scores))


def test_update_flops_follow_the_appendix_g2_accounting(tiny_model_dir, tiny_backend_factory):
    from esbatch.train.schedule import batch_indices

    cfg = cfg_for(tiny_model_dir)
    b = tiny_backend_factory()
    probs = load_problems(cfg, b)
    rec = es_step(cfg, b, probs, 0)
    _, idx = batch_indices(cfg.run.seed, 0, len(probs.train), cfg.es.batch_size)
    P = sum(p.numel() for p in b.model.parameters())
    prompt = sum(len(b.tok(probs.train_prompts[i], add_special_tokens=False)["input_ids"]) for i in idx)
    N, gen = cfg.es.population_size, rec["metrics"]["tokens/generated"]
    # 2 P per token forward for N members over the batch (prompt + generated), + perturb/restore 4PN + update 2PN
    assert rec["metrics"]["update/flops"] == pytest.approx(2 * P * (N * prompt + gen) + 6 * P * N, rel=1e-9)

    # on a run's MLflow page held-out metrics (heldout/, from the evals) come first, then an update's own sections,
    # reward first (a flops/ section put FLOPs first, issue 43); the opt-in diagnostics (diversity/) are off here
    sections = run_page_sections(rec["metrics"])
    assert sections[0] == "reward" and min(sections) > "heldout", sections
