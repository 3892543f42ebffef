"""The watchdog (esbatch/train/watchdog.py) on a clock the test moves by hand: a phase that ends before its
deadline never fires, nested phases count the innermost one's deadline and report its name, and an overdue
phase fires exactly once. ``poke`` returns once the watch thread has compared the current phase with the
current clock, so every assertion is about what the watchdog saw, not about how fast its thread ran."""

from __future__ import annotations

from esbatch.train.watchdog import Watchdog

LIMIT = 0.2
GUARD_S = 60  # only against a broken watch thread hanging the suite: a healthy one looks at once


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_watchdog_names_the_phase_and_spares_phases_that_finish():
    clock, hung = Clock(), []
    wd = Watchdog(LIMIT, on_hang=lambda what, limit: hung.append((what, limit)), clock=clock)

    def look() -> list[tuple[str, float]]:
        assert wd.poke(timeout=GUARD_S), "the watch thread did not look"
        return hung

    assert look() == []  # no phase: nothing to time
    with wd.phase("quick"):
        clock.now += LIMIT / 2
        assert look() == []  # within its deadline
    clock.now += 100 * LIMIT  # far past the deadline "quick" had
    assert look() == []  # a finished phase is disarmed

    with wd.phase("outer"):  # deadline: start + LIMIT
        clock.now += 0.75 * LIMIT
        with wd.phase("slow inner"):  # deadline: start + 1.75 LIMIT
            clock.now += 0.5 * LIMIT  # 0.25 LIMIT past outer's deadline, 0.75 LIMIT before its own
            assert look() == []  # outer's deadline has passed, but the innermost phase's counts while it lasts
            clock.now += LIMIT  # 0.5 LIMIT past it
            assert look() == [("slow inner", LIMIT)]  # past its own deadline: named, with the limit
            for _ in range(3):
                clock.now += 10 * LIMIT
                assert look() == [("slow inner", LIMIT)]  # fired exactly once
        assert look() == [("slow inner", LIMIT), ("outer", LIMIT)]  # back in outer: its own deadline, long gone
    clock.now += 100 * LIMIT
    assert look() == [("slow inner", LIMIT), ("outer", LIMIT)]  # no phase left: nothing more

    with wd.phase("next"):  # a new phase after a hang is timed afresh
        clock.now += LIMIT / 2
        assert len(look()) == 2
        clock.now += LIMIT
        assert look()[2:] == [("next", LIMIT)]
