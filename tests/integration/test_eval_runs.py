"""esbatch eval end to end on the tiny model (moved from tests/unit/test_eval_runner.py, issue 40: each generates
and opens an MLflow store, seconds each): saved samples and the metrics recomputed from them by hand, a killed
eval's resume and re-scoring without a model, an eval nested under its training run, plots, and the paper's
suite on fixtures. The eval config's validation stays in the fast tier (tests/unit/test_eval_runner.py)."""

import pytest
from mlflow.tracking import MlflowClient
from unit.test_eval_runner import cfg_dict

from esbatch.config.eval import eval_config_from_dict
from esbatch.eval.runner import EvalDir, evaluate, passk_curve
from esbatch.metrics import pass_at_k


def test_metrics_match_the_saved_samples(tmp_path, tiny_model_dir):
    cfg = eval_config_from_dict(cfg_dict(tmp_path, tiny_model_dir))
    s = evaluate(cfg, progress=False)
    ed = EvalDir(tmp_path / "evals" / "ev")
    rows = ed.read_samples("toy:DigitTask")
    assert [r["i"] for r in rows] == list(range(6)) and all(len(r["samples"]) == 4 and "greedy" in r for r in rows)
    assert all(
        smp["entropy"] > 0 and smp["verdict"] in ("correct", "wrong", "missing") for r in rows for smp in r["samples"]
    )
    got = s["tasks"]["toy:DigitTask"]
    cs = [sum(smp["verdict"] == "correct" for smp in r["samples"]) for r in rows]
    assert got["pass@1"] == pytest.approx(sum(c / 4 for c in cs) / 6)
    assert got["pass@4"] == pytest.approx(sum(c > 0 for c in cs) / 6)
    assert got["pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in cs) / 6)
    assert got["greedy"] == pytest.approx(sum(r["greedy"]["verdict"] == "correct" for r in rows) / 6)
    assert passk_curve(rows)[-1] == pytest.approx(got["pass@4"])
    table = (ed.path / "table.md").read_text()
    assert "| toy:DigitTask |" in table and f"{100 * got['pass@1']:.1f}" in table and "**Average**" in table
    assert (ed.path / "passk.png").stat().st_size > 5000
    assert s["tokens"] > 0 and s["tokens_per_s"] > 0
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(s["mlflow_run_id"])
    assert run.data.metrics["toy:DigitTask/pass_at_4"] == pytest.approx(got["pass@4"])
    assert run.data.metrics["average/pass_at_1"] == pytest.approx(got["pass@1"])


def test_a_killed_eval_resumes_and_recompute_does_not_generate(tmp_path, tiny_model_dir, monkeypatch):
    import esbatch.eval.runner as runner

    d = cfg_dict(tmp_path, tiny_model_dir)
    d["sampling"]["batch_size"] = 4  # chunks of 4 problems: [0-3], [4-5]
    evaluate(eval_config_from_dict(d), progress=False)
    ed = EvalDir(tmp_path / "evals" / "ev")
    f = ed.sample_file("toy:DigitTask")
    full = f.read_text()
    lines = full.splitlines(keepends=True)
    f.write_text("".join(lines[:4]) + lines[4][:30])  # killed while writing the second chunk
    evaluate(eval_config_from_dict(d), progress=False)
    assert f.read_text() == full  # the torn line is cut, chunk 2 regenerated with its own seed: same samples

    # re-scoring reads the saved texts: no model is even loaded
    monkeypatch.setattr(runner, "build_generator", lambda *a, **k: pytest.fail("recompute must not generate"))
    inputs = {p: p.read_bytes() for p in (f, ed.config)}
    f.write_bytes(full.encode() + b'{"i": 6, "torn')  # a torn tail: --recompute reads past it, never cuts it
    inputs[f] = f.read_bytes()
    s = evaluate(eval_config_from_dict(d), progress=False, recompute=True)
    assert s["tasks"]["toy:DigitTask"]["problems"] == 6
    assert {p: p.read_bytes() for p in inputs} == inputs  # samples and config: not a byte changed


def test_checkpoint_eval_is_nested_under_the_training_run(tmp_path, tiny_model_dir):
    from esbatch.config import config_from_dict
    from esbatch.train import train

    train_cfg = config_from_dict(
        {
            "run": {"name": "r", "output_dir": str(tmp_path / "runs"), "threads": 1},
            "model": {"name": str(tiny_model_dir)},
            "task": {"name": "toy:DigitTask", "params": {"size": 16}, "heldout_size": 2, "few_shot": 1},
            "generation": {"temperature": 1.0, "max_new_tokens": 4, "batch_size": 8},
            "es": {"population_size": 2, "sigma": 0.05, "alpha": 0.02, "batch_size": 2, "updates": 1},
            "eval": {"every": 0},
            "tracking": {"experiment": "train"},
        }
    )
    summary = train(train_cfg, tmp_path / "runs" / "r", progress=False)
    cfg = eval_config_from_dict(cfg_dict(tmp_path, tiny_model_dir, checkpoint=str(tmp_path / "runs" / "r")))
    s = evaluate(cfg, progress=False)
    client = MlflowClient(summary["tracking_uri"])
    run = client.get_run(s["mlflow_run_id"])
    assert run.data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"]
    assert run.info.experiment_id == client.get_run(summary["mlflow_run_id"]).info.experiment_id
    assert "ES center of" in s["source"]
    # the same weights found from the training run's MLflow id alone
    d = cfg_dict(tmp_path, tiny_model_dir, name="by-id", mlflow_run=summary["mlflow_run_id"])
    d["tracking"]["uri"] = summary["tracking_uri"]
    s2 = evaluate(eval_config_from_dict(d), progress=False)
    assert client.get_run(s2["mlflow_run_id"]).data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"]
    assert s2["tasks"] == s["tasks"]  # same center, same seeds: same samples and metrics


def test_pareto_front_and_eval_plots(tmp_path, tiny_model_dir):
    from esbatch.cli import main
    from esbatch.eval.plots import pareto_front

    pts = [(0.2, 0.5), (0.3, 0.4), (0.1, 0.6), (0.25, 0.45), (0.3, 0.3), (0.05, 0.55)]
    assert pareto_front(pts) == [2, 0, 3, 1]  # (0.3, 0.3) and (0.05, 0.55) are dominated
    dirs = []
    for name, temp in (("a", 1.0), ("b", 0.7)):
        d = cfg_dict(tmp_path, tiny_model_dir, name=name)
        d["sampling"]["temperature"] = temp
        evaluate(eval_config_from_dict(d), progress=False)
        dirs.append(str(tmp_path / "evals" / name))
    for kind, extra in (("passk", []), ("pareto", ["--k", "4"])):
        out = tmp_path / f"{kind}.png"
        assert main(["eval-plot", *dirs, "--kind", kind, "-o", str(out), *extra]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert main(["eval-plot", str(tmp_path), "--kind", "passk"]) == 2  # not an eval folder


def test_the_paper_suite_runs_end_to_end_on_fixtures(tmp_path, tiny_model_dir, monkeypatch):
    """Every eval task through the runner (tiny model: mostly unanswered, which must score as such; no response
    holds code, so MBPP runs nothing in the sandbox, and its isolation probe, a program, is stood in for)."""
    from pathlib import Path

    from mbpp_cases import ISOLATED

    from esbatch.tasks import mbpp

    monkeypatch.setattr(mbpp, "isolation_report", lambda: dict(ISOLATED))

    fx = Path(__file__).resolve().parents[1] / "fixtures"
    d = cfg_dict(tmp_path, tiny_model_dir, ks=[1, 2])
    d["sampling"].update(n=2, greedy=False)
    d["tasks"] = [
        {"name": name, "data_path": str(fx / f), "limit": 2}
        for name, f in (
            ("math500", "math500_tiny.jsonl"),
            ("commonsenseqa", "csqa_tiny.jsonl"),
            ("gpqa", "gpqa_tiny.jsonl"),
            ("hotpotqa", "hotpotqa_tiny.jsonl"),
            ("mbpp", "mbpp_tiny.jsonl"),
            ("aime2024", "aime_tiny.jsonl"),
            ("amc2023", "amc_tiny.jsonl"),
            ("countdown-gold", "countdown_gold_tiny.jsonl"),
        )
    ]
    s = evaluate(eval_config_from_dict(d), progress=False)
    assert set(s["tasks"]) == {
        "math500",
        "commonsenseqa",
        "gpqa",
        "hotpotqa",
        "mbpp",
        "aime2024",
        "amc2023",
        "countdown-gold",
    }
    assert all(r["problems"] == 2 for r in s["tasks"].values())
    assert "f1" in s["columns"] and "f1" in s["tasks"]["hotpotqa"] and "f1" not in s["tasks"]["math500"]
    table = (tmp_path / "evals" / "ev" / "table.md").read_text()
    assert "| F1 |" in table and "| hotpotqa |" in table and "| mbpp |" in table
