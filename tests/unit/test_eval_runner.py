"""The eval config on its own: validation names the key, the shipped eval configs follow the paper's protocol, and
the average is over the tasks that have a column. Evals run end to end in tests/integration/test_eval_runs.py."""

import json

import pytest
import yaml

from esbatch.config import ConfigError
from esbatch.config.eval import eval_config_from_dict, load_eval_config
from esbatch.eval.runner import EvalDir


def cfg_dict(tmp, model_dir, **extra):
    d = {
        "name": "ev",
        "output_dir": str(tmp / "evals"),
        "model": {"name": str(model_dir), "dtype": "float32"},
        "sampling": {"n": 4, "temperature": 1.0, "max_new_tokens": 6, "greedy": True, "batch_size": 8},
        "ks": [1, 2, 4],
        "tracking": {"experiment": "evals", "uri": f"sqlite:///{tmp / 'mlflow.db'}"},
        "tasks": [{"name": "toy:DigitTask", "params": {"size": 16}, "limit": 6, "few_shot": 1}],
    }
    d.update(extra)
    return d


def test_eval_config_errors_name_the_key(tmp_path, tiny_model_dir):
    bad = cfg_dict(tmp_path, tiny_model_dir, ks=[0, 16])
    bad["tasks"] = [{"name": "gsm8", "lmit": 3}, {"name": "arithmetic", "params": {"digits": 2}}, "arithmetic"]
    with pytest.raises(ConfigError) as e:
        eval_config_from_dict(bad)
    msg = str(e.value)
    assert "tasks[0].lmit: unknown key. Did you mean 'limit'?" in msg
    assert "tasks[0].name: unknown task 'gsm8'. Did you mean 'gsm8k'?" in msg
    assert "tasks[1].params.digits: unknown parameter of this task" in msg
    assert "tasks: 'arithmetic' appears twice" in msg and "ks: expected positive integers, got [0]" in msg


def test_shipped_eval_configs_match_the_paper_protocol():
    for name, tokens, greedy in (("eval-easy", 2048, True), ("eval-hard", 8192, False)):
        c = load_eval_config(name)
        assert (c.sampling.n, c.sampling.temperature, c.sampling.max_new_tokens) == (32, 0.6, tokens)
        assert c.sampling.greedy is greedy and c.ks == [1, 16, 32]
    assert [t.name for t in load_eval_config("eval-hard").task_list()] == ["aime2024", "aime2025", "amc2023", "math500"]
    easy = [t.name for t in load_eval_config("eval-easy").task_list()]
    assert easy == ["gsm8k", "commonsenseqa", "hotpotqa", "countdown-gold", "gpqa", "mbpp"]  # App. G.6's suite
    yaml.safe_dump(load_eval_config("eval-quick").to_dict())  # serializable as written to the eval folder
    json.dumps(load_eval_config("eval-easy").to_dict())


def test_average_is_over_the_tasks_that_have_the_column(tmp_path):
    """F1 only exists for HotpotQA: its average is HotpotQA's F1 (n=1), not F1 / 3 tasks."""
    import csv

    from esbatch.eval.runner import write_tables

    results = {
        "GSM8K": {"pass@1": 0.5, "entropy": 0.25, "problems": 10},
        "CSQA": {"pass@1": 0.7, "entropy": 0.35, "problems": 10},
        "HotpotQA": {"pass@1": 0.3, "f1": 0.6, "entropy": 0.45, "problems": 10},
    }
    ed = EvalDir(tmp_path)
    out = write_tables(ed, results, ["pass@1", "f1", "entropy"], "t")
    with open(tmp_path / "table.csv", newline="") as f:
        rows = {r["task"]: r for r in csv.DictReader(f)}
    assert float(rows["Average"]["f1"]) == pytest.approx(0.6) and float(rows["Average"]["pass@1"]) == pytest.approx(0.5)
    assert (rows["Average n"]["f1"], rows["Average n"]["pass@1"], rows["Average n"]["problems"]) == ("1", "3", "30")
    assert rows["GSM8K"]["f1"] == "nan"
    md = (tmp_path / "table.md").read_text()
    avg_line = next(line for line in md.splitlines() if line.startswith("| **Average**"))
    cells = [c.strip() for c in avg_line.strip("|").split("|")]
    assert cells == ["**Average** (3 tasks)", "**50.0**", "**60.0** (n=1)", "**0.350**"]
    assert "| GSM8K | 50.0 | - | 0.250 |" in md
    assert "over the tasks that have the column" in md
    avg, n = out
    assert avg["f1"] == pytest.approx(0.6) and n["f1"] == 1 and n["pass@1"] == 3
