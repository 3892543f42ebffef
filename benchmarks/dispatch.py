"""Static vs dynamic dispatch of a population (es.dispatch, esbatch/backends/dispatch.py), on simulated engines:
threads that sleep a member's cost, one engine --slow times slower (a busier GPU, a longer-winded member
mix). Two layouts: E engines in one process (the vLLM backend's threads), and W ranks of E engines each
taking members from one store counter (as ranks share torch.distributed's store; an in-process HashStore
here). Prints, for each schedule, the population's wall time, the engine-seconds spent idle while others
still worked, the members each engine evaluated, and the wall-time bound of a perfect split.

    python benchmarks/dispatch.py [--members 32] [--engines 4] [--ranks 2] [--cost 0.05] [--slow 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from esbatch.backends.dispatch import Dispatched, dispatch  # noqa: E402
from esbatch.train.ranks import store_claim  # noqa: E402


def member_costs(n: int, cost: float, seed: int = 0) -> list[float]:
    """Seconds each member takes on a normal engine: +-30% around ``cost`` (responses differ in length)."""
    return (cost * np.random.default_rng(seed).uniform(0.7, 1.3, n)).tolist()


def engine_work(costs: list[float], speed: list[float]) -> Callable[[int, int], int]:
    def work(e: int, i: int) -> int:
        time.sleep(costs[i] * speed[e])
        return i

    return work


def one_process(costs: list[float], speed: list[float], schedule: str) -> tuple[float, float, list[int]]:
    """(wall s, idle engine-s, members per engine) of E engines in one process."""
    d = dispatch(range(len(costs)), len(speed), engine_work(costs, speed), schedule)
    return d.wall_s, d.idle_s, [len(w.items) for w in d.workers]


def over_ranks(
    costs: list[float], speeds: list[list[float]], schedule: str, key: str
) -> tuple[float, float, list[int]]:
    """The same over W ranks (threads) of E engines each: static = member i on rank i mod W, then engine
    (i div W) mod E; dynamic = every engine of every rank takes from one counter. Idle: against the slowest rank."""
    import torch.distributed as dist

    store, n, w = dist.HashStore(), len(costs), len(speeds)
    done: list[Dispatched[int]] = [None] * w  # type: ignore[list-item]
    t0 = time.perf_counter()

    def rank(r: int) -> None:
        work = engine_work(costs, speeds[r])
        if schedule == "dynamic":
            mine = list(range(n))
            done[r] = dispatch(store_claim(store, key, n), len(speeds[r]), lambda e, k: work(e, mine[k]))
        else:
            mine = list(range(r, n, w))
            done[r] = dispatch(range(len(mine)), len(speeds[r]), lambda e, k: work(e, mine[k]), "static")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    loads = [load for d in done for load in d.workers]
    return wall, sum(wall - x.busy_s for x in loads), [len(x.items) for x in loads]


def median_of(repeat: int, run: Callable[[int], tuple[float, float, list[int]]]) -> tuple[float, float, list[int]]:
    """The run with the median wall time of ``repeat``."""
    runs = sorted((run(k) for k in range(repeat)), key=lambda r: r[0])
    return runs[len(runs) // 2]


def table(title: str, rows: dict[str, tuple[float, float, list[int]]], bound: float) -> None:
    print(f"\n{title}")
    print(f"  {'schedule':9} {'wall s':>7} {'idle engine-s':>14} {'vs static':>10}  members per engine")
    base = rows["static"][0]
    for name, (wall, idle, counts) in rows.items():
        print(f"  {name:9} {wall:7.3f} {idle:14.3f} {base / wall:9.2f}x  {counts}")
    print(f"  {'bound':9} {bound:7.3f} {'':14} {base / bound:9.2f}x  (total work / total speed)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=32, help="N: members of the population")
    ap.add_argument("--engines", type=int, default=4, help="E: engines per process")
    ap.add_argument("--ranks", type=int, default=2, help="W: ranks in the second layout")
    ap.add_argument("--cost", type=float, default=0.05, help="mean seconds per member on a normal engine")
    ap.add_argument("--slow", type=float, default=3.0, help="engine 0 (of rank 0) takes this many times as long")
    ap.add_argument("--repeat", type=int, default=3, help="runs per schedule; the median wall time is shown")
    args = ap.parse_args()

    costs = member_costs(args.members, args.cost)
    speed = [args.slow] + [1.0] * (args.engines - 1)
    rows = {s: median_of(args.repeat, lambda k, s=s: one_process(costs, speed, s)) for s in ("static", "dynamic")}
    bound = sum(costs) / sum(1 / x for x in speed)
    table(
        f"{args.members} members on {args.engines} engines in one process, engine 0 {args.slow:g}x slower", rows, bound
    )

    speeds = [speed] + [[1.0] * args.engines for _ in range(args.ranks - 1)]
    ranks = {s: (lambda k, s=s: over_ranks(costs, speeds, s, f"{s}/{k}")) for s in ("static", "dynamic")}
    rows = {s: median_of(args.repeat, run) for s, run in ranks.items()}
    bound = sum(costs) / sum(1 / x for sp in speeds for x in sp)
    table(
        f"{args.members} members on {args.ranks} ranks x {args.engines} engines, rank 0's engine 0 {args.slow:g}x "
        "slower",
        rows,
        bound,
    )


if __name__ == "__main__":
    main()
