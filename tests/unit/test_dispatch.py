"""Dynamic dispatch (esbatch/backends/dispatch.py): a work queue over workers of unequal speed evaluates every
member once, in member order, and leaves less idle time than the static plan; ranks share members through a
store counter; the vLLM backend's engines go through the same function (fake engines here: tests/vllm_cpu
would need two real engines per schedule); and ES with ranks taking members dynamically ends on the center of
the static single-process run, bit for bit.

No assertion rests on the speed of threads: slow and fast workers are made so by construction. ``Lockstep``
runs the workers in virtual time (a member costs each worker a fixed number of virtual seconds, and a worker
returns from its member only when it is the next to finish), so who takes which member and the busy, idle and
wall seconds are exact; the ranks' tests hold the slow rank between members until the fast one has taken all
the others. Waits carry a generous timeout only so that a broken dispatch fails instead of hanging the suite.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from esbatch.backends import dispatch as dispatching
from esbatch.backends import vllm as vllm_backend
from esbatch.backends.base import Generation, PerturbedMember, SamplingParams
from esbatch.backends.dispatch import dispatch
from esbatch.backends.vllm_rpc import WorkerCall
from esbatch.config import config_from_dict
from esbatch.es.trainer import es_step
from esbatch.train.problems import load_problems
from esbatch.train.ranks import Ranks, combine_rows, store_claim

FAST, SLOW = 1.0, 5  # virtual seconds per member on a fast worker; worker 0 takes SLOW times as long
N, W = 12, 3
COST = [FAST * SLOW] + [FAST] * (W - 1)
GUARD_S = 60  # the longest any wait may block before the test calls the dispatch stuck
STATIC = [list(range(w, N, W)) for w in range(W)]  # member i on worker i mod W
# dynamic, in virtual time: members 1-10 go to the fast workers two at a time (at t = 0, 1, ..., 4; ties to the
# lower worker), member 11 to worker 0, free at t = 5 with them (first by the tie); the fast ones end at 6, it at 10
DYNAMIC = [[0, 11], [1, 3, 5, 7, 9], [2, 4, 6, 8, 10]]


def waited(ok: bool) -> None:
    assert ok, f"waited {GUARD_S} s: the dispatch is stuck"


class Lockstep(Executor):
    """A pool for ``dispatch`` that runs its workers in virtual time: a deterministic simulation of workers of
    unequal speed, whatever the threads' real speed.

    A worker's work calls ``step(w)``: its member costs ``cost[w]`` virtual seconds from now, and step returns
    only when no worker is between members (taking the next one; not yet started counts too) and w's member is
    the next to finish (ties: the lower worker first). So the worker free first in virtual time takes the next
    member, exactly as a free worker would on a real clock. Workers start one at a time in the order submitted
    (worker w after worker w - 1 is inside its first step or has returned): the first members go to workers 0,
    1, 2, ... ``clock`` reads the virtual time: patched in for time.perf_counter, busy, idle and wall seconds
    are exact.
    """

    def __init__(self, cost: Sequence[float]) -> None:
        self.cost, self.now = list(cost), 0.0
        self._pool = ThreadPoolExecutor(max_workers=len(cost))
        self._cond = threading.Condition()
        self._busy: dict[int, float] = {}  # worker inside step -> the virtual time its member is done
        self._free = len(cost)  # workers neither inside step nor returned
        self._submitted = self._turn = 0  # the worker that may start next
        self._task = threading.local()

    def clock(self) -> float:
        with self._cond:
            return self.now

    def patch(self, monkeypatch: pytest.MonkeyPatch, *modules) -> None:
        """Make ``modules`` read this clock for time.perf_counter (their only use of the time module here)."""
        for m in modules:
            monkeypatch.setattr(m, "time", SimpleNamespace(perf_counter=self.clock))

    def submit(self, fn, /, *args, **kwargs) -> Future:
        k, self._submitted = self._submitted, self._submitted + 1

        def task():
            with self._cond:
                waited(self._cond.wait_for(lambda: self._turn == k, GUARD_S))
            self._task.settled = False
            try:
                return fn(*args, **kwargs)
            finally:
                with self._cond:
                    self._settle()
                    self._free -= 1
                    self._cond.notify_all()

        return self._pool.submit(task)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait, cancel_futures=cancel_futures)

    def _settle(self) -> None:
        """This worker has taken its first member (or none): the next may start."""
        if not self._task.settled:
            self._task.settled = True
            self._turn += 1

    def step(self, w: int) -> None:
        with self._cond:
            self._settle()
            self._busy[w] = self.now + self.cost[w]
            self._free -= 1
            self._cond.notify_all()

            def next_done() -> bool:
                return self._free == 0 and min(self._busy, key=lambda v: (self._busy[v], v)) == w

            waited(self._cond.wait_for(next_done, GUARD_S))
            self.now = self._busy.pop(w)
            self._free += 1
            self._cond.notify_all()


def run_lockstep(monkeypatch, schedule: str, work: Callable[[Lockstep, int, int], object], cost=COST, n=N):
    with Lockstep(cost) as sim:
        sim.patch(monkeypatch, dispatching)
        return dispatch(range(n), len(cost), lambda w, i: work(sim, w, i), schedule, pool=sim)


def logged(log: list[tuple[int, int]]):
    def work(sim: Lockstep, w: int, i: int) -> str:
        sim.step(w)
        log.append((w, i))
        return f"member {i}"

    return work


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_every_member_once_and_in_member_order(monkeypatch, schedule):
    log: list[tuple[int, int]] = []
    done = run_lockstep(monkeypatch, schedule, logged(log))
    assert sorted(i for _, i in log) == list(range(N))  # each member evaluated exactly once
    assert done.order == list(range(N))
    assert [done.results[i] for i in done.order] == [f"member {i}" for i in range(N)]
    assert [w.items for w in done.workers] == (STATIC if schedule == "static" else DYNAMIC)
    for w, load in enumerate(done.workers):  # each worker reports what it did, in the order it took it
        assert load.items == [i for v, i in log if v == w]
        assert load.idle_s == done.wall_s - load.busy_s


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_on_the_real_clock_each_worker_is_busy_or_idle_for_the_wall_time(schedule):
    """What holds whatever the clock says: every worker's busy time lies within the wall time, the rest is idle."""
    done = dispatch(range(N), W, lambda w, i: i, schedule)
    assert done.order == list(range(N)) and sorted(i for w in done.workers for i in w.items) == list(range(N))
    if schedule == "static":
        assert [w.items for w in done.workers] == STATIC
    for w in done.workers:  # busy intervals of one thread within the wall interval (1e-9: float rounding)
        assert 0 <= w.busy_s <= done.wall_s + 1e-9 and w.idle_s >= 0
        assert w.idle_s == pytest.approx(done.wall_s - w.busy_s, abs=1e-9)
    assert done.idle_s == sum(w.idle_s for w in done.workers)


def test_the_queue_gives_the_slow_worker_fewer_members_and_less_idle_time_than_the_static_plan(monkeypatch):
    static = run_lockstep(monkeypatch, "static", logged([]))
    dynamic = run_lockstep(monkeypatch, "dynamic", logged([]))
    assert [w.items for w in static.workers] == STATIC
    slow, fast = len(dynamic.workers[0].items), [len(w.items) for w in dynamic.workers[1:]]
    assert [slow, *fast] == [2, 5, 5] and all(f > slow for f in fast)  # about SLOW times the members
    for d in (static, dynamic):  # each worker busy exactly its members' cost; the wall is the busiest
        assert [w.busy_s for w in d.workers] == [len(w.items) * c for w, c in zip(d.workers, COST)]
        assert d.wall_s == max(w.busy_s for w in d.workers)
        assert [w.idle_s for w in d.workers] == [d.wall_s - w.busy_s for w in d.workers]
    assert (static.wall_s, dynamic.wall_s) == (4 * SLOW * FAST, 2 * SLOW * FAST)
    assert static.idle_s == 2 * 4 * (SLOW - 1) * FAST  # the fast workers wait 4 (SLOW - 1) each
    assert dynamic.idle_s == 2 * SLOW * FAST and dynamic.idle_s < static.idle_s / 2


def test_a_failing_worker_stops_the_others_and_its_error_is_raised(monkeypatch):
    calls = []

    def work(sim: Lockstep, w: int, i: int) -> int:
        calls.append(i)
        sim.step(w)
        if i == 3:
            raise ValueError("member 3 failed")
        return i

    with pytest.raises(ValueError, match="member 3 failed"):
        run_lockstep(monkeypatch, "dynamic", work, cost=[FAST, FAST], n=200)
    # worker 1 fails at t = 2 while worker 0 evaluates member 4: the queue hands out nothing after that
    assert calls == [0, 1, 2, 3, 4]


class SlowSecond:
    """Rank 1 is the slow one, by construction, for each key (population) of a shared claim: a worker of rank 1
    calls ``hold`` while busy, and it returns only once rank 0 has found every member taken; rank 0's claim
    (``fast_claim``) hands out members only once ``holders`` workers of rank 1 are in ``hold``."""

    def __init__(self, holders: int) -> None:
        self.holders, self._lock, self._keys = holders, threading.Lock(), {}

    def _key(self, key: str) -> SimpleNamespace:
        with self._lock:
            return self._keys.setdefault(
                key, SimpleNamespace(held=0, all_held=threading.Event(), drained=threading.Event())
            )

    def fast_claim(self, claim, key: str):
        k = self._key(key)

        def gated() -> int | None:
            waited(k.all_held.wait(GUARD_S))
            i = claim()
            if i is None:
                k.drained.set()
            return i

        return gated

    def hold(self, key: str) -> None:
        k = self._key(key)
        with self._lock:
            k.held += 1
            if k.held == self.holders:
                k.all_held.set()
        waited(k.drained.wait(GUARD_S))


def test_ranks_share_members_through_a_store_counter_and_the_gather_takes_each_from_its_rank():
    """Two 'ranks' (threads, 2 workers each, rank 1 the slow one) on one torch store, as ranks on the default
    store of a process group; each rank's rows are NaN where another rank evaluated the member. Each worker of
    rank 1 takes one member and holds it until rank 0 has taken all the others."""
    store, n, width, slow = dist.HashStore(), 20, 2, SlowSecond(holders=2)
    parts: list[list[list[float]]] = [[], []]
    loads: list[list[list[int]]] = [[], []]

    def rank(r: int) -> None:
        claim = store_claim(store, "es/0", n)

        def work(w: int, i: int) -> tuple[float, float]:
            if r == 1:
                slow.hold("es/0")
            return (i / 10, 100 + i)

        done = dispatch(slow.fast_claim(claim, "es/0") if r == 0 else claim, 2, work)
        parts[r] = [list(done.results[i]) if i in done.results else [math.nan] * width for i in range(n)]
        loads[r] = [w.items for w in done.workers]

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(rank, r) for r in range(2)]:
            f.result()
    owned = [[i for i in range(n) if not math.isnan(p[i][0])] for p in parts]
    assert owned == [list(range(2, n)), [0, 1]]  # every member once, across the ranks; the fast rank took more
    assert sorted(loads[1]) == [[0], [1]]  # one member per worker of the slow rank
    assert combine_rows(parts) == [[i / 10, 100 + i] for i in range(n)]
    assert store_claim(store, "es/1", 3)() == 0  # a new key (update t + 1) starts from member 0 again


def test_the_gather_refuses_a_lost_a_doubled_and_an_incomplete_member():
    nan = math.nan
    with pytest.raises(RuntimeError, match=r"member 1 was reported by ranks \[\]"):
        combine_rows([[[1.0], [nan]], [[nan], [nan]]])
    with pytest.raises(RuntimeError, match=r"member 0 was reported by ranks \[0, 1\]"):
        combine_rows([[[1.0], [nan]], [[1.0], [2.0]]])
    with pytest.raises(RuntimeError, match="rank 1 reported member 0 incompletely"):
        combine_rows([[[nan, nan]], [[1.0, nan]]])


# ---------------------------------------------------------------- the vLLM backend's engines, faked


def fake_engines(schedule: str, n_engines: int = 3, monkeypatch: pytest.MonkeyPatch | None = None):
    """A VLLMBackend without vLLM: each engine's RPCs and generate calls are recorded, engine 0 is SLOW times
    slower in virtual time (``Lockstep`` as the backend's pool; with ``monkeypatch``, dispatch and the backend
    read its clock); a response names the perturbation the engine held while generating it."""
    from esbatch.backends.vllm import VLLMBackend

    vb = object.__new__(VLLMBackend)
    vb.engines, vb.dispatch = [object()] * n_engines, schedule
    vb._pool = sim = Lockstep([FAST * SLOW] + [FAST] * (n_engines - 1))
    if monkeypatch is not None:
        sim.patch(monkeypatch, dispatching, vllm_backend)
    held: dict[int, tuple | None] = dict.fromkeys(range(n_engines))
    took: dict[int, list[int]] = {e: [] for e in range(n_engines)}

    def rpc(e: int, call: WorkerCall, *args):
        call.check_args(args)
        if call is WorkerCall.PERTURB:
            assert held[e] is None, f"engine {e} perturbed twice"
            held[e] = args
        elif call is WorkerCall.RESTORE:
            held[e] = None
        return {}

    def generate(prompts, sampling, seed, engine=0):
        sim.step(engine)
        took[engine].append(seed)
        s, scale = held[engine]
        return [Generation(f"{s}/{scale}/{seed}/{p}", 1) for p in prompts]

    vb._rpc, vb.generate = rpc, generate
    return vb, took, held


def expected(members, prompts):
    return [[f"{s}/{scale}/{g}/{p}" for p in prompts] for s, scale, g in members]


def test_vllm_engines_take_members_from_the_queue_and_return_them_in_member_order(monkeypatch):
    # gen seed 1000 + i identifies member i
    members = [PerturbedMember(100 + i, 0.01 * (-1) ** i, 1000 + i) for i in range(N)]
    prompts, sampling = ["a", "b"], SamplingParams()
    outs = {}
    for schedule in ("static", "dynamic"):
        vb, took, held = fake_engines(schedule, monkeypatch=monkeypatch)
        with vb._pool:
            out = vb.evaluate_population(members, prompts, sampling)
        assert [[g.text for g in gens] for gens in out.generations] == expected(members, prompts)
        assert out.members == list(range(N)) and all(h is None for h in held.values())  # all restored
        outs[schedule] = (out, {e: [s - 1000 for s in seeds] for e, seeds in took.items()})
    (static, s_took), (dynamic, d_took) = outs["static"], outs["dynamic"]
    assert s_took == dict(enumerate(STATIC)) and d_took == dict(enumerate(DYNAMIC))
    assert all(len(d_took[e]) > len(d_took[0]) for e in (1, 2))
    # the RPCs cost no virtual time: the population's wall time is all generation and waiting for the slowest
    assert (static.generation_s, static.perturb_restore_s, static.idle_s) == (4 * SLOW * FAST, 0.0, 32 * FAST)
    assert (dynamic.generation_s, dynamic.perturb_restore_s, dynamic.idle_s) == (2 * SLOW * FAST, 0.0, 10 * FAST)


def test_vllm_engines_evaluate_only_the_members_a_shared_claim_hands_them():
    members = [PerturbedMember(100 + i, 0.01, 1000 + i) for i in range(N)]
    vb, took, _ = fake_engines("static")
    todo, lock = iter([7, 2, 9]), threading.Lock()

    def claim() -> int | None:
        with lock:
            return next(todo, None)

    with vb._pool:
        out = vb.evaluate_population(members, ["q"], SamplingParams(), claim=claim)
    assert out.members == [2, 7, 9]
    assert [[g.text for g in gens] for gens in out.generations] == expected([members[i] for i in (2, 7, 9)], ["q"])
    assert took == {0: [1007], 1: [1002], 2: [1009]}  # engines start in order and each takes what the claim hands


# ---------------------------------------------------------------- ES over ranks that take members dynamically


class ThreadRanks(Ranks):
    """Ranks as threads of this process: claims through one store, the gather through a barrier; exactly the
    combine_rows of the process-group gather. With ``slow`` (two ranks), rank 1 is the slow one: back for its
    second member of a population, it waits until rank 0 has taken all the others."""

    def __init__(
        self, rank: int, world: int, store, barrier: threading.Barrier, posted: dict, slow: SlowSecond | None = None
    ) -> None:
        super().__init__(rank, world)
        self.store, self.barrier, self.posted, self.calls, self.slow = store, barrier, posted, 0, slow

    def claimer(self, n: int, key: str):
        claim = store_claim(self.store, key, n)
        if self.slow is None:
            return claim
        if self.rank == 0:
            return self.slow.fast_claim(claim, key)
        asked = 0

        def slow_claim() -> int | None:
            nonlocal asked
            asked += 1
            if asked == 2:  # its first member evaluated: busy until rank 0 has taken the rest
                self.slow.hold(key)
            return claim()

        return slow_claim

    def gather(self, n, local, width):
        self.calls += 1
        self.posted[(self.calls, self.rank)] = [list(local[i]) if i in local else [math.nan] * width for i in range(n)]
        self.barrier.wait(timeout=300)
        return combine_rows([self.posted[(self.calls, r)] for r in range(self.world)])


def test_es_with_ranks_taking_members_dynamically_ends_on_the_static_center_bit_for_bit(
    tiny_model_dir, tiny_backend_factory
):
    def cfg(dispatch: str):
        return config_from_dict(
            {
                "model": {"name": str(tiny_model_dir)},
                "task": {"name": "toy:DigitTask", "heldout_size": 0},
                "generation": {"temperature": 1.0, "max_new_tokens": 6},
                "es": {
                    **{"population_size": 6, "sigma": 0.05, "alpha": 0.02, "batch_size": 3, "updates": 2},
                    **{"dispatch": dispatch, "diversity": {"every": 1, "samples": 2}},
                },
            }
        )

    ref_backend = tiny_backend_factory()
    probs = load_problems(cfg("static"), ref_backend)
    ref = [es_step(cfg("static"), ref_backend, probs, t) for t in range(2)]

    lock = threading.Lock()  # HF generate seeds torch's global generator: one generate at a time
    barrier, posted, store, slow = threading.Barrier(2), {}, dist.HashStore(), SlowSecond(holders=1)
    backends = [tiny_backend_factory(), tiny_backend_factory()]
    evaluated: list[list[int]] = [[], []]
    records: list[list[dict]] = [[], []]
    for r, b in enumerate(backends):
        gen, evaluate = b.generate, b.evaluate_population

        def serial(*a, _gen=gen, **k):
            with lock:
                return _gen(*a, **k)

        def recorded(*a, _eval=evaluate, _r=r, **k):
            out = _eval(*a, **k)
            if "claim" in k:  # the training pass; the diversity pass re-evaluates the same members
                evaluated[_r].extend(out.members)
            return out

        b.generate, b.evaluate_population = serial, recorded

    def rank(r: int) -> None:
        try:
            ranks = ThreadRanks(r, 2, store, barrier, posted, slow)
            records[r] = [es_step(cfg("dynamic"), backends[r], probs, t, ranks) for t in range(2)]
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(rank, r) for r in range(2)]:
            f.result()
    assert sorted(evaluated[0] + evaluated[1]) == sorted(list(range(6)) * 2)
    # per update, rank 1 takes member 0 and rank 0 the other five: static would split 3 + 3, the fast rank took more
    assert evaluated == [[1, 2, 3, 4, 5] * 2, [0, 0]]
    for recs in records:
        assert [x["rewards"] for x in recs] == [x["rewards"] for x in ref]
        assert [x["diversity"]["p"] for x in recs] == [x["diversity"]["p"] for x in ref]
    assert len({x for rec in ref for x in rec["rewards"]}) > 1  # rewards varied: the updates moved the center
    for b in backends:
        assert all(torch.equal(b.master[k], ref_backend.master[k]) for k in ref_backend.master)
