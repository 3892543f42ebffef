"""Sweep aggregation: debiased smoothing, analysis specs, and the Table 6 / Appendix F / final-table reports."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from esbatch.aggregate.report import (
    CurvesAnalysis,
    FinalAnalysis,
    ScalingAnalysis,
    default_analyses,
    parse_analyses,
    write_report,
)
from esbatch.aggregate.results import RunResult
from esbatch.aggregate.smoothing import debiased_ema, local_std
from esbatch.config import ConfigError

T = 300
MODELS = ["qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen2.5-3b-instruct"]
NS = [8, 16, 32, 64]
# Reward plateaus: N=64 is the reference; a 0.002 difference lands within 0.01 after smoothing, 0.05 does not.
# Designed like the paper: only N=32 is close for 0.5B; N=16 and N=32 are close for 1.5B and 3B.
PLATEAU = {
    MODELS[0]: {8: 0.40, 16: 0.45, 32: 0.498, 64: 0.50},
    MODELS[1]: {8: 0.55, 16: 0.602, 32: 0.603, 64: 0.60},
    MODELS[2]: {8: 0.65, 16: 0.701, 32: 0.698, 64: 0.70},
}
CLOSE = {(MODELS[0], 32), (MODELS[1], 16), (MODELS[1], 32), (MODELS[2], 16), (MODELS[2], 32)}


def hand_ema(xs, w=0.99):
    """The debiased EMA written out step by step, independent of the implementation."""
    out, s = [], 0.0
    for t, x in enumerate(xs):
        s = w * s + (1 - w) * x
        out.append(s / (1 - w ** (t + 1)))
    return out


def reward(plateau: float, t: int, phase: float = 0.0) -> float:
    return plateau * (1 - math.exp(-t / 40)) + 0.03 * math.sin(1.7 * t + phase)


def make_run(model, n, *, seed=0, status="finished", steps=T, offset=0.0, total=T, metrics=True) -> RunResult:
    params = {
        "model.name": model,
        "es.population_size": n,
        "es.sigma": 0.001,
        "run.seed": seed,
        "run.name": f"{model}-N{n}-s{seed}",
        "run.output_dir": "runs",
    }
    hist = {}
    if metrics:
        hist["reward/mean"] = [(t, reward(PLATEAU[model][n] + offset, t, seed)) for t in range(1, steps + 1)]
        hist["heldout/accuracy"] = [(t, 0.3 + t / 1000 + offset) for t in range(0, steps + 1, 50)]
    key = f"{model}/N{n}/s{seed}"
    return RunResult(key, f"{model.split('-')[1]}-N{n}-s{seed}", status, params, total, hist)


def grid_runs() -> list[RunResult]:
    return [make_run(m, n) for m in MODELS for n in NS]


def expected_value(model, n, seed=0, offset=0.0, upto=T) -> float:
    return hand_ema([reward(PLATEAU[model][n] + offset, t, seed) for t in range(1, upto + 1)])[-1]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


TABLE6 = ScalingAnalysis(name="popsize_table", rows="model.name", cols="es.population_size", reference=64)


# ----------------------------------------------------------------------------- smoothing


def test_debiased_ema_matches_hand_loop_and_invariants():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=200).tolist()
    for w in (0.0, 0.5, 0.9, 0.99):
        np.testing.assert_allclose(debiased_ema(xs, w), hand_ema(xs, w), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(debiased_ema([0.37] * 50, 0.99), 0.37, rtol=1e-12)
    assert debiased_ema(xs, 0.99)[0] == pytest.approx(xs[0])
    np.testing.assert_allclose(debiased_ema(xs, 0.0), xs)
    assert debiased_ema([], 0.99).shape == (0,)


@pytest.mark.parametrize("w", [-0.1, 1.0, 1.5])
def test_debiased_ema_rejects_bad_weight(w):
    with pytest.raises(ValueError, match="0 <= weight < 1"):
        debiased_ema([1.0, 2.0], w)


def test_local_std_centered_clipped_sample_std():
    r = np.array([0.0, 1.0, 4.0, 9.0, 16.0, 25.0])
    out = local_std(r, 3)
    assert out[0] == pytest.approx(np.std([0, 1], ddof=1))  # clipped at the start
    assert out[2] == pytest.approx(np.std([1, 4, 9], ddof=1))  # centered
    assert out[-1] == pytest.approx(np.std([16, 25], ddof=1))  # clipped at the end
    assert local_std(r, 2)[-1] == pytest.approx(np.std([16, 25], ddof=1))  # widened to 2 points
    np.testing.assert_allclose(local_std([3.0] * 10, 5), 0.0)
    assert local_std([1.0], 5).tolist() == [0.0]
    with pytest.raises(ValueError):
        local_std(r, 1)


# ----------------------------------------------------------------------------- scaling (Table 6)


def test_scaling_table_values_gaps_and_marks(tmp_path):
    write_report(grid_runs(), [TABLE6], tmp_path, title="popsize")
    rows = read_csv(tmp_path / "popsize_table.csv")
    assert [(r["model.name"], int(r["es.population_size"])) for r in rows] == [(m, n) for m in MODELS for n in NS]
    marked = set()
    for r in rows:
        m, n = r["model.name"], int(r["es.population_size"])
        want = expected_value(m, n)
        gap = want - expected_value(m, 64)
        assert float(r["value"]) == pytest.approx(want, abs=1e-12)
        assert float(r["gap_to_reference"]) == pytest.approx(gap, abs=1e-12)
        assert (r["n_runs"], r["n_planned"], r["status"], r["std"], r["at"]) == ("1", "1", "ok", "", "300")
        if n == 64:
            assert r["within_tolerance"] == ""
        else:
            assert r["within_tolerance"] == ("true" if abs(gap) <= 0.01 else "false")
            if r["within_tolerance"] == "true":
                marked.add((m, n))
    assert marked == CLOSE

    md = (tmp_path / "popsize_table.md").read_text()
    line_05 = next(line for line in md.splitlines() if line.startswith("| qwen2.5-0.5b-instruct"))
    cells = [c.strip() for c in line_05.strip("|").split("|")]
    assert cells[1] == f"{expected_value(MODELS[0], 8):.4f}"  # not marked
    assert cells[3] == f"**{expected_value(MODELS[0], 32):.4f}** ✓"
    assert cells[5] == f"{expected_value(MODELS[0], 8) - expected_value(MODELS[0], 64):+.4f}"  # gap 8
    assert md.count("| model.name | population_size=8 | population_size=16 |") == 1 and "| gap 16 |" in md
    assert "within 0.01" in md and "weight 0.99" in md and "update 300" in md
    index = (tmp_path / "README.md").read_text()
    assert line_05 in index  # the table is embedded
    assert "None: all 12 runs finished" in index


def test_scaling_missing_failed_early_and_explicit_at(tmp_path):
    runs = grid_runs()
    runs[0] = make_run(MODELS[0], 8, status="failed", steps=120)
    runs[1] = make_run(MODELS[0], 16, status="running", steps=120)
    runs[4] = make_run(MODELS[1], 8, status="missing", metrics=False)
    runs[8] = make_run(MODELS[2], 8, status="pending", metrics=False)
    runs[9] = make_run(MODELS[2], 16, status="killed", metrics=False)
    write_report(runs, [TABLE6], tmp_path)
    by_cell = {(r["model.name"], int(r["es.population_size"])): r for r in read_csv(tmp_path / "popsize_table.csv")}
    assert by_cell[(MODELS[0], 8)]["value"] == "" and "failed at 120/300" in by_cell[(MODELS[0], 8)]["status"]
    assert (
        by_cell[(MODELS[0], 16)]["status"].startswith("missing") and "at 120/300" in by_cell[(MODELS[0], 16)]["status"]
    )
    assert by_cell[(MODELS[1], 8)]["n_runs"] == "0" and by_cell[(MODELS[1], 8)]["n_planned"] == "1"
    assert by_cell[(MODELS[0], 8)]["gap_to_reference"] == "" and by_cell[(MODELS[0], 8)]["within_tolerance"] == ""
    md = (tmp_path / "popsize_table.md").read_text()
    assert "— (at 120/300)" in md and "— (failed at 120/300)" in md and "— (missing)" in md
    assert "— (pending)" in md and "— (killed, no reward/mean)" in md

    index = (tmp_path / "README.md").read_text()
    attention = index.split("## Runs needing attention")[1].split("\n## ")[0]
    for r in (runs[0], runs[1], runs[4], runs[8], runs[9]):
        line = next(line for line in attention.splitlines() if r.key in line)
        assert f"| {r.status} |" in line
    assert runs[2].key not in attention  # finished runs are not listed there
    assert "reward/mean at 120/300" in attention

    # at: 100 reads every run at update 100 (the early runs included); their smoothed prefix value
    early = ScalingAnalysis(name="at100", rows="model.name", cols="es.population_size", at=100)
    write_report(runs, [early], tmp_path)
    rows = {(r["model.name"], int(r["es.population_size"])): r for r in read_csv(tmp_path / "at100.csv")}
    assert float(rows[(MODELS[0], 8)]["value"]) == pytest.approx(expected_value(MODELS[0], 8, upto=100), abs=1e-12)
    assert float(rows[(MODELS[0], 64)]["value"]) == pytest.approx(expected_value(MODELS[0], 64, upto=100), abs=1e-12)


def test_scaling_averages_seeds_with_count_and_std(tmp_path):
    runs = [
        make_run(MODELS[0], 16, seed=0, offset=0.0),
        make_run(MODELS[0], 16, seed=1, offset=0.02),
        make_run(MODELS[0], 16, seed=2, status="failed", steps=50),
        make_run(MODELS[0], 64, seed=0),
        make_run(MODELS[0], 64, seed=1, offset=0.01),
    ]
    a = ScalingAnalysis(name="seeds", rows="model.name", cols="es.population_size")  # reference: last column
    write_report(runs, [a], tmp_path)
    rows = read_csv(tmp_path / "seeds.csv")
    v16 = [expected_value(MODELS[0], 16, 0), expected_value(MODELS[0], 16, 1, 0.02)]
    v64 = [expected_value(MODELS[0], 64, 0), expected_value(MODELS[0], 64, 1, 0.01)]
    r16, r64 = rows
    assert float(r16["value"]) == pytest.approx(np.mean(v16), abs=1e-12)
    assert float(r16["std"]) == pytest.approx(np.std(v16, ddof=1), abs=1e-12)
    assert (r16["n_runs"], r16["n_planned"]) == ("2", "3")
    assert r16["status"].startswith("partial: 2/3") and "failed at 50/300" in r16["status"]
    assert float(r16["gap_to_reference"]) == pytest.approx(np.mean(v16) - np.mean(v64), abs=1e-12)
    assert float(r64["value"]) == pytest.approx(np.mean(v64), abs=1e-12) and r64["n_runs"] == "2"
    md = (tmp_path / "seeds.md").read_text()
    assert f"{np.mean(v16):.4f} (n=2/3)" in md and f"{np.mean(v64):.4f} (n=2)" in md


def test_scaling_warns_when_cells_pool_other_settings(tmp_path):
    runs = [make_run(MODELS[0], 16), make_run(MODELS[0], 64)]
    other = make_run(MODELS[0], 16, seed=1)
    other.params["es.sigma"] = 0.01
    write_report([*runs, other], [TABLE6], tmp_path)
    assert "also differ in es.sigma" in (tmp_path / "popsize_table.md").read_text()


# ----------------------------------------------------------------------------- curves and final table


def test_curves_png_csv_and_seed_average(tmp_path):
    runs = grid_runs() + [
        make_run(MODELS[1], 16, seed=1, offset=0.01),
        make_run(MODELS[2], 8, status="missing", metrics=False, seed=3),
    ]
    a = CurvesAnalysis(name="popsize_curves", panels="model.name", hue="es.population_size", band_window=21)
    paths = write_report(runs, [a], tmp_path)
    png = tmp_path / "popsize_curves.png"
    assert png in paths
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000

    rows = [r for r in read_csv(tmp_path / "popsize_curves.csv") if r["model.name"] == MODELS[1]]
    rows16 = [r for r in rows if r["es.population_size"] == "16"]
    raw = [
        (reward(PLATEAU[MODELS[1]][16], t, 0) + reward(PLATEAU[MODELS[1]][16] + 0.01, t, 1)) / 2
        for t in range(1, T + 1)
    ]
    assert [int(r["step"]) for r in rows16] == list(range(1, T + 1))
    assert {r["n_runs"] for r in rows16} == {"2"}
    np.testing.assert_allclose([float(r["raw_mean"]) for r in rows16], raw, atol=1e-12)
    smooth = hand_ema(raw)
    np.testing.assert_allclose([float(r["smoothed"]) for r in rows16], smooth, atol=1e-12)
    np.testing.assert_allclose(
        [float(r["band_std"]) for r in rows16], local_std(np.array(raw) - smooth, 21), atol=1e-12
    )
    md = (tmp_path / "popsize_curves.md").read_text()
    assert "![popsize_curves](popsize_curves.png)" in md and "2/2" in md
    assert runs[-1].label in md  # the run without data is named, not dropped
    index = (tmp_path / "README.md").read_text()
    assert "popsize_curves.png" in index and runs[-1].key in index


def test_final_table_grouped_with_heldout(tmp_path):
    runs = [
        make_run(MODELS[0], 16),
        make_run(MODELS[0], 8),
        make_run(MODELS[0], 8, seed=1, offset=0.01),
        make_run(MODELS[0], 16, seed=1, status="killed", steps=120),
    ]
    runs[1].params["es.sigma"] = 0.002
    runs[2].params["es.sigma"] = 0.002
    a = FinalAnalysis(name="sigma_table", by=["es.sigma"])
    write_report(runs, [a], tmp_path)
    rows = read_csv(tmp_path / "sigma_table.csv")
    assert [(r["es.sigma"], r["run.seed"] if "run.seed" in r else r["key"]) for r in rows] == [
        ("0.001", runs[0].key),
        ("0.001", runs[3].key),
        ("0.002", runs[1].key),
        ("0.002", runs[2].key),
    ]
    assert float(rows[0]["reward/mean (smoothed)"]) == pytest.approx(expected_value(MODELS[0], 16), abs=1e-12)
    assert float(rows[0]["heldout/accuracy"]) == pytest.approx(0.3 + 0.3)
    assert rows[0]["heldout/accuracy step"] == "300"
    assert rows[1]["reward/mean (smoothed)"] == "" and rows[1]["note"] == "killed at 120/300"
    assert rows[1]["heldout/accuracy step"] == "100" and rows[1]["progress"] == "120/300"
    md = (tmp_path / "sigma_table.md").read_text()
    assert "0.4000 (at 100)" in md  # held-out of the killed run, from an earlier evaluation
    v = [expected_value(MODELS[0], 8), expected_value(MODELS[0], 8, 1, 0.01)]
    assert f"| 0.002 | 2/2 | {np.mean(v):.4f} | {np.std(v, ddof=1):.4f} |" in md


def test_default_analyses_and_report_without_spec(tmp_path):
    runs = grid_runs()
    a_final, a_curves = default_analyses(runs)
    assert a_final.by == ["model.name", "es.population_size"]  # run.name / run.output_dir are bookkeeping
    assert (a_curves.metric, a_curves.hue, a_curves.panels) == ("reward/mean", "model.name", "es.population_size")
    assert parse_analyses(None, runs=runs) == [a_final, a_curves]
    assert parse_analyses(None) == []
    paths = write_report(runs, None, tmp_path)
    assert {p.name for p in paths} >= {"final_table.csv", "final_table.md", "reward_curves.png", "README.md"}


# ----------------------------------------------------------------------------- spec parsing


def test_parse_analyses_full_spec():
    raw = [
        {"kind": "scaling", "name": "popsize_table", "metric": "reward/mean", "rows": "model.name",
         "cols": "es.population_size", "reference": 64, "at": None, "smoothing": 0.99, "tolerance": 0.01},
        {"kind": "curves", "name": "popsize_curves", "panels": "model.name", "hue": "es.population_size",
         "band_window": 21},
        {"kind": "final", "name": "sigma_table", "by": "es.sigma", "select": {"model.name": MODELS[0]}},
        {"kind": "final"},
    ]  # fmt: skip
    a = parse_analyses(raw, runs=grid_runs())
    assert a[0] == TABLE6 and a[0].path == "aggregate[0]"
    assert a[1] == CurvesAnalysis(name="popsize_curves", panels="model.name", hue="es.population_size")
    assert a[2].by == ["es.sigma"] and a[2].select == {"model.name": [MODELS[0]]}
    assert a[3].name == "final_3"


def test_parse_analyses_reports_every_problem_with_its_path():
    raw = [
        {"kind": "scaling", "name": "t", "rows": "model.name", "colz": "es.population_size"},
        {"kind": "scalng", "name": "x"},
        {"kind": "curves", "name": "t", "smoothing": 1.0, "band_window": 1},
        {"kind": "curves", "name": "a/b"},
        {"kind": "final", "name": "T"},
        "final",
    ]
    with pytest.raises(ConfigError) as e:
        parse_analyses(raw, where="sweep.aggregate")
    errs = e.value.errors
    text = "\n".join(errs)
    assert any(
        x.startswith("sweep.aggregate[0].colz: unknown key") and "did you mean 'cols'" in x.lower() for x in errs
    )
    assert any(x.startswith("sweep.aggregate[0].cols: missing") for x in errs)
    assert any(
        x.startswith("sweep.aggregate[1].kind")
        and "scaling" in x
        and "curves, drift, eval_table, eval_wins, final, heldout_change, pareto, passk, scaling" in x
        for x in errs
    )
    assert any(x.startswith("sweep.aggregate[2].smoothing") and "0 <= weight < 1" in x for x in errs)
    assert any(x.startswith("sweep.aggregate[2].band_window") and ">= 2" in x for x in errs)
    assert any(x.startswith("sweep.aggregate[3].name") and "filename-safe" in x for x in errs)
    assert any(x.startswith("sweep.aggregate[4].name") and "already used by sweep.aggregate" in x for x in errs)
    assert any(x.startswith("sweep.aggregate[5]: expected a mapping") for x in errs)
    assert any(x.startswith("sweep.aggregate[2].name: 't' is already used by sweep.aggregate[0]") for x in errs)
    assert "Valid keys:" in text and len(errs) == 9

    with pytest.raises(ConfigError, match="expected a list"):
        parse_analyses({"kind": "final"})


def test_parse_analyses_checks_parameter_names_against_runs():
    raw = [
        {"kind": "curves", "name": "c", "hue": "es.popsize"},
        {"kind": "scaling", "name": "s", "rows": "model.name", "cols": "es.population_size", "reference": 65},
    ]
    with pytest.raises(ConfigError) as e:
        parse_analyses(raw, runs=grid_runs())
    hue_err, ref_err = e.value.errors
    assert hue_err.startswith("aggregate[0].hue: unknown parameter 'es.popsize'")
    assert "did you mean 'es.population_size'" in hue_err.lower()
    assert ref_err.startswith("aggregate[1].reference: 65 is not a value of es.population_size")
    assert "8, 16, 32, 64" in ref_err
    with pytest.raises(ConfigError, match="unknown parameter 'model.nam'"):
        write_report(grid_runs(), [FinalAnalysis(name="f", by=["model.nam"])], Path("/nonexistent/never-written"))


# ----------------------------------------------------------------------------- reading a sweep back (real MLflow)


def logged_sweep(tmp_path, aggregate_spec):
    """A sweep folder with a real sqlite MLflow store: s0 and s1 logged to MLflow, s2 only to its run folder."""
    from esbatch.config import config_from_dict
    from esbatch.launch.state import SweepDir
    from esbatch.tracking import MLflowTracker

    sd = SweepDir(tmp_path / "sweep")
    keys = ["s0", "s1", "s2"]
    uri = f"sqlite:///{sd.path / 'mlflow.db'}"
    sd.plan.mkdir(parents=True)
    for i, k in enumerate(keys):
        sd.plan_path(k).write_text(config_from_dict({"es": {"updates": 3}, "run": {"seed": i}}).to_yaml())
    with sd.locked() as m:
        m.update(
            name="t",
            tracking="online",
            tracking_uri=uri,
            experiment="t",
            aggregate=aggregate_spec,
            runs=[{"key": k, "label": f"seed={i}", "index": i, "point": {"run.seed": i}} for i, k in enumerate(keys)],
        )
    for i, k in enumerate(keys):
        rd = sd.run_dir(k)
        rd.path.mkdir(parents=True)
        rd.config.write_text(sd.plan_path(k).read_text())
        for t in range(3):
            rd.append_update({"t": t, "metrics": {"reward/mean": 0.1 * t + i, "policy/entropy": 2.0 - 0.5 * t + i}})
        rd.append_eval({"t": 3, "heldout/accuracy": 0.25 + i})
        rd.write_meta(status="finished", done=3)
        if k == "s2":
            continue  # never reached MLflow (its store lost): read from its folder
        tr = MLflowTracker(uri, "t", sd.path / "mlartifacts")
        tr.start(k, {"run.seed": i, "es.sigma": 0.001}, {"esbatch.sweep": "t", "esbatch.run_key": k})
        for t in range(3):
            tr.log_metrics({"reward/mean": 0.1 * t + i, "policy/entropy": 2.0 - 0.5 * t + i}, step=t + 1)
        tr.log_metrics({"heldout/accuracy": 0.25 + i}, step=3)
        tr.end("FINISHED")
    return sd


def test_aggregate_reads_any_logged_metric(tmp_path):
    """Any metric the runs logged can be analysed, not only reward/mean and heldout/accuracy; a run that never
    reached MLflow is read from its log.jsonl / eval.jsonl."""
    from esbatch.aggregate.collect import aggregate

    spec = [{"kind": "final", "name": "entropy", "metric": "policy/entropy", "smoothing": 0.0, "by": ["run.seed"]}]
    out = aggregate(logged_sweep(tmp_path, spec).path)
    rows = {r["key"]: r for r in read_csv(out / "entropy.csv")}
    for i, k in enumerate(["s0", "s1", "s2"]):
        assert float(rows[k]["policy/entropy (smoothed)"]) == pytest.approx(2.0 - 1.0 + i), rows[k]
        assert float(rows[k]["heldout/accuracy"]) == pytest.approx(0.25 + i)
        assert rows[k]["note"] == ""
    assert "no policy/entropy" not in (out / "README.md").read_text()


def test_aggregate_names_a_missing_metric_and_lists_the_logged_ones(tmp_path):
    from esbatch.aggregate.collect import aggregate

    spec = [
        {"kind": "curves", "name": "c", "metric": "policy/entropyy"},
        {"kind": "final", "name": "f", "also": ["heldout/acc"]},
    ]
    sd = logged_sweep(tmp_path, spec)
    with pytest.raises(ConfigError) as e:
        aggregate(sd.path)
    curve_err, also_err = e.value.errors
    assert curve_err.startswith("aggregate[0].metric: no run logged 'policy/entropyy'.")
    assert "Did you mean 'policy/entropy'?" in curve_err
    assert "Logged metrics: heldout/accuracy, policy/entropy, reward/mean" in curve_err
    assert also_err.startswith("aggregate[1].also[0]: no run logged 'heldout/acc'.")
    assert "Did you mean 'heldout/accuracy'?" in also_err
    assert not (sd.results / "c.csv").exists()  # nothing half-written


def test_default_report_does_not_ask_for_a_metric_nobody_logged(tmp_path):
    runs = [make_run(MODELS[0], 16), make_run(MODELS[0], 8)]
    for r in runs:
        del r.history["heldout/accuracy"]  # no held-out evaluation in this sweep
    final, _ = default_analyses(runs)
    assert final.also == []
    write_report(runs, None, tmp_path)
    with pytest.raises(ConfigError, match="no run logged 'heldout/accuracy'"):
        write_report(runs, [FinalAnalysis(name="f")], tmp_path)
