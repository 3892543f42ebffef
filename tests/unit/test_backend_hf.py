"""HF backend on a tiny random Llama: bit-exact restore, perturbation values, fp32 master, generation."""

import pytest
import torch

from esbatch.backends import SamplingParams
from esbatch.es.noise import direction


def snapshot(backend):
    return {n: p.detach().clone() for n, p in backend.params.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_perturb_then_restore_is_bit_exact(tiny_backend_factory, dtype):
    b = tiny_backend_factory(dtype)
    before = snapshot(b)
    for seed in (1, 2, 3, 2**32 - 1):
        b.perturb(seed, 0.01)
        assert any(not torch.equal(p, before[n]) for n, p in b.params.items())
        b.restore()
    assert all(torch.equal(p, before[n]) for n, p in b.params.items())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_perturbation_is_center_plus_scaled_direction_rounded_once(tiny_backend_factory, dtype):
    b = tiny_backend_factory(dtype)
    center = {n: t.clone() for n, t in b.master.items()}
    b.perturb(77, -0.05)
    for name, p in b.params.items():
        expect = (center[name] - 0.05 * direction(77, name, p.shape)).to(p.dtype)
        assert torch.equal(p, expect), name
    b.restore()


def test_every_parameter_tensor_is_perturbed_including_tied_embeddings(tiny_backend_factory):
    b = tiny_backend_factory()
    before = snapshot(b)
    b.perturb(5, 1e-3)
    changed = {n for n, p in b.params.items() if not torch.equal(p, before[n])}
    assert changed == set(b.params)
    assert b.model.lm_head.weight.data_ptr() == b.model.model.embed_tokens.weight.data_ptr()
    b.restore()


def test_double_perturb_and_update_while_perturbed_are_refused(tiny_backend_factory):
    b = tiny_backend_factory()
    b.perturb(1, 0.1)
    with pytest.raises(RuntimeError, match="restore"):
        b.perturb(2, 0.1)
    with pytest.raises(RuntimeError, match="restore"):
        b.update([1], [1.0], 0.1, 2)
    b.restore()


def test_update_moves_master_and_live_weights(tiny_backend_factory):
    b = tiny_backend_factory()
    c0 = {n: t.clone() for n, t in b.master.items()}
    stats = b.update([10, 20], [1.0, -1.0], 0.02, 2)
    for name, p in b.params.items():
        delta = 0.01 * (direction(10, name, p.shape) - direction(20, name, p.shape))
        torch.testing.assert_close(b.master[name], c0[name] + delta, rtol=0, atol=1e-7)
        assert torch.equal(p, b.master[name])
    assert stats.changed_fraction > 0.99
    theta0_norm = sum(float(t.square().sum()) for t in c0.values()) ** 0.5
    assert stats.rel_distance == pytest.approx(stats.update_l2 / theta0_norm)


def test_bf16_small_updates_accumulate_in_fp32_master(tiny_backend_factory):
    """A 1e-6 step is below a bf16 ulp for most weights: without the fp32 master it would be lost."""
    b = tiny_backend_factory("bfloat16")
    live0, master0 = snapshot(b), {n: t.clone() for n, t in b.master.items()}
    stats = b.update([3], [1.0], 1e-6, 1)
    assert stats.changed_fraction < 0.05  # the live bf16 weights barely move ...
    moved = sum(int((b.master[n] != master0[n]).sum()) for n in b.master)
    assert moved / sum(t.numel() for t in b.master.values()) > 0.95  # ... but the master does
    for _ in range(400):  # and many small steps add up in the live weights
        b.update([3], [1.0], 1e-6, 1)
    changed = sum(int((p != live0[n]).sum()) for n, p in b.params.items())
    assert changed / sum(p.numel() for p in b.params.values()) > 0.3


def test_generation_is_reproducible_per_seed_and_greedy_is_deterministic(tiny_backend_factory):
    b = tiny_backend_factory()
    prompts = [b.chat_prompt([{"role": "user", "content": q}]) for q in ("1+1", "what is 22+7?", "hi")]
    s = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12)
    a1, a2, other = b.generate(prompts, s, 1), b.generate(prompts, s, 1), b.generate(prompts, s, 2)
    assert [g.text for g in a1] == [g.text for g in a2]
    assert [g.text for g in a1] != [g.text for g in other]
    assert all(1 <= g.n_tokens <= 12 for g in a1)
    g = SamplingParams(temperature=0.0, max_new_tokens=8)
    assert [x.text for x in b.generate(prompts, g, 1)] == [x.text for x in b.generate(prompts, g, 99)]


def test_left_padding_batch_equals_one_by_one_greedy(tiny_backend_factory):
    b = tiny_backend_factory()
    prompts = [b.chat_prompt([{"role": "user", "content": q}]) for q in ("1", "a much longer question here")]
    g = SamplingParams(temperature=0.0, max_new_tokens=6)
    batched = [x.text for x in b.generate(prompts, g, 0)]
    single = [b.generate([p], g, 0)[0].text for p in prompts]
    assert batched == single


def test_load_center_and_export(tiny_backend_factory, tmp_path):
    b = tiny_backend_factory()
    b.update([1], [1.0], 0.1, 1)
    state = b.center_state_dict()
    fresh = tiny_backend_factory()
    fresh.load_center(state)
    assert all(torch.equal(p, b.params[n]) for n, p in fresh.params.items())
    fresh.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").exists()


def test_memory_report_counts_master_and_theta0(tiny_backend_factory):
    b = tiny_backend_factory("bfloat16")
    r = b.memory_report()
    assert r["master_bytes"] == 2 * r["model_bytes"] == r["theta0_bytes"]
    assert tiny_backend_factory("float32", track_drift=False).memory_report()["theta0_bytes"] == 0
