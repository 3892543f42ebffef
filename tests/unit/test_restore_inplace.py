"""es.restore: inplace (the paper's App. G.1 numerics) against exact restore, on hand-built tensors and the tiny model.

Explicit computations here model "an operation in bfloat16" as PyTorch defines it on CPU and GPU: the operands
(a Python scalar rounded to fp32) combined in fp32, the result rounded to bfloat16, one operation at a time.
Directions are rebuilt by the numpy reference (tests/noise_reference.py), independently of esbatch/perturb/noise.py.
"""

import pytest
import torch
from noise_reference import eps_tensor

from esbatch.config import ConfigError, config_from_dict
from esbatch.perturb import UpdateSpec, weights_for
from esbatch.perturb.update import es_update_inplace

BF16 = torch.bfloat16


def _eps(seed, name, shape):
    """The default generator's direction (es.noise: philox-gauss), from the independent numpy reference."""
    return eps_tensor(seed, name, tuple(shape))


def _r(x):
    """Round an fp32 result to bfloat16 (one bf16 operation's result)."""
    return x.to(BF16)


def _mul(a_bf16, scalar):
    return _r(a_bf16.float() * torch.tensor(scalar, dtype=torch.float32))


def _hand_built(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.w": (torch.randn(64, 48, generator=g) * 0.02).to(BF16),
        "layer.b": (torch.randn(300, generator=g) * 0.02).to(BF16),
    }


def _copy(state):
    return {n: t.clone() for n, t in state.items()}


def test_inplace_perturb_restore_in_bf16_keeps_round_off_exact_returns_the_bits():
    start = _hand_built()
    live_in, live_ex = _copy(start), _copy(start)
    inplace, exact = weights_for(live_in, "inplace"), weights_for(live_ex, "exact")
    sigma = 1e-3
    for w in (inplace, exact):
        w.perturb(7, -sigma)
        w.restore()
    for name, w0 in start.items():
        d = _mul(_eps(7, name, w0.shape).to(BF16), -sigma)
        expect = _r(_r(w0.float() + d.float()).float() - d.float())  # round(round(w0 + d) - d)
        assert torch.equal(live_in[name], expect)
        assert torch.equal(live_ex[name], w0)  # exact: a copy of the fp32 master, bit for bit
    moved = sum(int((live_in[n] != start[n]).sum()) for n in start) / sum(t.numel() for t in start.values())
    assert 0.03 < moved < 0.15  # one cycle at sigma=1e-3 on N(0, 0.02): about 7.5% of elements off


def test_perturbed_weights_are_the_bf16_sum_in_inplace_mode():
    start = _hand_built(1)
    live = _copy(start)
    w = weights_for(live, "inplace")
    w.perturb(11, 0.01)
    for name, w0 in start.items():
        assert torch.equal(live[name], _r(w0.float() + _mul(_eps(11, name, w0.shape).to(BF16), 0.01).float()))
    with pytest.raises(RuntimeError, match="restore first"):
        w.perturb(12, 0.01)


def test_32_cycles_at_sigma_1e3_move_about_half_of_the_bf16_weights():
    """The issue's toy check (benchmarks/inplace_roundoff.py prints it: 49.1% of 1M weights)."""
    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(200_000, generator=g) * 0.02).to(BF16)
    live = {"w": w0.clone()}
    w = weights_for(live, "inplace", track_drift=False)
    for k in range(32):
        w.perturb(1000 + k, 1e-3)
        w.restore()
    moved = float((live["w"] != w0).double().mean())
    assert 0.46 < moved < 0.52, moved


def test_inplace_update_equals_the_explicit_bf16_computation():
    start = _hand_built(2)
    live = _copy(start)
    spec = UpdateSpec(seeds=[3, 5, 9, 4], weights=[0.7, -1.3, 0.0, 0.25], alpha=0.01, n=3)
    l2, changed = es_update_inplace(live, spec)
    sq = moved = total = 0
    for name, w0 in start.items():
        acc = torch.zeros(w0.shape, dtype=BF16)
        for seed, wi in zip(spec.seeds, spec.weights):
            if wi != 0.0:
                acc = _r(acc.float() + _mul(_eps(seed, name, w0.shape).to(BF16), wi).float())
        step = _mul(acc, 0.01 / 3)
        expect = _r(w0.float() + step.float())
        assert torch.equal(live[name], expect)
        sq += float(step.double().square().sum())
        moved += int((expect != w0).sum())
        total += w0.numel()
    assert l2 == pytest.approx(sq**0.5, rel=1e-12)
    assert changed == moved / total and 0 < changed < 1
    # the fp32-accumulated exact update rounds once, so the two modes land on different bf16 weights
    exact_live = _copy(start)
    weights_for(exact_live, "exact").update(spec)
    assert any(not torch.equal(exact_live[n], live[n]) for n in start)


def test_inplace_update_skips_nothing_it_should_not_and_a_zero_step_changes_nothing():
    start = _hand_built(3)
    for spec in (
        UpdateSpec(seeds=[3, 5], weights=[0.7, -1.3], alpha=0.0, n=2),  # alpha = 0
        UpdateSpec(seeds=[3, 5], weights=[0.0, 0.0], alpha=0.01, n=2),  # zero rewards: every z_i = 0
    ):
        live = _copy(start)
        l2, changed = es_update_inplace(live, spec)
        assert l2 == 0.0 and changed == 0.0
        assert all(torch.equal(live[n], start[n]) for n in start)


@pytest.mark.parametrize("restore", ["exact", "inplace"])
def test_a_zero_update_after_a_population_moves_weights_by_round_off_only(restore):
    """alpha = 0 (or all-equal rewards): exact leaves the center bit-identical; inplace keeps exactly the
    round-off of the population's perturb/restore cycles."""
    start = _hand_built(4)
    live = _copy(start)
    w = weights_for(live, restore)
    members = [(21, 1), (22, 1), (23, -1), (24, 1)]
    for seed, sign in members:
        w.perturb(seed, sign * 1e-3)
        w.restore()
    after_cycles = _copy(live)
    w.update(UpdateSpec(seeds=[s for s, _ in members], weights=[0.5, -0.5, 1.0, -1.0], alpha=0.0, n=4))
    assert all(torch.equal(live[n], after_cycles[n]) for n in start)  # the update itself added nothing
    moved = sum(int((live[n] != start[n]).sum()) for n in start)
    if restore == "exact":
        assert moved == 0 and w.rel_distance() == 0.0
    else:
        expect = _copy(start)  # the same four cycles computed explicitly
        for seed, sign in members:
            for name, x in expect.items():
                d = _mul(_eps(seed, name, x.shape).to(BF16), sign * 1e-3).float()
                expect[name] = _r(_r(x.float() + d).float() - d)
        assert all(torch.equal(live[n], expect[n]) for n in start)
        assert moved > 0 and 0 < w.rel_distance() < 1e-2


def _backend(model_dir, restore):
    from esbatch.backends.hf import HFBackend
    from esbatch.models import load_model_and_tokenizer

    return HFBackend(*load_model_and_tokenizer(str(model_dir), dtype="bfloat16"), batch_size=8, restore=restore)


def test_inplace_mode_keeps_no_master_and_checkpoints_the_live_dtype(tiny_model_dir):
    exact, b = _backend(tiny_model_dir, "exact"), _backend(tiny_model_dir, "inplace")
    assert b.master is None and b.restore_mode == "inplace"
    mem = b.memory_report()
    assert mem["master_bytes"] == 0 and mem["theta0_bytes"] == 2 * mem["model_bytes"]  # fp32 theta_0 only
    assert exact.memory_report()["master_bytes"] == 2 * mem["model_bytes"]
    b.perturb(5, 0.01)
    b.restore()
    state = b.center_state_dict()
    assert all(t.dtype == BF16 and torch.equal(t, b.params[n]) for n, t in state.items())
    fresh = _backend(tiny_model_dir, "inplace")
    assert any(not torch.equal(p, state[n]) for n, p in fresh.params.items())  # the cycle moved some weights
    fresh.load_center(state)
    assert all(torch.equal(p, state[n]) for n, p in fresh.params.items()) and fresh.checksum() == b.checksum()


# ----------------------------------------------------------------------------- the step, replay and resume


def _cfg(model_dir, tmp_path, restore, **es):
    from toy import toy_config

    d = toy_config(model_dir, heldout=0, eval={"every": 0})
    d["run"] = {**d["run"], "output_dir": str(tmp_path / "runs")}
    d["model"]["dtype"] = "bfloat16"
    d["es"] = {**d["es"], "sigma": 0.01, "alpha": 0.005, "restore": restore, **es}
    return d


@pytest.mark.parametrize("restore", ["exact", "inplace"])
def test_an_alpha_zero_step_on_the_tiny_model(tmp_path, tiny_model_dir, restore):
    from esbatch.es.trainer import es_step
    from esbatch.train.problems import load_problems

    cfg = config_from_dict(_cfg(tiny_model_dir, tmp_path, restore, alpha=0.0, updates=1))
    b = _backend(tiny_model_dir, restore)
    start = {n: p.detach().clone() for n, p in b.params.items()}
    rec = es_step(cfg, b, load_problems(cfg, b), 0)
    moved = sum(int((p != start[n]).sum()) for n, p in b.params.items())
    assert rec["sigma"] == 0.01 and rec["metrics"]["update/changed_fraction"] == 0.0
    if restore == "exact":
        assert moved == 0
    else:
        assert moved > 0 and rec["metrics"]["update/rel_distance_from_theta0"] > 0


def _center(run_dir):
    from esbatch.train.rundir import RunDir

    state, t = RunDir(run_dir).load_center()
    return state, t


# ----------------------------------------------------------------------------- configuration


def test_restore_is_exact_by_default_and_an_unknown_value_lists_the_valid_ones(tmp_path, tiny_model_dir):
    assert config_from_dict(_cfg(tiny_model_dir, tmp_path, "exact", updates=1)).es.restore == "exact"
    d = _cfg(tiny_model_dir, tmp_path, "exact", updates=1)
    del d["es"]["restore"]
    assert config_from_dict(d).es.restore == "exact"
    with pytest.raises(ConfigError) as e:
        config_from_dict(_cfg(tiny_model_dir, tmp_path, "in_place", updates=1))
    msg = str(e.value)
    assert "es.restore" in msg and "exact" in msg and "inplace" in msg
    with pytest.raises(ValueError, match="valid: exact, inplace"):
        weights_for({}, "fp32")


def test_inplace_runs_on_vllm_and_several_processes_but_not_with_a_second_diversity_pass(tmp_path, tiny_model_dir):
    d = _cfg(tiny_model_dir, tmp_path, "inplace", updates=1)
    for extra in ({"backend": {"name": "vllm"}}, {"run": {**d["run"], "nproc_per_node": 2}}):
        assert config_from_dict({**d, **extra}).es.restore == "inplace"
    with pytest.raises(ConfigError) as e:
        config_from_dict({**d, "es": {**d["es"], "diversity": {"every": 2, "samples": 2}}})
    assert any("es.restore: inplace" in line and "second pass" in line for line in e.value.errors), e.value


def test_alpha_zero_is_valid_and_negative_alpha_is_not(tmp_path, tiny_model_dir):
    assert config_from_dict(_cfg(tiny_model_dir, tmp_path, "inplace", alpha=0.0, updates=1)).es.alpha == 0.0
    with pytest.raises(ConfigError, match="es.alpha"):
        config_from_dict(_cfg(tiny_model_dir, tmp_path, "inplace", alpha=-0.1, updates=1))
