"""Durations come from a monotonic clock (esbatch/clock.py, issue 44 D3): a wall-clock jump of -2 h mid-run moves
neither the progress bar's elapsed time and ETA nor the MLflow run's end relative to its start. The clocks are
injected; nothing sleeps."""

from __future__ import annotations

import io

import pytest
import tqdm.std
from mlflow.tracking import MlflowClient

from esbatch.clock import Anchor, progress
from esbatch.tracking import MLflowTracker, spool_path

JUMP_S = -7200.0


class Clocks:
    """A monotonic clock the test advances by hand, and a wall clock that also jumps."""

    def __init__(self) -> None:
        self.mono, self.wall_s = 500.0, 1.7e9

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall_s += s

    def jump(self, s: float) -> None:
        self.wall_s += s

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.wall_s


def test_an_anchor_moves_with_the_monotonic_clock_not_the_wall_clock():
    c = Clocks()
    a = Anchor(c.wall, c.monotonic)
    c.advance(10)
    c.jump(JUMP_S)
    assert a.now() == 1.7e9 + 10 and a.now_ms() == int((1.7e9 + 10) * 1000)
    assert c.wall() == 1.7e9 + 10 + JUMP_S  # the wall clock did jump


def test_the_progress_bar_eta_ignores_a_wall_clock_jump(monkeypatch):
    c = Clocks()
    monkeypatch.setattr(tqdm.std, "time", c.wall)  # what tqdm reads by default
    out = io.StringIO()
    bar = progress(total=10, file=out, clock=c.monotonic, mininterval=0, ascii=True)
    for _ in range(5):
        c.advance(2.0)  # an update every 2 s
        bar.update(1)
    c.jump(JUMP_S)
    d = bar.format_dict
    assert d["elapsed"] == 10.0 and d["n"] == 5
    assert "00:10<00:10" in bar.__str__()  # 10 s elapsed, 5 updates left at 2 s each
    bar.close()

    plain = tqdm.std.tqdm(total=10, file=io.StringIO(), mininterval=0)  # the default: time.time
    c.advance(10.0)
    plain.update(5)
    c.jump(JUMP_S)
    assert plain.format_dict["elapsed"] < 0  # what the monotonic clock prevents
    plain.close()


@pytest.mark.parametrize("status", ["FINISHED", "FAILED"])
def test_the_mlflow_run_ends_after_its_start_by_the_monotonic_elapsed_time(tmp_path, status):
    c = Clocks()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "run").mkdir()
    tr = MLflowTracker(
        store, "t", spool=spool_path(tmp_path / "run"), sleep=lambda s: None, clock=c.monotonic, wall=c.wall
    )
    run_id = tr.start("r", {}, {})
    c.advance(30.0)
    tr.log_metrics({"reward/mean": 0.5}, step=1)
    c.advance(30.0)
    c.jump(JUMP_S)  # a faketime-style jump back by 2 h before the run ends
    tr.end(status)
    info = MlflowClient(store).get_run(run_id).info
    assert info.status == status
    assert info.start_time == int(1.7e9 * 1000)
    assert info.end_time - info.start_time == 60_000
    (m,) = MlflowClient(store).get_metric_history(run_id, "reward/mean")
    assert m.timestamp - info.start_time == 30_000
