"""Which worker evaluates which member of a population: vLLM engines in one process, or ranks of a run.

static: worker w takes members w, w + W, w + 2W, ... (a fixed plan: one slow worker leaves the others idle
while it finishes its share). dynamic: a work queue: a worker takes the next member nobody has taken yet as
soon as it is free, so fast workers take more members. A shared ``claim`` (a counter in the ranks' store,
esbatch/train/ranks.py) is dynamic across processes: each worker of each rank takes from it.

Who evaluated a member never changes the center: a member is center + scale * eps(seed) with exact restore
(esbatch/perturb), the results come back keyed by member, and callers use them in member order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

R = TypeVar("R")
SCHEDULES = ("static", "dynamic")
Claim = Callable[[], int | None]  # the next member nobody has taken yet, None when all are taken


@dataclass
class WorkerLoad:
    items: list[int]  # the members this worker evaluated, in the order it took them
    busy_s: float  # seconds inside ``work``
    idle_s: float  # the rest of the population's wall time: waiting for the slowest worker


@dataclass
class Dispatched(Generic[R]):
    results: dict[int, R]  # member -> what ``work`` returned for it
    workers: list[WorkerLoad]
    wall_s: float  # from the first member taken to the last one finished

    @property
    def order(self) -> list[int]:
        """The members evaluated, ascending (member order, whoever evaluated them)."""
        return sorted(self.results)

    @property
    def idle_s(self) -> float:
        """Worker-seconds spent waiting while others still worked: what dynamic dispatch wins back."""
        return sum(w.idle_s for w in self.workers)


def dispatch(
    items: Sequence[int] | Claim,
    n_workers: int,
    work: Callable[[int, int], R],
    schedule: str = "dynamic",
    pool: Executor | None = None,
) -> Dispatched[R]:
    """Evaluate ``work(worker, item)`` for every item with ``n_workers`` workers in parallel (threads).

    ``items``: the members to evaluate, or a shared ``Claim`` (then every worker takes from it, whatever the
    schedule). ``pool``: threads to run the workers on (at least ``n_workers``); one worker runs in this thread.
    The first error of any worker stops the others taking new members and is raised here.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown dispatch schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    failed = threading.Event()
    take = _taker(items, n_workers, schedule, failed)
    results: dict[int, R] = {}
    t_start = time.perf_counter()

    def run(w: int) -> tuple[list[int], float]:
        mine, busy = [], 0.0
        try:
            while (i := take(w)) is not None:
                t0 = time.perf_counter()
                results[i] = work(w, i)  # distinct keys per worker: dict item assignment is atomic
                busy += time.perf_counter() - t0
                mine.append(i)
        except BaseException:
            failed.set()
            raise
        return mine, busy

    if n_workers == 1:
        loads = [run(0)]
    else:
        own = pool is None
        pool = pool or ThreadPoolExecutor(max_workers=n_workers)
        try:
            futures = [pool.submit(run, w) for w in range(n_workers)]
            loads = [f.result() for f in futures]
        finally:
            if own:
                pool.shutdown()
    wall = time.perf_counter() - t_start
    return Dispatched(results, [WorkerLoad(m, b, max(0.0, wall - b)) for m, b in loads], wall)


def _taker(
    items: Sequence[int] | Claim, n_workers: int, schedule: str, failed: threading.Event
) -> Callable[[int], int | None]:
    """worker -> its next item (None: stop), by the schedule; none once any worker has failed."""
    if callable(items):
        claim = items
        return lambda w: None if failed.is_set() else claim()
    if schedule == "static":
        plans = [iter(items[w::n_workers]) for w in range(n_workers)]
        return lambda w: None if failed.is_set() else next(plans[w], None)
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in items:
        todo.put(i)

    def next_free(w: int) -> int | None:
        if failed.is_set():
            return None
        try:
            return todo.get_nowait()
        except queue.Empty:
            return None

    return next_free
