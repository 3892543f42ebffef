"""The cost plan's GRPO weight syncs (esbatch/launch/cost.py:weight_syncs): one per generated batch, every
parameter in the engine's dtype, at the rate of the device kind and backend.policy_engine; only GRPO on vLLM."""

from __future__ import annotations

import pytest

from esbatch.config import config_from_dict
from esbatch.launch.cost import SYNC_RATES, weight_syncs


def grpo(backend: str = "vllm", engine: str = "in_process", dtype: str = "float32", updates: int = 6, mu: int = 2):
    return config_from_dict(
        {
            "algorithm": "grpo",
            "model": {"name": "qwen2.5-7b-instruct", "dtype": dtype},
            "backend": {"name": backend, "policy_engine": engine},
            "grpo": {"updates": updates, "iterations": mu},
        }
    )


@pytest.mark.parametrize("device, engine", [("cpu", "in_process"), ("cpu", "separate"), ("h100", "in_process")])
def test_one_sync_per_generated_batch_at_the_rate_of_the_engine_placement(device, engine):
    P = 10**9
    what, seconds = weight_syncs(grpo(engine=engine, dtype="bfloat16"), P, device, devices=2)
    gbps, source = SYNC_RATES["cpu" if device == "cpu" else "gpu", engine]
    per_param = 4 if device == "cpu" else 2  # CPU trains in fp32 whatever model.dtype says
    assert seconds == pytest.approx(2 * 3 * P * per_param / (gbps * 2**30))  # 6 steps at mu 2: 3 batches, 2 GPUs
    assert "weight syncs 3 x" in what and source in what and engine in what
    assert ("assumed" in source) == (device != "cpu") and ("measured" in source) == (device == "cpu")


def test_only_grpo_on_vllm_has_syncs():
    assert weight_syncs(grpo(backend="hf"), 10**6, "cpu") is None
    assert weight_syncs(config_from_dict({"algorithm": "es", "es": {"updates": 3}}), 10**6, "cpu") is None
    assert weight_syncs(grpo(), None, "cpu") is None  # parameters unknown: said elsewhere in the plan
