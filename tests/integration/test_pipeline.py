"""es -> grpo pipeline with tiny budgets: both stages run, weights flow, MLflow nests the stages; pipelines are
swept like any config."""

import json

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from toy import run_esbatch, toy_config

from esbatch.config import ConfigError, config_from_dict
from esbatch.launch.state import SweepDir
from esbatch.launch.submit import run_states
from esbatch.pipeline import stage_budgets, stage_configs
from esbatch.train.schedule import batch_indices, schedule_start


@pytest.mark.parametrize(
    "total,n,split,want",
    [(300, 2, None, [150, 150]), (5, 2, None, [3, 2]), (10, 2, [0.3, 0.7], [3, 7]), (7, 3, None, [3, 2, 2])],
)
def test_stage_budgets_split_the_total(total, n, split, want):
    assert stage_budgets(total, n, split) == want and sum(want) == total


def test_pipeline_config_errors():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"algorithm": "pipeline", "pipeline": {"stages": ["es", "ppo"], "split": [1]}})
    msg = str(e.value)
    assert "pipeline.stages: expected a list of es / grpo" in msg and "pipeline.updates: set the total" in msg
    assert "pipeline.split: expected 2 positive shares" in msg


def test_stages_continue_one_data_schedule(tmp_path):
    """ES (B=4) -> GRPO (B=4) over 6 updates sees the batches one 6-update run sees: the GRPO stage starts
    where the ES stage stopped (before the fix both stages began at the stream's start with the same seed)."""
    cfg = config_from_dict(
        {
            "algorithm": "pipeline",
            "pipeline": {"stages": ["es", "grpo"], "updates": 6, "split": [1, 2]},
            "es": {"batch_size": 4},
            "grpo": {"batch_size": 4},
        }
    )
    (_, s1), (_, s2) = stage_configs(cfg, tmp_path / "p", None)
    assert s1.run.data_before == [] and s2.run.data_before == [[2, 4]]
    n, seed = 10, cfg.run.seed
    single = [batch_indices(seed, t, n, 4)[1] for t in range(6)]
    es_part = [batch_indices(seed, t, n, 4, schedule_start(n, s1.run.data_before))[1] for t in range(2)]
    grpo_part = [batch_indices(seed, t, n, 4, schedule_start(n, s2.run.data_before))[1] for t in range(4)]
    assert es_part + grpo_part == single


def test_pipelines_are_swept_like_any_config_and_each_stage_starts_from_the_last(tmp_path, tiny_model_dir):
    """A sweep over the stage order: es->grpo and grpo->es, each a pipeline run with nested stages. In the es->grpo
    run (4 updates, split equally) both stages run, the weights and the data stream flow from stage 1 to stage 2,
    MLflow nests the stages under the pipeline's run, and resuming the finished pipeline trains nothing.

    (One sweep for what were two tests, this one and test_es_then_grpo_pipeline, which trained its own es->grpo
    pipeline through `esbatch train`: a second set of process and DeepSpeed starts for what a sweep task runs too.)"""
    base = toy_config(
        tiny_model_dir,
        heldout=2,
        gen_batch=16,
        algorithm="pipeline",
        pipeline={"stages": ["es", "grpo"], "updates": 4},
        grpo={"group_size": 4, "batch_size": 2, "learning_rate": 1e-3},
        eval={"every": 0},
        checkpoint={"every": 2},
    )
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = {
        "name": "order",
        "base": "base.yaml",
        "output_dir": str(tmp_path / "out"),
        "launcher": "local",
        "grid": {"pipeline.stages": [["es", "grpo"], ["grpo", "es"]]},
    }
    (tmp_path / "order.yaml").write_text(yaml.safe_dump(sweep))
    p = run_esbatch("sweep", str(tmp_path / "order.yaml"), timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "2 runs: 2 finished" in p.stdout
    runs = sorted((tmp_path / "out" / "order" / "runs").iterdir())
    stages = sorted(sorted(q.name for q in r.iterdir() if q.is_dir() and q.name.startswith("stage")) for r in runs)
    assert stages == [["stage1-es", "stage2-grpo"], ["stage1-grpo", "stage2-es"]]
    sd = SweepDir(tmp_path / "out" / "order")  # reported like any run: `esbatch status` shows their last reward
    assert [(s.state, s.last_reward is not None) for s in run_states(sd)] == [("finished", True)] * 2
    assert "None: all 2 runs finished" in (sd.results / "README.md").read_text()  # not "needing attention"

    # the es->grpo run
    (rd,) = [r for r in runs if (r / "stage1-es").is_dir()]
    es_log = (rd / "stage1-es" / "log.jsonl").read_text().splitlines()
    grpo_log = (rd / "stage2-grpo" / "log.jsonl").read_text().splitlines()
    assert len(es_log) == 2 and len(grpo_log) == 2  # 4 updates split equally
    # the GRPO stage started from the ES stage's center
    stage2 = yaml.safe_load((rd / "stage2-grpo" / "config.yaml").read_text())
    assert stage2["model"]["init_weights"] == str(rd / "stage1-es" / "center.safetensors")
    assert stage2["run"]["data_before"] == [[2, base["es"]["batch_size"]]]  # the data stream continues
    es_center = load_file(str(rd / "stage1-es" / "center.safetensors"))
    final = load_file(str(rd / "stage2-grpo" / "center.safetensors"))
    assert any(not torch.equal(es_center[k], final[k]) for k in final)
    client = MlflowClient(f"sqlite:///{sd.path / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name("order").experiment_id])
    pipelines = [r for r in found if r.data.tags.get("algorithm") == "pipeline"]
    (parent,) = [r for r in pipelines if r.data.tags.get("esbatch.run_key") == rd.name]
    assert len(pipelines) == 2
    kids = {r.data.tags["algorithm"]: r for r in found if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(kids) == {"es", "grpo"} and parent.info.status == "FINISHED"
    meta, last = (json.loads((d / "run.json").read_text()) for d in (rd, rd / "stage2-grpo"))
    assert meta["status"] == "finished" and meta["last_reward"] == last["last_reward"] is not None  # for status
    # re-running finds both stages finished and trains nothing
    p = run_esbatch("train", "--resume", str(rd), "--no-progress", timeout=300)
    assert p.returncode == 0 and "pipeline stage" not in p.stderr, p.stderr[-3000:]


def test_a_grpo_stage_with_inner_iterations_consumed_one_batch_per_mu_steps(tmp_path):
    """GRPO with mu = 2 over 5 optimizer steps generated batches 0, 1, 2: the ES stage after it starts at batch 3."""
    cfg = config_from_dict(
        {
            "algorithm": "pipeline",
            "pipeline": {"stages": ["grpo", "es"], "updates": 10, "split": [1, 1]},
            "es": {"batch_size": 4},
            "grpo": {"batch_size": 4, "iterations": 2},
        }
    )
    (_, s1), (_, s2) = stage_configs(cfg, tmp_path / "p", None)
    assert s1.grpo.updates == 5 and s2.run.data_before == [[3, 4]]
