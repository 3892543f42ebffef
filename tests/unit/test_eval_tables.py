"""The RQ1 tables from a sweep's evaluations (esbatch/aggregate/evals.py), on eval folders written here with
known per-problem outcomes: values, held-out averages, paired differences, bootstrap intervals, win counts."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from esbatch.aggregate.evals import (
    EvalSet,
    _fmt,
    bootstrap_ci,
    default_eval_analyses,
    load_evals,
    paired_diff,
    passk_profile,
    write_eval_table,
    write_eval_wins,
    write_pareto,
    write_passk,
)
from esbatch.config import ConfigError
from esbatch.config.aggregate import parse_specs
from esbatch.launch.state import SweepDir

TASKS = ["Train", "A", "B"]
N = 4  # samples per problem


def write_eval(sd: SweepDir, key: str, method: str, correct: dict[str, list[int]], finished: bool = True) -> dict:
    """An eval folder whose problem i of each task has correct[task][i] correct samples out of N."""
    plan = {"model": {"name": "m"}, "ks": [1, 2, 4], "tasks": [{"name": "x", "label": t} for t in TASKS]}
    sd.plan.mkdir(parents=True, exist_ok=True)
    sd.eval_plan_path(key).write_text(yaml.safe_dump(plan))
    folder = sd.eval_dir(key)
    (folder / "samples").mkdir(parents=True)
    for t, cs in correct.items():
        rows = []
        for i, c in enumerate(cs):
            samples = [
                {"verdict": "correct" if j < c else "wrong", "key": "a" if j < c else f"w{j}", "entropy": 0.5}
                for j in range(N)
            ]
            rows.append({"i": i, "question": f"{t}-{i}", "samples": samples})
        (folder / "samples" / f"{t}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (folder / "metrics.json").write_text(json.dumps({"mlflow_run_id": "r"}))
    source = None if method == "Base" else f"run-{method}"
    return {"key": key, "label": method, "source": source, "point": {"method": method, "model.name": "m"}}


@pytest.fixture
def evalset(tmp_path) -> EvalSet:
    sd = SweepDir(tmp_path / "sw")
    evals = [
        write_eval(sd, "base-1", "Base", {"Train": [1, 1, 1, 1], "A": [2, 2, 0, 0], "B": [4, 0, 0, 0]}),
        write_eval(sd, "ev-es", "ES", {"Train": [2, 2, 2, 2], "A": [2, 2, 1, 1], "B": [4, 1, 0, 0]}),
        write_eval(sd, "ev-grpo", "GRPO", {"Train": [4, 4, 4, 0], "A": [4, 0, 0, 0], "B": [4, 0, 0, 0]}),
    ]
    sd.meta_path.write_text(json.dumps({"name": "sw", "runs": [], "evals": evals, "train_task": "Train"}))
    return load_evals(sd)


def test_loaded_values_are_the_per_problem_metrics(evalset):
    es = evalset.entries[1]
    assert evalset.task_order == TASKS and evalset.heldout() == ["A", "B"]
    assert es.tasks["A"].mean("pass@1") == pytest.approx((2 + 2 + 1 + 1) / 16)
    # pass@2 with c of 4 correct: 1 - C(4-c, 2)/C(4, 2) -> c=2: 1 - 1/6, c=1: 1 - 3/6
    assert es.tasks["A"].mean("pass@2") == pytest.approx((2 * (5 / 6) + 2 * 0.5) / 4)
    assert es.tasks["B"].mean("pass@4") == pytest.approx(2 / 4)  # problems with any correct sample
    # wrong samples all differ, so the correct answer wins the vote whenever it appears (ties: first seen)
    assert es.tasks["A"].mean("maj@4") == 1.0 and es.tasks["B"].mean("maj@4") == pytest.approx(2 / 4)
    assert passk_profile(es.tasks["B"]) == pytest.approx([5 / 16, (1 + 0.5) / 4, (1 + 0.75) / 4, 2 / 4])


def test_paired_difference_matches_problems_by_index_and_question(evalset):
    base, es = evalset.entries[0], evalset.entries[1]
    d = paired_diff(es.tasks["A"], base.tasks["A"], "pass@1")
    assert d.tolist() == [0.0, 0.0, 0.25, 0.25]
    es.tasks["A"].questions[0] = "another question"
    with pytest.raises(ValueError, match="same problems"):
        paired_diff(es.tasks["A"], base.tasks["A"], "pass@1")


def test_bootstrap_interval_is_the_mean_with_the_normal_width_for_large_samples():
    assert bootstrap_ci([np.full(50, 0.2)]) == pytest.approx((0.2, 0.2, 0.2))
    rng = np.random.default_rng(1)
    d = rng.normal(0.3, 1.0, size=2000)
    mean, lo, hi = bootstrap_ci([d])
    assert mean == pytest.approx(d.mean())
    half = 1.96 * d.std() / np.sqrt(len(d))  # the normal-theory interval the bootstrap approximates
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1) and lo < mean < hi
    # stratified over two tasks: the mean of the task means, width from both variances
    e = rng.normal(-0.1, 2.0, size=1000)
    mean, lo, hi = bootstrap_ci([d, e])
    assert mean == pytest.approx((d.mean() + e.mean()) / 2)
    half = 1.96 * np.sqrt(d.var() / len(d) + e.var() / len(e)) / 2
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)


def test_eval_table_values_and_held_out_average(evalset, tmp_path):
    (a,) = parse_specs([{"kind": "eval_table", "name": "t", "metrics": ["pass@1"]}])
    sec = write_eval_table(evalset, a, tmp_path)
    md = (tmp_path / "t.md").read_text()
    # ES: Train 50.0, A 37.5, B 31.25 -> held-out avg (A, B only) 34.4; GRPO: 75.0, 25.0, 25.0 -> 25.0
    assert "| ES | 50.0 | 37.5 | 31.2 | 34.4 |" in md, md
    assert "| GRPO | 75.0 | 25.0 | 25.0 | 25.0 |" in md, md
    assert "Train (train) (4×4)" in md and "Held-out avg (2 tasks)" in md
    rows = (tmp_path / "t.csv").read_text().splitlines()
    assert "m,ES,Held-out avg,pass@1,0.34375,,,,,true" in rows, rows
    assert sec.files[-1].name == "t.md"


def test_change_vs_base_carries_a_paired_interval(evalset, tmp_path):
    (a,) = parse_specs([{"kind": "eval_table", "name": "d", "metrics": ["pass@1"], "delta": True}])
    write_eval_table(evalset, a, tmp_path)
    md = (tmp_path / "d.md").read_text()
    assert "Base" not in md.split("**")[2].split("*Rates")[0]  # no Base row in a change-vs-base table
    # ES - Base on Train: every problem +0.25 -> +25.0 with a zero-width interval that excludes 0
    assert "| ES | +25.0† [+25.0, +25.0] |" in md, md
    lines = [r.split(",") for r in (tmp_path / "d.csv").read_text().splitlines()[1:]]
    es_avg = next(r for r in lines if r[1] == "ES" and r[2] == "Held-out avg")
    want = np.mean([np.mean([0, 0, 0.25, 0.25]), np.mean([0, 0.25, 0, 0])])
    assert float(es_avg[4]) == pytest.approx(want)
    assert float(es_avg[5]) <= want <= float(es_avg[6])


def test_wins_count_comparisons_and_falls_below_base(evalset, tmp_path):
    (a,) = parse_specs([{"kind": "eval_wins", "name": "w", "metrics": ["pass@1", "pass@4"]}])
    write_eval_wins(evalset, a, tmp_path)
    rows = (tmp_path / "w.csv").read_text().splitlines()
    # pass@1: ES > GRPO on A (37.5 > 25) and B (31.25 > 25), not Train; GRPO below base on A (25 < 25? no)
    assert rows[1].split(",")[:3] == ["pass@1", "3", "2"]
    # pass@4: Train ES 1.0 vs GRPO 0.75 (win); A: ES 1.0 vs 0.25 (win); B: 0.5 vs 0.25 (win); GRPO < base on A
    assert rows[2].split(",") == ["pass@4", "3", "3", "1", "0", "2"]


def test_figures_are_written_and_defaults_cover_the_paper_tables(evalset, tmp_path):
    specs = default_eval_analyses(evalset)
    assert [s.kind for s in specs] == ["eval_table", "eval_table", "eval_table", "eval_wins", "pareto", "passk"]
    assert specs[0].metrics == ["pass@1", "pass@2", "pass@4"] and specs[2].delta
    write_pareto(evalset, specs[4], tmp_path)
    write_passk(evalset, specs[5], tmp_path)
    for f in ("pareto.png", "passk_profiles.png"):
        assert (tmp_path / f).stat().st_size > 10_000
    assert Path(tmp_path / "passk_profiles.csv").read_text().count("\n") == 1 + 3 * 3 * N


def test_rows_and_panels_are_checked_against_the_evals_not_the_runs(evalset):
    """A sweep without `methods:` still has a `method` per eval (its run's label): the default rows work, and a
    misspelt key is named with what the evals have."""
    (ok, bad) = parse_specs(
        [{"kind": "eval_table", "name": "a"}, {"kind": "eval_table", "name": "b", "rows": "methd", "panels": None}]
    )
    assert evalset.param_errors(ok) == []
    (err,) = evalset.param_errors(bad)
    assert err.startswith("aggregate[1].rows: unknown parameter 'methd'.") and "Did you mean 'method'?" in err
    assert "model.name" in err


def test_below_base_counts_a_model_task_cell_only_when_below_on_both_metrics(tmp_path):
    """The paper's joint rule over every model: below on pass@2 alone, or a tie, is not below."""
    sd = SweepDir(tmp_path / "sw")
    outcomes = {  # model -> method -> task -> correct samples of N=4 per problem
        "m1": {
            "Base": {"Train": [1, 1, 1, 1], "A": [2, 2, 0, 0], "B": [2, 2, 0, 0]},
            "ES": {"Train": [2, 2, 2, 2], "A": [2, 2, 1, 1], "B": [2, 2, 0, 0]},
            "GRPO": {"Train": [4, 0, 0, 0], "A": [1, 1, 1, 0], "B": [2, 2, 0, 0]},  # both / pass@2 only / tie
        },
        "m2": {
            "Base": {"Train": [1, 1, 1, 1], "A": [2, 2, 0, 0], "B": [2, 2, 0, 0]},
            "ES": {"Train": [1, 1, 1, 1], "A": [2, 2, 0, 0]},  # no B: not a comparison
            "GRPO": {"Train": [1, 1, 1, 1], "A": [4, 0, 0, 0], "B": [4, 0, 0, 0]},  # tie / both / both
        },
    }
    evals = []
    for model, methods in outcomes.items():
        for method, correct in methods.items():
            ev = write_eval(sd, f"{method}-{model}", method, correct)
            ev["point"]["model.name"] = model
            evals.append(ev)
    sd.meta_path.write_text(json.dumps({"name": "sw", "runs": [], "evals": evals, "train_task": "Train"}))
    es = load_evals(sd)
    (w,) = parse_specs(
        [{"kind": "eval_wins", "name": "w", "metrics": ["pass@2"], "below_base_on": ["pass@2", "pass@4"]}]
    )
    write_eval_wins(es, w, tmp_path)
    md = (tmp_path / "w.md").read_text()
    assert "| GRPO | 3 of 6 | m1/Train, m2/A, m2/B |" in md, md
    assert "| ES | 0 of 5 | — |" in md, md
    rows = list(csv.DictReader((tmp_path / "w_below_base.csv").open()))
    assert [(r["method"], r["model"], r["task"]) for r in rows if r["below"] == "true"] == [
        ("GRPO", "m1", "Train"),
        ("GRPO", "m2", "A"),
        ("GRPO", "m2", "B"),
    ]
    a_row = next(r for r in rows if (r["method"], r["model"], r["task"]) == ("GRPO", "m1", "A"))
    assert float(a_row["value_pass@2"]) < float(a_row["base_pass@2"])  # below on pass@2 ...
    assert float(a_row["value_pass@4"]) > float(a_row["base_pass@4"])  # ... but not on pass@4: not counted
    # per metric, over the ES-vs-GRPO comparisons of both models (m2/B has no ES): GRPO below base on pass@2 in
    # m1/Train, m1/A, m2/A; the joint count above is each method's own, over every cell it has
    (row,) = list(csv.DictReader((tmp_path / "w.csv").open()))
    assert (row["comparisons"], row["b_below_base"]) == ("5", "3"), row


@pytest.mark.parametrize(
    "metric, v, plain, signed",
    [
        ("entropy", 0.1234, "0.123", "+0.123"),  # nats: two runs about 0.1 apart in the 3rd decimal differ
        ("entropy", 0.1199, "0.120", "+0.120"),
        ("entropy", -0.0004, "-0.000", "-0.000"),
        ("pass@1", 0.3125, "31.2", "+31.2"),  # rates in percent, one decimal
        ("pass@32", float("nan"), "—", "—"),
    ],
)
def test_cells_print_entropy_in_nats_to_three_decimals_and_rates_in_percent(metric, v, plain, signed):
    assert (_fmt(metric, v), _fmt(metric, v, sign=True)) == (plain, signed)


@pytest.mark.parametrize("key", ["metrics", "below_base_on"])
def test_a_bad_eval_metric_is_named_with_the_valid_forms(key):
    with pytest.raises(ConfigError, match=rf"aggregate\[0\]\.{key}: got \['bogus'\]; valid: a list of pass@K, maj@K"):
        parse_specs([{"kind": "eval_wins", "name": "w", key: ["pass@16", "bogus"]}])


def test_each_average_column_means_exactly_its_own_tasks(evalset, tmp_path):
    """The Hard setting's two averages kept apart: a column per ``averages`` entry, over its tasks only (the
    training task included when named), its header and note naming them; the delta average pairs the same tasks."""
    spec = {"kind": "eval_table", "name": "t", "metrics": ["pass@1"], "averages": {"Math": ["Train", "A"], "B": ["B"]}}
    (a,) = parse_specs([spec])
    write_eval_table(evalset, a, tmp_path)
    md = (tmp_path / "t.md").read_text()
    # ES: Train 50.0, A 37.5, B 31.25 -> Math (Train, A) 43.75, B 31.25; no default held-out column
    assert "| ES | 50.0 | 37.5 | 31.2 | 43.8 | 31.2 |" in md, md
    assert "Math (2 tasks)" in md and "B (1 tasks)" in md and "Held-out avg" not in md
    assert "Math = mean over Train, A; B = mean over B" in md
    (d,) = parse_specs([{**spec, "name": "d", "delta": True}])
    write_eval_table(evalset, d, tmp_path)
    lines = [r.split(",") for r in (tmp_path / "d.csv").read_text().splitlines()[1:]]
    math = next(r for r in lines if r[1] == "ES" and r[2] == "Math")
    # ES - Base: Train +0.25 on every problem, A [0, 0, .25, .25]: the mean of the two task means
    assert float(math[4]) == pytest.approx((0.25 + 0.125) / 2)
    # an average over tasks the table does not show: paired all the same (A as above, B [0, .25, 0, 0])
    (h,) = parse_specs([{**spec, "name": "h", "delta": True, "tasks": ["Train"], "averages": {"AB": ["A", "B"]}}])
    write_eval_table(evalset, h, tmp_path)
    rows = [r.split(",") for r in (tmp_path / "h.csv").read_text().splitlines()[1:]]
    ab = next(r for r in rows if r[1] == "ES" and r[2] == "AB")
    assert float(ab[4]) == pytest.approx((0.125 + 0.0625) / 2)


def test_an_average_over_an_unknown_task_is_named(evalset, tmp_path):
    (a,) = parse_specs([{"kind": "pareto", "name": "p", "averages": {"Math": ["A", "AIME24"]}}])
    with pytest.raises(ConfigError, match=r"aggregate\[0\]\.averages\.Math: no eval has \['AIME24'\]"):
        write_pareto(evalset, a, tmp_path)
    with pytest.raises(ConfigError, match="averages no task"):
        parse_specs([{"kind": "eval_table", "name": "t", "averages": {"Math": []}}])
