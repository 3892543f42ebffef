"""HF backend on a tiny random Llama: bit-exact restore, perturbation values, fp32 master, generation."""

import pytest
import torch

from esbatch.backends import PerturbedMember, SamplingParams
from esbatch.perturb.noise import direction
from esbatch.perturb.update import UpdateSpec


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
        b.update(UpdateSpec([1], [1.0], 0.1, 2))
    b.restore()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_population_goes_member_to_member_with_one_restore_and_the_same_answers(tiny_backend_factory, dtype):
    """es.restore: exact: evaluate_population perturbs each member straight from the last one (perturb() rewrites
    every weight from the fp32 center) and restores once at the end; the answers equal those of
    perturb / generate / restore per member, and the weights end on the center bit for bit."""
    a, b = tiny_backend_factory(dtype), tiny_backend_factory(dtype)
    center = snapshot(a)
    members = [PerturbedMember(*m) for m in [(11, 0.05, 3), (11, -0.05, 3), (12, 0.05, 4), (13, 0.05, 5)]]
    prompts = ["12 + 7 =", "hello"]
    s = SamplingParams(temperature=1.0, max_new_tokens=6)
    restores = []
    real_restore = a.weights.restore
    a.weights.restore = lambda: (restores.append(1), real_restore())[1]
    out = a.evaluate_population(members, prompts, s)
    want = []
    for seed, scale, gen_seed in members:
        b.perturb(seed, scale)
        want.append([g.text for g in b.generate(prompts, s, gen_seed)])
        b.restore()
    assert [[g.text for g in gens] for gens in out.generations] == want
    assert len(restores) == 1 and not a.perturbed and all(torch.equal(p, center[n]) for n, p in a.params.items())
    assert a.chains_members and out.perturb_restore_s > 0


def test_update_moves_master_and_live_weights(tiny_backend_factory):
    b = tiny_backend_factory()
    c0 = {n: t.clone() for n, t in b.master.items()}
    stats = b.update(UpdateSpec([10, 20], [1.0, -1.0], 0.02, 2))
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
    stats = b.update(UpdateSpec([3], [1.0], 1e-6, 1))
    assert stats.changed_fraction < 0.05  # the live bf16 weights barely move ...
    moved = sum(int((b.master[n] != master0[n]).sum()) for n in b.master)
    assert moved / sum(t.numel() for t in b.master.values()) > 0.95  # ... but the master does
    for _ in range(400):  # and many small steps add up in the live weights
        b.update(UpdateSpec([3], [1.0], 1e-6, 1))
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
    b.update(UpdateSpec([1], [1.0], 0.1, 1))
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


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_token_entropy_equals_an_explicit_forward_pass(tiny_backend_factory, temperature):
    """The meter's per-response mean entropy == H(softmax(logits / T)) recomputed from a full forward pass."""
    from transformers import GenerationConfig, LogitsProcessorList

    from esbatch.backends.hf import _EntropyMeter

    b = tiny_backend_factory()
    prompt = b.chat_prompt([{"role": "user", "content": "what is 22+7?"}])
    n = 1 if temperature == 0 else 3
    s = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=10, n=n, entropy=True)
    gens = b.generate([prompt], s, seed=5)
    assert len(gens) == n and all(g.entropy is not None and g.entropy > 0 for g in gens)

    # the same call by hand, keeping the token ids
    enc = b.tok([prompt], return_tensors="pt", add_special_tokens=False)
    greedy = temperature == 0
    gcfg = GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=None if greedy else 1.0,
        top_k=None if greedy else 0,
        max_new_tokens=10,
        pad_token_id=b.tok.pad_token_id,
        eos_token_id=b.eos_ids,
        num_return_sequences=n,
    )
    torch.manual_seed(5)
    meter = _EntropyMeter(b.eos_ids, temperature)
    seqs = b.model.generate(**enc, generation_config=gcfg, logits_processor=LogitsProcessorList([meter]))
    assert meter.means() == [g.entropy for g in gens]  # same seed, same samples, same numbers
    L = enc["input_ids"].shape[1]
    with torch.no_grad():
        logits = b.model(input_ids=seqs).logits.double()
    for r in range(n):
        gen = seqs[r, L:].tolist()
        stop = next((k + 1 for k, t in enumerate(gen) if t in b.eos_ids), len(gen))
        hs = []
        for k in range(stop):
            lp = torch.log_softmax(logits[r, L - 1 + k] / (temperature or 1.0), -1)
            hs.append(float(-(lp.exp() * lp).sum()))
        assert gens[r].entropy == pytest.approx(sum(hs) / len(hs), rel=1e-4, abs=1e-5)
        assert gens[r].n_tokens == stop


def test_n_samples_per_prompt_are_prompt_major_and_batched(tiny_backend_factory):
    b = tiny_backend_factory()  # batch_size 8: 4 samples x 2 prompts per generate() call
    prompts = [b.chat_prompt([{"role": "user", "content": q}]) for q in ("1", "2", "3")]
    gens = b.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, n=4), seed=0)
    assert len(gens) == 12
    with pytest.raises(ValueError, match="greedy"):
        b.generate(prompts, SamplingParams(temperature=0.0, n=2), seed=0)
