"""Dynamic dispatch (esbatch/backends/dispatch.py): a work queue over workers of unequal speed evaluates every
member once, in member order, and leaves less idle time than the static plan; ranks share members through a
store counter; the vLLM backend's engines go through the same function (fake engines here: tests/vllm_cpu
would need two real engines per schedule); and ES with ranks taking members dynamically ends on the center of
the static single-process run, bit for bit."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from esbatch.backends.base import Generation, SamplingParams
from esbatch.backends.dispatch import dispatch
from esbatch.config import config_from_dict
from esbatch.es.trainer import es_step
from esbatch.train.problems import load_problems
from esbatch.train.ranks import Ranks, combine_rows, store_claim

FAST, SLOW = 0.03, 5  # seconds per member on a fast worker; worker 0 takes SLOW times as long
N, W = 12, 3
# Assertions rest on who took which member, and on lower bounds of the clock (a sleep lasts at least its time):
# on a loaded machine a woken thread may wait long, which can stretch any measured time but never shorten it.


def slow_first(log: list[tuple[int, int]]):
    def work(w: int, i: int) -> str:
        time.sleep(FAST * (SLOW if w == 0 else 1))
        log.append((w, i))
        return f"member {i}"

    return work


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_every_member_once_and_in_member_order(schedule):
    log: list[tuple[int, int]] = []
    done = dispatch(range(N), W, slow_first(log), schedule)
    assert sorted(i for _, i in log) == list(range(N))  # each member evaluated exactly once
    assert done.order == list(range(N))
    assert [done.results[i] for i in done.order] == [f"member {i}" for i in range(N)]
    for w, load in enumerate(done.workers):  # each worker reports what it did, in the order it took it
        assert load.items == [i for v, i in log if v == w]
        assert load.idle_s == pytest.approx(done.wall_s - load.busy_s)


def test_the_queue_gives_the_slow_worker_fewer_members_and_less_idle_time_than_the_static_plan():
    static = dispatch(range(N), W, slow_first([]), "static")
    dynamic = dispatch(range(N), W, slow_first([]), "dynamic")
    assert [w.items for w in static.workers] == [list(range(w, N, W)) for w in range(W)]  # member i on i mod W
    slow, fast = len(dynamic.workers[0].items), [len(w.items) for w in dynamic.workers[1:]]
    assert all(f > slow for f in fast)  # SLOW times the speed: about SLOW times the members
    assert slow + sum(fast) == N

    def plan_idle(d) -> float:
        """Idle seconds the assignment implies with the known costs, independent of the clock."""
        busy = [len(w.items) * FAST * (SLOW if k == 0 else 1) for k, w in enumerate(d.workers)]
        return sum(max(busy) - b for b in busy)

    assert plan_idle(static) == pytest.approx(2 * 4 * (SLOW - 1) * FAST)  # fast workers wait 4 (SLOW - 1) each
    assert plan_idle(dynamic) < plan_idle(static) / 2
    for d in (static, dynamic):  # the clock: each worker busy at least its sleeps, the wall at least the busiest
        need = [len(w.items) * FAST * (SLOW if k == 0 else 1) for k, w in enumerate(d.workers)]
        assert all(w.busy_s >= t for w, t in zip(d.workers, need))
        assert d.wall_s >= max(need) and all(w.idle_s == pytest.approx(d.wall_s - w.busy_s) for w in d.workers)


def test_a_failing_worker_stops_the_others_and_its_error_is_raised():
    calls = []

    def work(w: int, i: int) -> int:
        calls.append(i)
        time.sleep(0.005)
        if i == 3:
            raise ValueError("member 3 failed")
        return i

    with pytest.raises(ValueError, match="member 3 failed"):
        dispatch(range(200), 2, work, "dynamic")
    assert 3 in calls and len(calls) < 20  # the queue stopped handing out members


def test_ranks_share_members_through_a_store_counter_and_the_gather_takes_each_from_its_rank():
    """Two 'ranks' (threads, 2 workers each, one rank 3x slower) on one torch store, as ranks on the default
    store of a process group; each rank's rows are NaN where another rank evaluated the member."""
    store, n, width = dist.HashStore(), 20, 2
    parts: list[list[list[float]]] = [[], []]

    def rank(r: int) -> None:
        claim = store_claim(store, "es/0", n)

        def work(w: int, i: int) -> tuple[float, float]:
            time.sleep(FAST * (SLOW if r == 1 else 1))
            return (i / 10, 100 + i)

        done = dispatch(claim, 2, work)
        parts[r] = [list(done.results[i]) if i in done.results else [math.nan] * width for i in range(n)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    owned = [[i for i in range(n) if not math.isnan(p[i][0])] for p in parts]
    assert sorted(owned[0] + owned[1]) == list(range(n))  # every member once, across the ranks
    assert len(owned[0]) > len(owned[1])  # the fast rank took more
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


def fake_engines(schedule: str, n_engines: int = 3):
    """A VLLMBackend without vLLM: each engine's RPCs and generate calls are recorded, engine 0 is 3x slower;
    a response names the perturbation the engine held while generating it."""
    from esbatch.backends.vllm import VLLMBackend

    vb = object.__new__(VLLMBackend)
    vb.engines, vb.dispatch = [object()] * n_engines, schedule
    vb._pool = ThreadPoolExecutor(max_workers=n_engines)
    held: dict[int, tuple | None] = dict.fromkeys(range(n_engines))
    took: dict[int, list[int]] = {e: [] for e in range(n_engines)}

    def rpc(e: int, method: str, *args):
        if method == "es_perturb":
            assert held[e] is None, f"engine {e} perturbed twice"
            held[e] = args
        elif method == "es_restore":
            held[e] = None
        return {}

    def generate(prompts, sampling, seed, engine=0):
        time.sleep(FAST * (SLOW if engine == 0 else 1))
        took[engine].append(seed)
        s, scale = held[engine]
        return [Generation(f"{s}/{scale}/{seed}/{p}", 1) for p in prompts]

    vb._rpc, vb.generate = rpc, generate
    return vb, took, held


def expected(members, prompts):
    return [[f"{s}/{scale}/{g}/{p}" for p in prompts] for s, scale, g in members]


def test_vllm_engines_take_members_from_the_queue_and_return_them_in_member_order():
    members = [(100 + i, 0.01 * (-1) ** i, 1000 + i) for i in range(N)]  # gen seed 1000 + i identifies member i
    prompts, sampling = ["a", "b"], SamplingParams()
    outs = {}
    for schedule in ("static", "dynamic"):
        vb, took, held = fake_engines(schedule)
        out = vb.evaluate_population(members, prompts, sampling)
        assert [[g.text for g in gens] for gens in out.generations] == expected(members, prompts)
        assert out.members == list(range(N)) and all(h is None for h in held.values())  # all restored
        outs[schedule] = (out, {e: sorted(s - 1000 for s in seeds) for e, seeds in took.items()})
    (static, s_took), (dynamic, d_took) = outs["static"], outs["dynamic"]
    assert s_took == {e: list(range(e, N, 3)) for e in range(3)}
    assert all(len(d_took[e]) > len(d_took[0]) for e in (1, 2))
    for out, took in ((static, s_took), (dynamic, d_took)):
        need = [len(took[e]) * FAST * (SLOW if e == 0 else 1) for e in range(3)]  # each engine's sleeps
        wall = out.generation_s + out.perturb_restore_s  # the population's wall time
        assert out.generation_s >= max(need) and out.perturb_restore_s >= 0
        assert 0 <= out.idle_s <= 3 * wall - sum(need) + 1e-9  # sum over engines of wall - busy, busy >= need


def test_vllm_engines_evaluate_only_the_members_a_shared_claim_hands_them():
    members = [(100 + i, 0.01, 1000 + i) for i in range(N)]
    vb, took, _ = fake_engines("static")
    todo, lock = iter([7, 2, 9]), threading.Lock()

    def claim() -> int | None:
        with lock:
            return next(todo, None)

    out = vb.evaluate_population(members, ["q"], SamplingParams(), claim=claim)
    assert out.members == [2, 7, 9]
    assert [[g.text for g in gens] for gens in out.generations] == expected([members[i] for i in (2, 7, 9)], ["q"])
    assert sorted(s for seeds in took.values() for s in seeds) == [1002, 1007, 1009]


# ---------------------------------------------------------------- ES over ranks that take members dynamically


class ThreadRanks(Ranks):
    """Ranks as threads of this process: claims through one store, the gather through a barrier; exactly the
    combine_rows of the process-group gather."""

    def __init__(self, rank: int, world: int, store, barrier: threading.Barrier, posted: dict) -> None:
        super().__init__(rank, world)
        self.store, self.barrier, self.posted, self.calls = store, barrier, posted, 0

    def claimer(self, n: int, key: str):
        return store_claim(self.store, key, n)

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
    barrier, posted, store = threading.Barrier(2), {}, dist.HashStore()
    backends = [tiny_backend_factory(), tiny_backend_factory()]
    evaluated: list[list[int]] = [[], []]
    records: list[list[dict]] = [[], []]
    for r, b in enumerate(backends):
        gen, evaluate = b.generate, b.evaluate_population

        def serial(*a, _gen=gen, _r=r, **k):
            with lock:
                out = _gen(*a, **k)
            time.sleep(0.3 if _r == 1 else 0.0)  # rank 1 is the slow one
            return out

        def recorded(*a, _eval=evaluate, _r=r, **k):
            out = _eval(*a, **k)
            if "claim" in k:  # the training pass; the diversity pass re-evaluates the same members
                evaluated[_r].extend(out.members)
            return out

        b.generate, b.evaluate_population = serial, recorded

    def rank(r: int) -> None:
        try:
            ranks = ThreadRanks(r, 2, store, barrier, posted)
            records[r] = [es_step(cfg("dynamic"), backends[r], probs, t, ranks) for t in range(2)]
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(rank, r) for r in range(2)]:
            f.result()
    assert sorted(evaluated[0] + evaluated[1]) == sorted(list(range(6)) * 2)
    assert len(evaluated[0]) > len(evaluated[1])  # static would split 3 + 3 per update: the fast rank took more
    for recs in records:
        assert [x["rewards"] for x in recs] == [x["rewards"] for x in ref]
        assert [x["diversity"]["p"] for x in recs] == [x["diversity"]["p"] for x in ref]
    assert len({x for rec in ref for x in rec["rewards"]}) > 1  # rewards varied: the updates moved the center
    for b in backends:
        assert all(torch.equal(b.master[k], ref_backend.master[k]) for k in ref_backend.master)
