"""The cost plan's GRPO weight syncs (esbatch/launch/cost.py:weight_syncs): one per generated batch, every
parameter in the engine's dtype, at the rate of the device kind and the transport (in_process, rpc, ipc); only
GRPO on vLLM."""

from __future__ import annotations

import pytest

from esbatch.config import config_from_dict
from esbatch.launch.cost import SYNC_RATES, weight_syncs


def grpo(
    backend: str = "vllm",
    engine: str = "in_process",
    dtype: str = "float32",
    updates: int = 6,
    mu: int = 2,
    transfer: str = "auto",
):
    return config_from_dict(
        {
            "algorithm": "grpo",
            "model": {"name": "qwen2.5-7b-instruct", "dtype": dtype},
            "backend": {"name": backend, "policy_engine": engine, "weight_transfer": transfer},
            "grpo": {"updates": updates, "iterations": mu},
        }
    )


@pytest.mark.parametrize(
    "device, engine, transfer, transport",
    [
        ("cpu", "in_process", "auto", "in_process"),
        ("cpu", "separate", "auto", "rpc"),
        ("cpu", "separate", "rpc", "rpc"),
        ("h100", "in_process", "auto", "in_process"),
        ("h100", "separate", "auto", "ipc"),
        ("h100", "separate", "rpc", "rpc"),
    ],
)
def test_one_sync_per_generated_batch_at_the_rate_of_the_transport(device, engine, transfer, transport):
    P = 10**9
    cfg = grpo(engine=engine, dtype="bfloat16", transfer=transfer)
    what, seconds = weight_syncs(cfg, P, device, devices=2)
    gbps, source = SYNC_RATES["cpu" if device == "cpu" else "gpu", transport]
    per_param = 4 if device == "cpu" else 2  # CPU trains in fp32 whatever model.dtype says
    assert seconds == pytest.approx(2 * 3 * P * per_param / (gbps * 2**30))  # 6 steps at mu 2: 3 batches, 2 GPUs
    assert "weight syncs 3 x" in what and source in what and f"({transport};" in what
    assert ("assumed" in source) == (device != "cpu") and ("measured" in source) == (device == "cpu")


def test_the_transports_have_distinct_rates_and_ipc_has_none_on_cpu():
    """Each transport is costed at its own rate (a plan that keyed by policy_engine alone would price ipc as
    rpc); ipc on a CPU plan has no sync line: the sweep refuses it before the plan (test_cost_plan.py)."""
    gpu = {t: SYNC_RATES["gpu", t][0] for t in ("in_process", "rpc", "ipc")}
    assert gpu["rpc"] < gpu["ipc"] < gpu["in_process"]
    assert SYNC_RATES["cpu", "rpc"][0] < SYNC_RATES["cpu", "in_process"][0] and ("cpu", "ipc") not in SYNC_RATES
    assert weight_syncs(grpo(engine="separate", transfer="ipc"), 10**6, "cpu") is None


def test_only_grpo_on_vllm_has_syncs():
    assert weight_syncs(grpo(backend="hf"), 10**6, "cpu") is None
    assert weight_syncs(config_from_dict({"algorithm": "es", "es": {"updates": 3}}), 10**6, "cpu") is None
    assert weight_syncs(grpo(), None, "cpu") is None  # parameters unknown: said elsewhere in the plan
