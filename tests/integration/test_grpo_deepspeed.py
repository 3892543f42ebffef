"""GRPO through the CLI on DeepSpeed (CPU, gloo): 2 ranks really run; weights change and ranks agree; micro-batches
accumulate through DeepSpeed's gradient accumulation; mu inner iterations resume inside a generated batch."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from toy import run_esbatch


def write_cfg(tmp: Path, model_dir: Path, **grpo) -> Path:
    cfg = {
        "algorithm": "grpo",
        "run": {"name": "g", "seed": 3, "output_dir": str(tmp / "runs"), "threads": 1, "nproc_per_node": 2},
        "model": {"name": str(model_dir), "dtype": "float32"},
        "task": {"name": "toy:DigitTask", "params": {"size": 16}, "heldout_size": 2, "few_shot": 1},
        "generation": {"temperature": 1.0, "max_new_tokens": 6, "batch_size": 16},
        "grpo": {"group_size": 4, "batch_size": 4, "learning_rate": 1e-3, "updates": 2, "zero_stage": 2, **grpo},
        "eval": {"every": 0},
        "checkpoint": {"every": 1},
        "tracking": {"experiment": "grpo"},
    }
    p = tmp / "grpo.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_two_rank_deepspeed_grpo_steps(tmp_path, tiny_model_dir, monkeypatch):
    # beta > 0: a frozen reference and a k3 KL term; 2 prompts x G=4 = 8 sequences per rank in micro-batches
    # of 3, 3, 2: three backward passes accumulated by DeepSpeed (gradient_accumulation_steps 3) per step
    path = write_cfg(tmp_path, tiny_model_dir, beta=0.05, micro_batch_size=3)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # empty, as on a fresh machine
    p = run_esbatch("train", str(path), "--no-progress")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "starting 2 ranks" in out and "done: 2 GRPO steps on 2 rank(s)" in out
    # DeepSpeed's shared-memory op (inference only) was not JIT-built: skip_shm_comm_build
    assert "built successfully" not in out and not list((tmp_path / "ext").rglob("*.so")), out[-2000:]
    rd = tmp_path / "runs" / "g"
    log = [json.loads(x) for x in (rd / "log.jsonl").read_text().splitlines()]
    assert [r["t"] for r in log] == [0, 1]
    for r in log:
        a, b = r["param_checksums"]
        assert a == b  # both ranks hold identical weights after every DeepSpeed step
        m = r["metrics"]
        assert m["policy/entropy"] > 0 and m["grad_norm"] > 0 and 0 <= m["policy/clip_fraction"] <= 1
        assert m["policy/kl"] >= 0
    assert log[0]["param_checksums"][0] != log[1]["param_checksums"][0]  # the second step moved them again
    assert log[1]["metrics"]["policy/kl"] > 0  # after one step the policy differs from the reference
    # the trained policy differs from the initial weights
    from safetensors.torch import load_file as lf

    init = lf(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    final = load_file(str(rd / "center.safetensors"))
    shared = [k for k in final if k in init]
    assert shared and any(not torch.equal(final[k], init[k].float()) for k in shared)
    # the logged drift is ||theta_T - theta_0|| / ||theta_0|| of the saved center against the model file, in float64
    assert set(shared) == set(final)
    num = sum(float((final[k].double() - init[k].double()).square().sum()) for k in shared)
    den = sum(float(init[k].double().square().sum()) for k in shared)
    assert log[-1]["metrics"]["update/rel_distance_from_theta0"] == pytest.approx((num / den) ** 0.5, rel=1e-6)
    assert (
        0 < log[0]["metrics"]["update/rel_distance_from_theta0"] < log[1]["metrics"]["update/rel_distance_from_theta0"]
    )
    # each generated batch records its prompts' success shares p(x): G=4 samples, so multiples of 1/4
    for r in log:
        (p,) = r["diversity"]["p"]
        assert r["diversity"]["samples"] == 4 and len(p) == len(r["diversity"]["batch"])
        assert all(0 <= x <= 1 and (4 * x).is_integer() for x in p)
        assert r["metrics"]["diversity/p_mean"] == pytest.approx(sum(p) / len(p))
    latest = (rd / "ds_checkpoint" / "latest").read_text().strip()
    assert sorted(d.name for d in (rd / "ds_checkpoint").glob("step*")) == [latest]  # older checkpoints deleted
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    for key in (
        "reward/mean",
        "policy/entropy",
        "policy/kl",
        "policy/clip_fraction",
        "grad_norm",
        "tokens/per_s",
        "update/flops",
    ):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2], key


def test_grpo_resume_continues_from_the_deepspeed_checkpoint(tmp_path, tiny_model_dir):
    # mu = 2: steps 0-1 train on batch 0, steps 2-3 on batch 1; the run stops after step 2, inside batch 1
    path = write_cfg(tmp_path, tiny_model_dir, iterations=2, updates=3)
    run = lambda *a: run_esbatch("train", *a, "--no-progress")  # noqa: E731
    p = run(str(path))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    rd = tmp_path / "runs" / "g"
    assert sorted(f.name for f in (rd / "ds_checkpoint" / "step3").glob("grpo_batch_rank*.pt")) == [
        "grpo_batch_rank0.pt",
        "grpo_batch_rank1.pt",
    ]
    p = run("--resume", str(rd), "--set", "grpo.updates=4")  # extend the budget by one step
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    log = [json.loads(x) for x in (rd / "log.jsonl").read_text().splitlines()]
    assert [r["t"] for r in log] == [0, 1, 2, 3]  # steps 0-2 were not redone
    m = [r["metrics"] for r in log]
    assert m[0]["time/generation_s"] > 0 and m[1]["time/generation_s"] == 0  # batch 0 generated once
    # the resumed step 3 trained on batch 1 as stored with the checkpoint, not on a new generation
    assert m[3]["time/generation_s"] == 0 and m[3]["reward/mean"] == m[2]["reward/mean"]
    assert m[2]["policy/clip_fraction"] == 0  # first inner step: ratio 1
    assert log[2]["param_checksums"][0] != log[3]["param_checksums"][0]
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (mr,) = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert sorted(m.step for m in client.get_metric_history(mr.info.run_id, "reward/mean")) == [1, 2, 3, 4]
