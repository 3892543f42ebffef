"""No rank spends its hang deadline (run.hang_timeout_s) waiting for a peer that is in untimed work.

Set-up (loading the model) is untimed on every rank, and so is rank 0 opening the MLflow run and logging what the
store missed. A rank that arms a phase ending in a collective while its peer is still there can be declared hung
although nothing is (CI, 2026-12-04: rank 1 of a resumed 2-rank run exited 75 from the stop check before update 2
while rank 0 spent ~40 s reopening its MLflow run on a loaded machine).

``run_updates`` is driven here as rank 0 and as rank 1 of a world of two, with every piece recording what it does.
The points where ranks meet (barriers, and the collectives inside phases) split each rank's record into segments
that run at the same time on both ranks; the property: when one rank does untimed work in a segment, the other
waits for it at an untimed barrier, never in a collective inside a timed phase.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from esbatch.train import lifecycle
from esbatch.train.lifecycle import Trainer, run_updates

UNTIMED = "untimed"


class Ranks:
    world = 2

    def __init__(self, rank: int, events: list[tuple[str, str]]) -> None:
        self.rank, self.events = rank, events
        self.lead = rank == 0

    def barrier(self) -> None:
        self.events.append(("meet", "a barrier"))

    def any(self, flag: bool) -> bool:
        self.events.append(("meet", "all_reduce (any)"))
        return flag

    def check_in_sync(self, checksum: float | None, t: int) -> None:
        if checksum is not None:  # as esbatch/train/ranks.py: no checksum, no collective
            self.events.append(("meet", "all_gather (checksums)"))


class RecordingWatchdog:
    events: list[tuple[str, str]] = []

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s

    @contextmanager
    def phase(self, what: str):
        self.events.append(("armed", what))
        yield
        self.events.append(("disarmed", what))


class ToyTrainer(Trainer):
    def __init__(self, events: list[tuple[str, str]], total: int) -> None:
        self.events, self.total = events, total

    def setup(self) -> int:
        self.events.append((UNTIMED, "setup"))
        return self.total

    def restore(self, records: list[dict[str, Any]]) -> int:
        return len(records)

    def step(self, t: int) -> dict[str, Any]:
        return {"t": t, "metrics": {"reward/mean": 0.5}}

    def save(self, t: int, final: bool) -> None:
        pass

    def evaluate(self) -> dict[str, float]:
        return {}

    def checksum(self) -> float | None:
        return 1.0

    @property
    def n_train(self) -> int:
        return 4


class Run:
    """What run_updates reads of a RunSession; rank 0's MLflow work is recorded as untimed."""

    def __init__(self, ranks: Ranks, events: list[tuple[str, str]], resume: bool) -> None:
        self.ranks, self.lead, self.events, self.resume = ranks, ranks.lead, events, resume
        self.cfg = SimpleNamespace(
            algorithm="es",
            run=SimpleNamespace(hang_timeout_s=3600.0),
            eval=SimpleNamespace(every=1, tasks=[]),
            checkpoint=SimpleNamespace(every=1, snapshots=[]),
            tracking=SimpleNamespace(log_model=False),
        )
        logged = [{"t": 0, "metrics": {"reward/mean": 0.25}}] if resume else []
        self.rd = SimpleNamespace(
            updates=lambda: logged, evals=lambda: [], log=_Missing(), eval_log=_Missing(), path="run"
        )
        self.tags: dict[str, str] = {}
        self.watchdog = None

    def start(self, total: int, **meta: Any) -> None:
        if self.lead:
            self.events.append((UNTIMED, "opening the MLflow run"))

    def log_missing_steps(self, records: list[dict[str, Any]]) -> None:
        if self.lead:
            self.events.append((UNTIMED, "logging the steps MLflow missed"))

    def record_update(self, rec: dict[str, Any]) -> None:
        pass

    def record_eval(self, t: int, scores: dict[str, float]) -> None:
        pass

    def summary(self, total: int, **extra: Any) -> dict[str, Any]:
        return {}


class _Missing:
    def exists(self) -> bool:
        return False


def record(rank: int, resume: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], str, str | None]]:
    """Rank ``rank``'s segments: (its untimed work, the meeting point that ends it, the phase it waits in there)."""
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(RecordingWatchdog, "events", events)
    monkeypatch.setattr(lifecycle, "Watchdog", RecordingWatchdog)
    ranks = Ranks(rank, events)
    run_updates(Run(ranks, events, resume), ToyTrainer(events, total=3), progress=False)  # type: ignore[arg-type]
    segments, untimed, open_phases = [], [], []
    for kind, what in events:
        if kind == UNTIMED:
            untimed.append(what)
        elif kind == "armed":
            open_phases.append(what)
        elif kind == "disarmed":
            assert open_phases.pop() == what
        else:
            segments.append((untimed, what, open_phases[-1] if open_phases else None))
            untimed = []
    return segments


@pytest.mark.parametrize("resume", [False, True], ids=["new-run", "resumed-run"])
def test_no_rank_times_a_phase_while_a_peer_is_in_untimed_work(resume, monkeypatch):
    lead, peer = record(0, resume, monkeypatch), record(1, resume, monkeypatch)
    assert [m for _, m, _ in lead] == [m for _, m, _ in peer], "both ranks must meet at the same points"
    assert any(u for u, _, _ in lead) and any(p for _, _, p in peer)  # the property is not empty
    for i, (a, b) in enumerate(zip(lead, peer, strict=True)):
        for (untimed, _, _), (_, meet, phase) in ((a, b), (b, a)):
            assert not (untimed and phase), (
                f"before meeting point {i} ({meet}) one rank does untimed work ({untimed}) while the other waits "
                f"there inside the timed phase {phase!r}: its deadline runs out waiting"
            )
