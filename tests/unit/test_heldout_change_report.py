"""The ``heldout_change`` analysis and the ``curves`` Wilson band (esbatch/aggregate/report.py), on in-memory runs and
eval.jsonl records: the table's numbers, the notes for runs that cannot be paired, and the config errors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from esbatch.aggregate.collect import folder_history
from esbatch.aggregate.paired import paired_change, wilson
from esbatch.aggregate.report import (
    CurvesAnalysis,
    parse_analyses,
    run_eval_records,
    write_curves,
    write_heldout_change,
    write_report,
)
from esbatch.aggregate.results import RunResult
from esbatch.config import ConfigError
from esbatch.config.aggregate import HeldoutChangeAnalysis
from esbatch.train.rundir import RunDir

T = 300
HELD = "heldout/accuracy"


def make_run(key: str, n_pop: int, accs: dict[int, float] | None = None, status: str = "finished", size=10):
    params = {"es.population_size": n_pop, "run.seed": 0, "task.heldout_size": size, "run.name": key}
    hist = {HELD: sorted((accs or {}).items())}
    return RunResult(key, f"N{n_pop}-{key}", status, params, T, hist)


def rec(t: int, correct: str | None, acc: float | None = None) -> dict:
    out = {"t": t, HELD: acc if acc is not None else correct.count("1") / len(correct), "heldout/reward": 0.1}
    if correct is not None:
        out["heldout/correct"] = correct
    return out


RECORDS = {
    # N=32 first in the sweep, N=8 second: the table orders by population size
    "big": {0: rec(0, "1110000000"), 100: rec(100, "1110000001"), T: rec(T, "0111100000")},
    "small": {0: rec(0, "0000000000" * 4), T: rec(T, "1111111111" + "11" + "0" * 28)},
    "old": {0: rec(0, None, 0.3), T: rec(T, None, 0.5)},  # before per-problem verdicts were kept
    "resumed": {0: rec(0, None, 0.3), T: rec(T, "1111100000")},  # resumed with the new code
    "mixed": {0: rec(0, "111"), T: rec(T, "1111")},
    "early": {0: rec(0, "1100")},  # only its update-0 evaluation so far
}
RUNS = [
    make_run("big", 32, {0: 0.3, 100: 0.4, T: 0.4}),
    make_run("small", 8, {0: 0.0, T: 0.3}, size=40),
    make_run("old", 16, {0: 0.3, T: 0.5}),
    make_run("resumed", 16, {0: 0.3, T: 0.5}),
    make_run("mixed", 16, {0: 1.0, T: 1.0}),
    make_run("early", 64, {0: 0.5}, status="running"),
    make_run("never", 64, status="pending"),
]


def records(r: RunResult) -> dict:
    return RECORDS.get(r.key, {})


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def md_rows(md: str) -> dict[str, list[str]]:
    """Table rows of a Markdown section by their run label."""
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    at = header.index("run")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    return {cells[at]: cells for cells in rows}


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def test_table_numbers_and_the_notes_of_runs_that_do_not_pair(tmp_path):
    a = HeldoutChangeAnalysis(name="change", hue="es.population_size")
    section = write_heldout_change(RUNS, a, tmp_path, records, "sweep x")
    md = (tmp_path / "change.md").read_text()
    assert section.markdown in md and "![change](change.png)" in md
    assert (tmp_path / "change.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = md_rows(md)
    assert [r[0] for r in rows.values()] == ["8", "16", "16", "16", "32", "64", "64"]  # ordered by the hue value

    # N=32: 3/10 -> 4/10, gained 2 (problems 3, 4), lost 1 (problem 0)
    big = rows["N32-big"]
    c = paired_change("1110000000", "0111100000")
    lo1, hi1 = wilson(3, 10)
    lo2, hi2 = wilson(4, 10)
    assert big[2:9] == [
        "0→300",
        "10",
        f"30.0 [{pct(lo1)}, {pct(hi1)}]",
        f"40.0 [{pct(lo2)}, {pct(hi2)}]",
        f"+10.0 [{100 * c.lo:+.1f}, {100 * c.hi:+.1f}]",  # not bold: the interval holds 0
        "2/1",
        "1.000",  # McNemar: 2 vs 1 discordant
    ]
    assert c.lo < 0 < c.hi and big[9] == ""
    assert (pct(lo1), pct(hi1)) == ("10.8", "60.3")  # the Wilson interval of 3/10, by its textbook value

    # N=8: 0/40 -> 12/40, all gained: the change is bold (its interval excludes 0), McNemar 2 * 0.5**12
    small = rows["N8-small"]
    assert small[3:5] == ["40", "0.0 [0.0, 8.8]"]
    assert small[6].startswith("**+30.0 [") and small[6].endswith("]**")
    assert small[7:9] == ["12/0", f"{2 * 0.5**12:.1e}"]

    assert rows["N16-old"][3:9] == ["—"] * 6
    assert (
        "no per-problem verdicts (heldout/correct) in eval.jsonl at updates 0 and 300: the run predates them"
        in (rows["N16-old"][9])
    )
    assert "at update 0: that evaluation predates them" in rows["N16-resumed"][9]
    assert rows["N16-mixed"][9] == (
        "N16-mixed: its evaluations at updates 0 and 300 scored different numbers of problems (3 and 4), so they do "
        "not pair"
    )
    assert rows["N64-early"][9] == "running: no evaluation after update 0 yet"
    assert rows["N64-never"][9] == "pending: no held-out evaluation in eval.jsonl"
    assert "paired 95% interval: the 2.5th and 97.5th percentiles of the mean per-problem difference" in md
    assert "2,000 bootstrap resamples of the held-out problems with replacement (seed 0" in md

    by_key = {r["key"]: r for r in read_csv(tmp_path / "change.csv")}
    b = by_key["big"]
    assert (b["es.population_size"], b["first"], b["last"], b["problems"]) == ("32", "0", "300", "10")
    assert float(b["change_lo"]) == c.lo and float(b["change_hi"]) == c.hi and float(b["change"]) == c.change
    assert (float(b["acc_first_lo"]), float(b["acc_first_hi"])) == (lo1, hi1)
    assert (b["gained"], b["lost"], b["excludes_zero"]) == ("2", "1", "false")
    assert by_key["small"]["excludes_zero"] == "true"
    assert by_key["old"]["change"] == "" and "predates them" in by_key["old"]["note"]


def test_first_and_last_pick_the_evaluations_and_a_missing_one_is_named(tmp_path):
    a = HeldoutChangeAnalysis(name="mid", first=0, last=100, select={"es.population_size": [32, 8]})
    md = write_heldout_change(RUNS, a, tmp_path, records).markdown
    rows = md_rows(md)
    assert set(rows) == {"N32-big", "N8-small"}  # select kept two runs; no hue: the sweep's order
    c = paired_change("1110000000", "1110000001")  # one problem gained: the interval ends exactly at 0
    assert c.lo == 0.0
    assert rows["N32-big"][1:8] == [
        "0→100",
        "10",
        "30.0 [10.8, 60.3]",
        "40.0 [16.8, 68.7]",
        f"+10.0 [+0.0, {100 * c.hi:+.1f}]",  # not bold: an end at 0 does not exclude it
        "1/0",
        "1.000",
    ]
    assert rows["N8-small"][-1] == "no evaluation at update 100 (evaluated at updates 0, 300)"
    assert "at update 0 and at update 100" in md


def test_a_report_with_heldout_change_needs_the_sweep_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"kind 'heldout_change' reads the run folders of a sweep"):
        write_report(RUNS, [HeldoutChangeAnalysis(name="c", path="aggregate[0]")], tmp_path)


def test_config_errors_name_the_key_and_what_is_valid():
    with pytest.raises(ConfigError) as e:
        parse_analyses(
            [
                {"kind": "curves", "metric": HELD, "band": "wide"},
                {"kind": "heldout_change", "hue": "es.popsize"},
                {"kind": "heldout_change", "first": 50, "last": 50},
                {"kind": "curves", "band": "wilson"},
                {"kind": "heldout_change", "metric": "reward/mean"},
                {"kind": "heldout_change", "first": -1},
            ]
        )
    errs = e.value.errors
    assert "aggregate[0].band: 'wide' is not a valid choice. Valid: residual, wilson" in errs
    assert any(x.startswith("aggregate[2].last: 50 is not after first (50)") for x in errs)
    assert any(x.startswith("aggregate[3].band: 'wilson'") and "needs metric: heldout/accuracy" in x for x in errs)
    assert any(x.startswith("aggregate[4].metric: unknown key for kind 'heldout_change'") for x in errs)
    assert "aggregate[5].first: got -1; expected an update count (integer >= 0)" in errs
    with pytest.raises(ConfigError) as e:
        parse_analyses([{"kind": "heldout_change", "hue": "es.popsize"}], runs=RUNS)
    (err,) = e.value.errors
    assert err.startswith("aggregate[0].hue: unknown parameter 'es.popsize'")
    assert "did you mean 'es.population_size'" in err.lower()
    (ok,) = parse_analyses([{"kind": "heldout_change", "hue": "es.population_size", "last": 300}], runs=RUNS)
    assert (ok.first, ok.last, ok.metric) == (0, 300, HELD)


def test_run_eval_records_joins_a_pipelines_stages_on_its_update_axis(tmp_path):
    def write(folder: Path, recs: list[dict], total: int | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"t": 9, "torn')
        if total is not None:
            (folder / "run.json").write_text(json.dumps({"total_updates": total}))

    plain = tmp_path / "plain"
    write(plain, [rec(0, "01"), rec(5, "00"), rec(5, "11")])
    assert {t: r["heldout/correct"] for t, r in run_eval_records(plain).items()} == {0: "01", 5: "11"}
    pipe = tmp_path / "pipe"
    write(pipe / "stage1-es", [rec(0, "00"), rec(4, "10")], total=4)
    write(pipe / "stage2-grpo", [rec(0, "11"), rec(4, "01")], total=4)
    got = {t: r["heldout/correct"] for t, r in run_eval_records(pipe).items()}
    assert got == {0: "00", 4: "10", 8: "01"}  # stage 2's step 0 scores the weights stage 1's step 4 did
    assert sorted(got) == [t for t, _ in folder_history(RunDir(pipe))[HELD]]  # the metrics' update axis
    assert run_eval_records(tmp_path / "absent") == {}


class Drawn:
    """The bands and titles a curves plot draws (matplotlib's calls recorded)."""

    def __init__(self, monkeypatch):
        from matplotlib.axes import Axes
        from matplotlib.figure import Figure

        self.bands, self.titles = [], []
        fill, title = Axes.fill_between, Figure.suptitle

        def fill_between(ax, x, lo, hi, **kw):
            self.bands.append((np.asarray(x), np.asarray(lo, dtype=float), np.asarray(hi, dtype=float)))
            return fill(ax, x, lo, hi, **kw)

        def suptitle(fig, t, **kw):
            self.titles.append(t)
            return title(fig, t, **kw)

        monkeypatch.setattr(Axes, "fill_between", fill_between)
        monkeypatch.setattr(Figure, "suptitle", suptitle)


def test_wilson_band_pools_the_counts_of_a_lines_runs_and_is_drawn_without_smoothing(tmp_path, monkeypatch):
    runs = [
        make_run("s0", 16, {0: 0.3, 10: 0.5}),
        make_run("s1", 16, {0: 0.2, 10: 0.8}),  # no records: its task.heldout_size counts
        make_run("n8", 8, {0: 0.5, 10: 0.5}, size=None),  # neither verdicts nor a size: no band
    ]
    recs = {"s0": {0: rec(0, "1110000000"), 10: rec(10, "1111100000")}}
    drawn = Drawn(monkeypatch)
    a = CurvesAnalysis(name="acc", metric=HELD, hue="es.population_size", smoothing=0.0, band="wilson")
    section = write_curves(runs, a, tmp_path, "", lambda r: recs.get(r.key, {}))
    rows = [r for r in read_csv(tmp_path / "acc.csv") if r["es.population_size"] == "16"]
    assert list(rows[0]) == [
        "panel", "es.population_size", "step", "raw_mean", "smoothed", "wilson_lo", "wilson_hi", "problems", "n_runs"
    ]  # fmt: skip
    assert [(r["step"], r["problems"]) for r in rows] == [("0", "20"), ("10", "20")]
    assert [(float(r["wilson_lo"]), float(r["wilson_hi"])) for r in rows] == [wilson(3 + 2, 20), wilson(5 + 8, 20)]
    (x16, lo16, hi16), (x8, lo8, _) = sorted(drawn.bands, key=lambda b: -np.isfinite(b[1]).sum())
    assert list(x16) == [0, 10] and list(lo16) == [wilson(5, 20)[0], wilson(13, 20)[0]]
    assert np.isnan(lo8).all()
    assert drawn.titles and "band Wilson 95% of raw accuracy" in drawn.titles[-1] and "raw," in drawn.titles[-1]
    assert "shading: the Wilson 95% score interval of the raw held-out accuracy" in section.markdown
    assert "Lines: raw heldout/accuracy (no smoothing)" in section.markdown
    lo, hi = wilson(13, 20)
    assert f"[{lo:.4f}, {hi:.4f}] (n=20)" in section.markdown and (lo, hi) == pytest.approx((0.4329, 0.8188), abs=1e-4)
    assert "Line 8: no Wilson band at 2 of its 2 updates" in section.markdown


def test_residual_band_is_the_default_and_unchanged(tmp_path, monkeypatch):
    runs = [make_run("s0", 16, {t: 0.3 + 0.01 * math.sin(t) for t in range(0, 50)})]
    drawn = Drawn(monkeypatch)
    a = CurvesAnalysis(name="res", metric=HELD, hue="es.population_size", band_window=5)
    assert a.band == "residual"
    section = write_curves(runs, a, tmp_path)
    assert list(read_csv(tmp_path / "res.csv")[0]) == [
        "panel", "es.population_size", "step", "raw_mean", "smoothed", "band_std", "n_runs"
    ]  # fmt: skip
    assert "shading: ± the local standard deviation (window 5) of the raw-minus-smoothed residuals" in section.markdown
    assert drawn.titles[-1].endswith("heldout/accuracy, debiased EMA 0.99, band ± local std (window 5)")
    assert len(drawn.bands) == 1
    drawn.bands.clear()
    write_curves(runs, CurvesAnalysis(name="raw", metric=HELD, smoothing=0.0), tmp_path)
    assert drawn.bands == [] and drawn.titles[-1].endswith("heldout/accuracy, raw")  # no band without smoothing
