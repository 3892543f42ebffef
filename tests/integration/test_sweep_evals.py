"""A sweep with methods and an evaluation phase (paper RQ1's shape): two methods trained from one base, every
final model and the base model evaluated as jobs that start when their training ends, nothing redone on a
re-run, an interrupted eval continued where it stopped, and a raised budget re-evaluating the further-trained
center (the old eval kept aside). Through the local launcher; tests/slurm repeats the dependency on SLURM."""

import json
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient
from toy import run_esbatch, toy_config

EVAL = {
    "name": "toy-suite",
    "sampling": {"n": 4, "temperature": 1.0, "max_new_tokens": 6, "batch_size": 16},
    "ks": [1, 2, 4],
    "tasks": [
        {"name": "toy:DigitTask", "label": "Digits", "params": {"size": 16}, "limit": 6},
        {"name": "toy:DigitTask", "label": "Other", "params": {"size": 24}, "limit": 5},
    ],
}


def write_sweep(tmp: Path, model_dir: Path) -> Path:
    base = toy_config(
        model_dir,
        heldout=0,
        gen_batch=16,
        es_updates=2,
        grpo={"group_size": 4, "batch_size": 2, "learning_rate": 1e-3, "updates": 2},
        eval={"every": 0},
        checkpoint={"every": 1},
    )
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp / "suite.yaml").write_text(yaml.safe_dump(EVAL))
    sweep = {
        "name": "cmp",
        "base": "base.yaml",
        "output_dir": str(tmp / "out"),
        "launcher": "local",
        # two ES variants keep it fast (a GRPO run costs a DeepSpeed start per phase); the machinery does not
        # depend on the algorithm, and GRPO and pipeline sweeps are tested in test_sweep_algorithms.py
        "methods": {"ES": {"algorithm": "es"}, "ES-low-sigma": {"algorithm": "es", "es": {"sigma": 0.01}}},
        "evaluate": {"config": "suite.yaml", "train_task": "Digits"},
    }
    p = tmp / "cmp.yaml"
    p.write_text(yaml.safe_dump(sweep))
    return p


def test_a_sweep_trains_then_evaluates_every_final_and_base_model(tmp_path, tiny_model_dir):
    path = write_sweep(tmp_path, tiny_model_dir)
    p = run_esbatch("sweep", str(path), timeout=1800)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "2 runs and 3 evals" in out and "and 3 eval(s), 2 of them after their run's training" in out, out
    assert "2 runs: 2 finished" in p.stdout and "3 evals: 3 finished" in p.stdout, p.stdout
    sd = tmp_path / "out" / "cmp"
    meta = json.loads((sd / "sweep.json").read_text())
    assert {r["point"]["method"] for r in meta["runs"]} == {"ES", "ES-low-sigma"} and meta["train_task"] == "Digits"
    by_key = {e["key"]: e for e in meta["evals"]}
    (base,) = [e for e in meta["evals"] if e["source"] is None]
    assert base["key"].startswith("base-") and base["point"]["method"] == "Base"
    for e in meta["evals"]:
        m = json.loads((sd / "evals" / e["key"] / "metrics.json").read_text())
        assert set(m["tasks"]) == {"Digits", "Other"}
        assert m["tasks"]["Digits"]["problems"] == 6 and m["tasks"]["Other"]["problems"] == 5
        if e["source"]:  # it evaluated the finished center: 2 updates
            src = json.loads((sd / "evals" / e["key"] / "source.json").read_text())
            assert src == {"run": e["source"], "updates": 2}
    # MLflow: each eval nested under its training run, the base model's under the sweep's parent run
    client = MlflowClient(meta["tracking_uri"])
    exp = client.get_experiment_by_name(meta["experiment"])
    runs = client.search_runs([exp.experiment_id])
    evals = [r for r in runs if r.data.tags.get("esbatch.kind") == "eval"]
    assert len(evals) == 3
    trained = {r.info.run_id: r.data.tags.get("esbatch.run_key") for r in runs}
    parents = sorted(trained.get(r.data.tags["mlflow.parentRunId"]) or "sweep" for r in evals)
    assert parents == sorted([*(e["source"] for e in meta["evals"] if e["source"]), "sweep"])
    assert {r.data.tags["mlflow.parentRunId"] for r in evals} - set(trained) == set()

    again = run_esbatch("sweep", str(path))
    assert "nothing to submit" in again.stdout, again.stdout

    # an eval killed mid-way (no summary yet, a torn last line): the re-run continues it, earlier lines kept; and,
    # in the same re-run, an eval whose source.json is damaged: which center it scored is unknown, so it is redone
    # and the old one kept aside
    ev, other = (k for k, e in by_key.items() if e["source"])
    samples = sd / "evals" / ev / "samples" / "Other.jsonl"
    lines = samples.read_bytes().splitlines(keepends=True)
    (sd / "evals" / ev / "metrics.json").unlink()
    samples.write_bytes(b"".join(lines[:2]) + lines[2][:10])
    (sd / "evals" / other / "source.json").write_text('{"run": ')
    status = run_esbatch("status", str(sd)).stdout
    assert "3 evals: 1 finished, 1 interrupted, 1 stale" in status, status
    p = run_esbatch("sweep", str(path), timeout=1800)
    assert "submitting 0 run(s)" in p.stdout and "and 2 eval(s), 0 of them after" in p.stdout, p.stdout
    assert samples.read_bytes().startswith(b"".join(lines[:2])) and len(samples.read_bytes().splitlines()) == 5
    assert (sd / "evals" / f"{other}.damaged" / "metrics.json").exists()
    assert json.loads((sd / "evals" / other / "source.json").read_text()) == {
        "run": by_key[other]["source"],
        "updates": 2,
    }

    # a raised budget: both runs train on, their evals are redone on the new centers, the old ones kept aside
    p = run_esbatch("sweep", str(path), "--set", "es.updates=3", timeout=1800)
    assert "submitting 2 run(s) (2 resume from their folders)" in p.stdout, p.stdout
    assert "and 2 eval(s), 2 of them after their run's training" in p.stdout, p.stdout
    assert "3 evals: 3 finished" in p.stdout, p.stdout
    for e in meta["evals"]:
        if e["source"]:
            assert json.loads((sd / "evals" / e["key"] / "source.json").read_text())["updates"] == 3
            assert (sd / "evals" / f"{e['key']}.at2" / "metrics.json").exists()
