"""A sweep's threshold phase end to end through the local launcher (paper Figure 4's shape, one tiny ES run and two
taus): after the training, each tau's thresholded checkpoint is written and evaluated, the final model is evaluated
as the tau-0 anchor, and the aggregator's threshold_curve CSV holds exactly the s_tau of each s_tau.json and the
Pass@1 of each eval's record; a re-run submits nothing and writes no checkpoint again."""

import csv
import io
import json
import os

import yaml
from mlflow.tracking import MlflowClient
from toy import ROOT, toy_config

from esbatch.aggregate.collect import aggregate
from esbatch.launch.submit import submit_sweep
from esbatch.launch.sweep import load_sweep

TAUS = [1.0e-3, 1.0e-2]
SUITE = {
    "name": "target",
    "sampling": {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "batch_size": 8},
    "ks": [1, 2],
    "tasks": [{"name": "toy:DigitTask", "label": "Digits", "params": {"size": 16}, "limit": 3, "few_shot": 1}],
}


def test_a_threshold_sweep_trains_thresholds_evaluates_and_draws_figure4(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests'}{os.pathsep}{ROOT}")  # the tasks: this esbatch, toy tasks
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    base = toy_config(tiny_model_dir, heldout=0, es_updates=2, eval={"every": 0}, checkpoint={"every": 1})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "target.yaml").write_text(yaml.safe_dump(SUITE))
    sweep = {
        "name": "fig4",
        "base": "base.yaml",
        "output_dir": str(tmp_path / "out"),
        "launcher": "local",
        "threshold": {"tau": TAUS, "config": "target.yaml"},
        "aggregate": [
            {"kind": "threshold_curve", "name": "threshold_curve"},
            {"kind": "drift", "name": "table4", "taus": TAUS, "panels": None},  # Table 4 from the run folders
        ],
    }
    path = tmp_path / "fig4.yaml"
    path.write_text(yaml.safe_dump(sweep))
    sw = load_sweep(str(path))
    out = io.StringIO()
    assert submit_sweep(sw, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "1 runs and 3 evals" in text and "and 3 eval(s), 3 of them after their run's training" in text, text
    assert "1 runs: 1 finished" in text and "3 evals: 3 finished" in text, text

    (run,) = sw.runs
    run_dir = sw.dir / "runs" / run.key
    s = {t: json.loads((run_dir / "thresholded" / f"tau-{t:g}" / "s_tau.json").read_text()) for t in TAUS}
    assert all(s[t]["updates"] == 2 and s[t]["source_run"] == str(run_dir.resolve()) for t in TAUS)
    assert s[TAUS[0]]["s_tau"] <= s[TAUS[1]]["s_tau"]  # a larger threshold zeroes at least as many updates
    evals = {e.tau: e.key for e in sw.evals}
    record = {t: json.loads((sw.dir / "evals" / k / "metrics.json").read_text()) for t, k in evals.items()}

    results = aggregate(sw.dir)
    rows = list(csv.DictReader(open(results / "threshold_curve.csv")))
    assert [(float(r["tau"]), r["eval_key"]) for r in rows] == [(t, evals[t]) for t in (0.0, *TAUS)]
    assert [float(r["s_tau"]) for r in rows] == [0.0, s[TAUS[0]]["s_tau"], s[TAUS[1]]["s_tau"]]
    for r in rows:
        want = record[float(r["tau"])]["tasks"]["Digits"]
        assert float(r["value"]) == want["pass@1"] and int(r["problems"]) == want["problems"] == 3
        assert float(r["ci_low"]) <= float(r["value"]) <= float(r["ci_high"])
        assert (r["run"], r["task"], r["finished"]) == (run.label, "Digits", "true")
    assert (results / "threshold_curve.png").read_bytes()[:4] == b"\x89PNG"
    # Table 4's s_tau and the thresholded checkpoints' count the same coordinates (one rule, one compute dtype)
    (t4,) = list(csv.DictReader(open(results / "table4.csv")))
    assert [float(t4[f"s_tau@{t:g} (%)"]) for t in TAUS] == [round(100 * s[t]["s_tau"], 4) for t in TAUS]
    assert t4["delta_dtype"] == s[TAUS[0]]["delta_dtype"] and int(t4["updates"]) == 2
    assert "threshold_curve" in (results / "README.md").read_text()
    meta = json.loads((sw.dir / "sweep.json").read_text())
    logged = MlflowClient(meta["tracking_uri"]).list_artifacts(meta["parent_run_id"], "results")
    assert "results/threshold_curve.csv" in {a.path for a in logged}

    # a re-run: every eval finished, every checkpoint intact: nothing submitted, nothing rewritten
    stamps = {t: os.stat(run_dir / "thresholded" / f"tau-{t:g}" / "center.safetensors").st_mtime_ns for t in TAUS}
    out = io.StringIO()
    assert submit_sweep(load_sweep(str(path)), out=out) == 0
    assert "nothing to submit" in out.getvalue(), out.getvalue()
    assert stamps == {
        t: os.stat(run_dir / "thresholded" / f"tau-{t:g}" / "center.safetensors").st_mtime_ns for t in TAUS
    }
