"""A resume checks the run's config fingerprint (esbatch/train/fingerprint.py), from the command line: a
hand-edited config.yaml is refused (exit 2) naming the key, old -> new, with every file left as it was; an
allowed change (a budget, eval.every) goes on and is recorded in run.json and as an MLflow tag."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient
from toy import run_esbatch, toy_config

from esbatch.train.fingerprint import FILE


def files(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_edited_config_is_refused_and_an_allowed_change_reaches_mlflow(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = toy_config(tiny_model_dir, es_updates=1, run={"name": "r", "seed": 3, "threads": 1, "output_dir": str(out)})
    cfg["tracking"] = {"uri": f"sqlite:///{out / 'mlflow.db'}"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))
    p = run_esbatch("train", str(tmp_path / "r.yaml"), "--no-progress")
    assert p.returncode == 0, p.stdout + p.stderr
    run = out / "r"
    assert (run / FILE).exists()

    edited = yaml.safe_load((run / "config.yaml").read_text())
    edited["es"]["sigma"] = 0.1
    (run / "config.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    before, db = files(run), (out / "mlflow.db").read_bytes()
    p = run_esbatch("train", "--resume", str(run), "--set", "es.updates=2", "--no-progress")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "es.sigma: 0.05 -> 0.1" in p.stderr and "a resume may change only budgets and bookkeeping" in p.stderr
    assert "es.updates" in p.stderr.split("bookkeeping:")[1]
    assert files(run) == before and (out / "mlflow.db").read_bytes() == db  # nothing was written

    edited["es"]["sigma"] = 0.05  # undone: the resume goes on, with a budget and eval.every changed
    (run / "config.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    p = run_esbatch("train", "--resume", str(run), "--set", "es.updates=2", "--set", "eval.every=1", "--no-progress")
    assert p.returncode == 0, p.stdout + p.stderr
    meta = json.loads((run / "run.json").read_text())
    (rec,) = meta["resumes"]
    assert rec["changed"] == {"es.updates": [1, 2], "eval.every": [0, 1]}
    r = MlflowClient(f"sqlite:///{out / 'mlflow.db'}").get_run(meta["mlflow_run_id"])
    assert r.data.tags["resume.1.changed"] == "es.updates: 1 -> 2; eval.every: 0 -> 1"
    assert r.data.params["es.updates"] == "1"  # params are written once; the tag says what changed
    assert json.loads((run / FILE).read_text())["values"]["es.updates"] == 2  # the next resume compares with 2

    (run / FILE).unlink()  # a folder from before fingerprints: resumed as before, with a note, then recorded
    p = run_esbatch("train", "--resume", str(run), "--no-progress")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr.count("predates config fingerprints") == 1 and (run / FILE).exists()
