"""Drift on real (tiny) runs: GRPO's logged update/rel_distance_from_theta0 against a by-hand computation, and an
ES run end to end: analyze drift agrees with the distance the trainer logged, a thresholded checkpoint is evaluated
by `esbatch eval` like any run folder, and Figure 4's curve is drawn from the evals. Moved from tests/unit (issue 40:
seconds each): this file, and from tests/unit/test_analyze_drift.py the CLI's tables and plots and the analysis
files' way to the run's MLflow run (on its hand-built weights)."""

import csv
import json
import math
from types import SimpleNamespace

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from unit.test_analyze_drift import TAUS, E, _model_dir, _run, _states

from esbatch.analyze.drift import analyze_drift
from esbatch.cli import main
from esbatch.config import config_from_dict
from esbatch.grpo.trainer import GRPOTrainer
from esbatch.models import load_model_and_tokenizer
from esbatch.train.ranks import Ranks

KEY = "update/rel_distance_from_theta0"


def _by_hand(model, base_file):
    """||theta - theta_0|| / ||theta_0|| from the base model's file, in float64 Python sums."""
    base = load_file(str(base_file))
    num = den = 0.0
    for n, p in model.named_parameters():
        t0 = base[n].double()
        num += float(((p.detach().double() - t0) ** 2).sum())
        den += float((t0**2).sum())
    return math.sqrt(num / den)


@pytest.mark.parametrize("tracked", [True, False])
def test_grpo_logs_the_relative_distance_from_theta0(tiny_model_dir, tracked):
    cfg = config_from_dict(
        {
            "algorithm": "grpo",
            "model": {"name": str(tiny_model_dir), "dtype": "float32"},
            "task": {"name": "toy:DigitTask"},
            "grpo": {"updates": 3},
            "checkpoint": {"every": 2},
            "tracking": {"drift": tracked},
        }
    )
    model, _ = load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")
    tr = GRPOTrainer(cfg, None, Ranks(), "cpu")
    tr.engine, tr.total = SimpleNamespace(module=model), 3
    if tracked:  # what setup() keeps: fp32 theta_0 on CPU
        tr.theta0 = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # a "training step": every weight moves
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    want = _by_hand(model, tiny_model_dir / "model.safetensors")
    assert want > 0
    got = {t: tr._drift(t) for t in range(3)}
    if tracked:  # every step
        assert all(d[KEY] == pytest.approx(want, rel=1e-9) for d in got.values())
    else:  # at the checkpoint after step 1 (2 updates) and the last step, streamed from the base model's file
        assert got[0] == {}
        assert got[1][KEY] == pytest.approx(want, rel=1e-9) and got[2][KEY] == pytest.approx(want, rel=1e-9)
    tr.ranks = SimpleNamespace(lead=False)  # ranks other than 0 log nothing
    assert tr._drift(2) == {}


def test_es_run_drift_threshold_eval_and_the_threshold_curve(tmp_path, tiny_model_dir, capsys):
    from esbatch.config.eval import eval_config_from_dict
    from esbatch.eval.runner import build_generator, evaluate, resolve_weights
    from esbatch.train import train

    run = tmp_path / "runs" / "r"
    train_cfg = config_from_dict(
        {
            "run": {"name": "r", "output_dir": str(tmp_path / "runs"), "threads": 1},
            "model": {"name": str(tiny_model_dir), "dtype": "float32"},
            "task": {"name": "toy:DigitTask", "params": {"size": 16}, "heldout_size": 2, "few_shot": 1},
            "generation": {"temperature": 1.0, "max_new_tokens": 6, "batch_size": 8},
            "es": {"population_size": 4, "sigma": 0.05, "alpha": 0.02, "batch_size": 4, "updates": 2},
            "eval": {"every": 0},
            "tracking": {"experiment": "train"},
        }
    )
    summary = train(train_cfg, run, progress=False)
    logged = [json.loads(x)["metrics"][KEY] for x in (run / "log.jsonl").read_text().splitlines()]
    assert logged[-1] > 0  # the toy rewards differ between members: the center moved

    assert main(["analyze", "drift", str(run), "--tau", "1e-4", "1e-3"]) == 0
    d = json.loads((run / "analysis" / "drift" / "drift.json").read_text())
    assert d["rel_l2"] == pytest.approx(logged[-1], rel=1e-9)  # the trainer's fp32 master vs the saved center
    client = MlflowClient(summary["tracking_uri"])
    assert "analysis/drift/table4.csv" in {
        a.path for a in client.list_artifacts(summary["mlflow_run_id"], "analysis/drift")
    }

    # a threshold in the middle of the updates' magnitudes
    tau = float(d["top"][-1]["abs_delta"]) / 2
    capsys.readouterr()
    assert main(["threshold", str(run), "--tau", str(tau)]) == 0
    folder = run / "thresholded" / f"tau-{tau:g}"
    s = json.loads((folder / "s_tau.json").read_text())
    assert 0 < s["s_tau"] < 1 and f"esbatch eval --checkpoint {folder}" in capsys.readouterr().out

    def eval_cfg(name, checkpoint):
        return eval_config_from_dict(
            {
                "name": name,
                "output_dir": str(tmp_path / "evals"),
                "checkpoint": str(checkpoint),
                "sampling": {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "batch_size": 8},
                "ks": [1, 2],
                "tracking": {"experiment": "evals", "uri": summary["tracking_uri"]},
                "tasks": [{"name": "toy:DigitTask", "params": {"size": 16}, "limit": 3, "few_shot": 1}],
            }
        )

    cfg = eval_cfg("thr", folder)
    src = resolve_weights(cfg)
    assert src.center == folder / "center.safetensors" and src.parent_run_id == summary["mlflow_run_id"]
    gen = build_generator(cfg, src)  # the weights `esbatch eval` generates with: the thresholded center
    want = load_file(str(folder / "center.safetensors"))
    assert all(torch.equal(p, want[n]) for n, p in gen.model.named_parameters())
    out = evaluate(cfg, progress=False)
    assert client.get_run(out["mlflow_run_id"]).data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"]
    evaluate(eval_cfg("full", run), progress=False)

    png = tmp_path / "fig4.png"
    assert (
        main(
            [
                "analyze",
                "threshold-curve",
                str(tmp_path / "evals" / "full"),
                str(tmp_path / "evals" / "thr"),
                "-o",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader(open(png.with_suffix(".csv"))))
    metrics = {n: json.loads((tmp_path / "evals" / n / "metrics.json").read_text()) for n in ("full", "thr")}
    assert [(float(r["s_tau"]), float(r["pass@1"])) for r in rows] == [
        (0.0, metrics["full"]["tasks"]["toy:DigitTask"]["pass@1"]),
        (s["s_tau"], metrics["thr"]["tasks"]["toy:DigitTask"]["pass@1"]),
    ]
    assert {r["model"] for r in rows} == {str(tiny_model_dir)}
    assert main(["analyze", "threshold-curve", str(tmp_path / "evals" / "thr"), "--task", "gsm8k"]) == 2
    assert "no Pass@1 for task 'gsm8k'" in capsys.readouterr().err


def test_cli_drift_writes_table4_histograms_and_plots(tmp_path, capsys):
    base, center = _states()
    model_dir = _model_dir(tmp_path, base)
    es = _run(tmp_path, model_dir, center, "es-run")
    small = {n: base[n] + (center[n] - base[n]) / 4 for n in base}  # every update a quarter: rel L2 / 4
    grpo = _run(tmp_path, model_dir, small, "grpo-run", algorithm="grpo")
    rc = main(  # the reference also listed as a run, and a run twice: each is analysed and tabulated once
        ["analyze", "drift", str(es.path), str(grpo.path), str(es.path), "--reference", str(grpo.path)]
        + ["--tau", "1e-6", "1e-4", "--top-k", "3"]
    )
    assert rc == 0, capsys.readouterr().err
    out = es.path / "analysis" / "drift"
    for f in ("table4.csv", "table4.md", "summary.md", "histogram.csv", "topk.csv", "topk_by_type_layer.csv"):
        assert (out / f).exists(), f
    for f in ("histogram.png", "topk_heatmap.png", "compare.png"):
        assert (out / f).read_bytes()[:4] == b"\x89PNG"
    rows = (out / "table4.csv").read_text().splitlines()
    assert rows[0].startswith("run,algorithm,updates,rel_l2_x1e-2,ratio_to_reference,s_tau@1e-06 (%),s_tau@0.0001 (%)")
    assert len(rows) == 3, rows
    ref_row, es_row = rows[1].split(","), rows[2].split(",")
    assert ref_row[:2] == ["grpo-run", "grpo"] and es_row[:2] == ["es-run", "es"]
    assert float(es_row[4]) == 4.0 and float(ref_row[4]) == 1.0
    assert float(es_row[5]) == round(100 * 2 / 11, 4) and float(es_row[6]) == round(100 * 4 / 11, 4)
    d = json.loads((out / "drift.json").read_text())
    assert d["max_abs"] == E and d["max_count"] == 3 and d["t"] == 5
    assert sum(int(r.split(",")[2]) for r in (out / "topk_by_type_layer.csv").read_text().splitlines()[1:]) == 3
    assert (grpo.path / "analysis" / "drift" / "drift.json").exists()  # the reference is analysed in its folder too


def test_analysis_files_reach_the_runs_mlflow_run_or_a_warning(tmp_path, capsys):
    base, center = _states()
    rd = _run(tmp_path, _model_dir(tmp_path, base), center)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x", artifact_location=(tmp_path / "art").as_uri())).info.run_id
    rd.write_meta(tracking_uri=uri, mlflow_run_id=run_id)
    analyze_drift([rd.path], taus=TAUS)
    names = {a.path for a in client.list_artifacts(run_id, "analysis/drift")}
    assert {"analysis/drift/table4.csv", "analysis/drift/compare.png", "analysis/drift/drift.json"} <= names

    rd.write_meta(tracking_uri=uri, mlflow_run_id="0" * 32)  # a run the store does not hold: warn, keep the files
    (rd.path / "analysis" / "drift" / "table4.csv").unlink()
    analyze_drift([rd.path], taus=TAUS)
    assert "warning: not logged to MLflow run" in capsys.readouterr().err
    assert (rd.path / "analysis" / "drift" / "table4.csv").exists()
