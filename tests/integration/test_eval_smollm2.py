"""`esbatch eval` on the real SmolLM2-135M-Instruct: fixture GSM8K problems -> table, samples, MLflow run."""

import json
from pathlib import Path

import pytest
import yaml
from toy import run_esbatch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_smollm2_eval_through_cli(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = {
        "name": "smol",
        "output_dir": str(tmp_path / "evals"),
        "model": {"name": "smollm2-135m-instruct", "dtype": "float32"},
        "sampling": {"n": 4, "temperature": 0.6, "max_new_tokens": 48, "greedy": True, "batch_size": 16},
        "ks": [1, 2, 4],
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "evals"},
        "tasks": [
            {"name": "gsm8k", "label": "GSM8K", "data_path": str(ROOT / "tests/fixtures/gsm8k_tiny.jsonl"), "limit": 3},
            {
                "name": "arithmetic",
                "limit": 4,
                "few_shot": 2,
                "params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]},
            },
        ],
    }
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = run_esbatch("eval", str(path), "--no-progress", timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| GSM8K |" in p.stdout and "| arithmetic |" in p.stdout and "**Average**" in p.stdout
    assert "tokens/s" in p.stdout
    ed = tmp_path / "evals" / "smol"
    m = json.loads((ed / "metrics.json").read_text())
    assert m["tasks"]["GSM8K"]["problems"] == 3 and m["tasks"]["arithmetic"]["problems"] == 4
    for task in ("GSM8K", "arithmetic"):
        rows = [json.loads(x) for x in (ed / "samples" / f"{task}.jsonl").read_text().splitlines()]
        assert all(len(r["samples"]) == 4 and r["greedy"]["text"] for r in rows)
        assert all(s["n_tokens"] >= 1 and s["entropy"] > 0 for r in rows for s in r["samples"])
    # 2-shot one-digit sums: SmolLM2 gets some right (Pass@4 > 0 on 4 problems; measured ~0.9)
    assert m["tasks"]["arithmetic"]["pass@4"] > 0
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(m["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["GSM8K/pass_at_1"] == pytest.approx(m["tasks"]["GSM8K"]["pass@1"])
