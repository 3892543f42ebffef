"""The analyses at their boundaries. Drift and threshold: s_tau counts 0 < |delta| <= tau and a thresholded
checkpoint zeroes exactly those coordinates, for a float32 |delta| exactly at tau, the float32 just above it,
float32(tau) where that rounds up past tau (1e-3, 1e-5, ...), and delta = 0. Tables that are not square: a scaling
grid with holes and a row without its reference, a gap exactly at the tolerance, an eval table and win count where
one model lacks a task, and ties (not a win, not below base)."""

from __future__ import annotations

import csv
import json
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_eval_tables import write_eval

from esbatch.aggregate.evals import EvalSet, load_evals, write_eval_table, write_eval_wins
from esbatch.aggregate.report import scaling_cells
from esbatch.aggregate.results import RunResult
from esbatch.analyze.drift import drift_stats, fp32_at_most
from esbatch.analyze.threshold import threshold_tensors
from esbatch.config.aggregate import ScalingAnalysis, parse_specs
from esbatch.launch.state import SweepDir


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def next_up(x: float) -> float:
    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] + 1))[0]


@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_fp32_at_most_is_the_largest_float32_not_above_tau(tau):
    t = fp32_at_most(tau)
    assert f32(t) == t and t <= tau < next_up(t)


TAUS = [1e-6, 1e-5, 1e-4, 1e-3, 2.0**-10]


@pytest.mark.parametrize("tau", TAUS)
def test_s_tau_and_thresholding_count_exactly_the_coordinates_at_most_tau(tau):
    at, above, rounded = fp32_at_most(tau), next_up(fp32_at_most(tau)), f32(tau)
    # |delta| values (theta_0 = 0, so delta is the value itself, exact): at tau, just above, float32(tau), 0,
    # and negative deltas of the same sizes
    deltas = [at, above, rounded, 0.0, -at, -above]
    inside = [abs(d) <= tau and d != 0 for d in deltas]
    assert inside[0] and not inside[1] and inside[2] == (rounded <= tau)  # 1e-3: float32(tau) > tau
    center = {"model.layers.0.mlp.up_proj.weight": torch.tensor(deltas, dtype=torch.float32)}
    base = {"model.layers.0.mlp.up_proj.weight": torch.zeros(len(deltas))}
    s = drift_stats(center, base, taus=[tau], top_k=3)
    assert s.n_nonzero == 5 and s.below == [sum(inside)]
    assert s.s_tau() == [sum(inside) / 5]

    class Keep:
        def write(self, name, t):
            self.t = t.clone()

    w = Keep()
    (counts,) = threshold_tensors(center, base, [tau], "float32", [w])
    assert counts == {"zeroed": sum(inside), "nonzero": 5, "total": len(deltas)}
    assert w.t.tolist() == [0.0 if z else d for d, z in zip(torch.tensor(deltas).tolist(), inside)]


def test_float32_of_1e_3_is_above_1e_3_and_not_counted():
    """The case that was wrong: torch rounded tau to float32 before comparing."""
    d = f32(1e-3)
    assert d > 1e-3
    center, base = {"w": torch.tensor([d])}, {"w": torch.zeros(1)}
    assert drift_stats(center, base, taus=[1e-3]).below == [0]
    assert drift_stats(center, base, taus=[d]).below == [1]


# ----------------------------------------------------------------------------- tables that are not square


def constant_run(model: str, n: int, value: float) -> RunResult:
    params = {"model.name": model, "es.population_size": n, "run.seed": 0}
    return RunResult(f"{model}/N{n}", f"{model}-N{n}", "finished", params, 10, {"reward/mean": [(10, value)]})


def test_a_ragged_scaling_grid_keeps_its_holes_and_gaps_only_against_a_present_reference():
    runs = [constant_run("a", n, 0.5) for n in (8, 16, 64)]  # a: every column but 32
    runs += [constant_run("b", n, 0.25) for n in (8, 32)]  # b: no reference column (64)
    runs += [constant_run("c", 64, 0.75)]  # c: the reference only
    a = ScalingAnalysis(name="s", rows="model.name", cols="es.population_size", reference=64, smoothing=0.0)
    rows, cols, cells = scaling_cells(runs, a)
    assert (rows, cols) == (["a", "b", "c"], [8, 16, 32, 64]) and len(cells) == 12
    by = {(c.row, c.col): c for c in cells}
    assert by["a", 32].runs == [] and by["a", 32].value is None and by["a", 32].gap is None
    assert [by["a", n].gap for n in (8, 16, 64)] == [0.0, 0.0, 0.0]
    assert all(by["b", n].gap is None and by["b", n].within is None for n in cols)  # no reference in its row
    assert by["c", 64].gap == 0.0 and by["c", 64].within is None and by["c", 8].value is None


@pytest.mark.parametrize(
    "other, within",
    [
        (0.25, True),  # |gap| exactly the tolerance (0.25, exact in binary)
        (0.25 - 0.5e-12, True),  # inside the 1e-12 slack for rounding in the subtraction
        (0.25 - 2e-12, False),  # just outside it
        (0.75, True),  # the same distance above the reference
    ],
)
def test_a_gap_exactly_at_the_tolerance_is_within(other, within):
    runs = [constant_run("a", 64, 0.5), constant_run("a", 8, other)]
    a = ScalingAnalysis(name="s", rows="model.name", cols="es.population_size", tolerance=0.25, smoothing=0.0)
    _, _, cells = scaling_cells(runs, a)
    (cell,) = [c for c in cells if c.col == 8]
    assert cell.within is within


@pytest.fixture
def ragged(tmp_path) -> EvalSet:
    """ES evaluated on two of the three tasks (its B column is empty); GRPO on all three, with B equal to base."""
    sd = SweepDir(tmp_path / "sw")
    evals = [
        write_eval(sd, "base-1", "Base", {"Train": [1, 1, 1, 1], "A": [2, 2, 0, 0], "B": [4, 0, 0, 0]}),
        write_eval(sd, "ev-es", "ES", {"Train": [2, 2, 2, 2], "A": [2, 2, 1, 1]}),
        write_eval(sd, "ev-grpo", "GRPO", {"Train": [4, 4, 4, 0], "A": [2, 2, 1, 1], "B": [4, 0, 0, 0]}),
    ]
    sd.meta_path.write_text(json.dumps({"name": "sw", "runs": [], "evals": evals, "train_task": "Train"}))
    return load_evals(sd)


def test_a_task_one_model_lacks_is_a_dash_and_its_average_says_over_how_many(ragged, tmp_path):
    (a,) = parse_specs([{"kind": "eval_table", "name": "t", "metrics": ["pass@1"]}])
    write_eval_table(ragged, a, tmp_path)
    md = (tmp_path / "t.md").read_text()
    assert "| ES | 50.0 | 37.5 | — | 37.5 (1 tasks) |" in md, md
    assert "| GRPO | 75.0 | 37.5 | 25.0 | 31.2 |" in md, md
    (d,) = parse_specs([{"kind": "eval_table", "name": "d", "metrics": ["pass@1"], "delta": True}])
    write_eval_table(ragged, d, tmp_path)
    md = (tmp_path / "d.md").read_text()
    es_row = next(line for line in md.splitlines() if line.startswith("| ES |"))
    assert es_row.split(" | ")[3] == "—" and es_row.endswith("(1) |"), es_row  # the average over A alone


def test_wins_skip_a_missing_cell_and_a_tie_is_neither_a_win_nor_below_base(ragged, tmp_path):
    (w,) = parse_specs([{"kind": "eval_wins", "name": "w", "a": "ES", "b": "GRPO", "metrics": ["pass@1"]}])
    write_eval_wins(ragged, w, tmp_path)
    (row,) = list(csv.DictReader((tmp_path / "w.csv").open()))
    # Train: ES 50 < GRPO 75; A: 37.5 = 37.5 (a tie); B: ES has none, not a comparison
    assert (row["comparisons"], row["wins"], row["significant_wins"]) == ("2", "0", "0"), row
    # below base (Train 25, A 25, B 31.25): nobody; GRPO's B equals base exactly and is not below it
    assert (row["a_below_base"], row["b_below_base"]) == ("0", "0"), row
