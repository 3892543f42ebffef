"""A run over several processes (torchrun, or SLURM tasks on several nodes), for every algorithm.

Rank 0 writes the run folder and MLflow; every rank computes. After each update the lifecycle compares a
checksum of every rank's weights, so ranks that drifted apart stop the run instead of silently training
different models. ES: member i of an update is evaluated by rank i mod W (es.dispatch: static), or by whichever
rank takes it first from a counter in the process group's store (dynamic), and only the N rewards (and token
counts) travel, by one all-gather; every rank applies the identical update itself (App. G.1 does the same
over eight engines). Rewards are tiny, so ES uses gloo over TCP even on GPU clusters. GRPO: data-parallel
DeepSpeed ranks (esbatch/grpo/trainer.py initialises the process group).
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from esbatch.train.config import TrainConfig


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def lead(self) -> bool:
        """Rank 0 writes the run folder and MLflow; the others only compute."""
        return self.rank == 0

    def mine(self, n: int) -> list[int]:
        """Indices of the members this rank evaluates under es.dispatch: static."""
        return list(range(self.rank, n, self.world))

    def claimer(self, n: int, key: str) -> Callable[[], int | None]:
        """Members 0..n-1 handed out to whichever rank asks first (es.dispatch: dynamic), by one counter per
        ``key`` in the process group's store; every rank must use the same key, and a new one per population."""
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank already shares
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun may restart into the same store
        return store_claim(store, f"esbatch/dispatch/{restart}/{key}", n)

    def gather(self, n: int, local: dict[int, Sequence[float]], width: int) -> list[list[float]]:
        """Each member's ``width`` values (reward, tokens, ...) from whichever rank evaluated it, on every rank."""
        if self.world == 1:
            return [list(local[i]) for i in range(n)]
        import torch
        import torch.distributed as dist

        mine = torch.full((n, width), float("nan"), dtype=torch.float64)
        for i, vals in local.items():
            mine[i] = torch.tensor(list(vals), dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        return combine_rows([p.tolist() for p in parts])

    def gather_tensors(self, local: Sequence[Any]) -> list[Any]:
        """Every rank's ``local`` tensors (the same count and shape on every rank), in rank order, on every rank."""
        if self.world == 1:
            return list(local)
        import torch
        import torch.distributed as dist

        mine = torch.stack([t.to("cpu", torch.float64) for t in local])
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        return [row for part in parts for row in part]

    def check_in_sync(self, checksum: float | None, t: int) -> None:
        """Stop the run if the ranks' centers differ after update t."""
        if self.world == 1 or checksum is None:
            return
        import torch
        import torch.distributed as dist

        parts = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(parts, torch.tensor([checksum], dtype=torch.float64))
        sums = [float(p) for p in parts]
        if len(set(sums)) > 1:
            raise RuntimeError(
                f"ranks drifted apart after update {t}: center checksums {sums}. Every rank must apply the "
                "same update to the same weights; check that all ranks load the same model and dtype."
            )

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any: ranks agree when to stop, so none waits alone in a
        collective for a rank that has stopped."""
        if self.world == 1:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self, ok: bool) -> None:
        """Leave the process group (also a world of one that DeepSpeed initialised: gloo aborts at exit without
        it, measured 1 in 8); after a failure skip the barrier (a peer may be gone)."""

        if "torch.distributed" not in sys.modules:
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()


def store_claim(store: Any, key: str, n: int) -> Callable[[], int | None]:
    """The next of members 0..n-1 that no process sharing ``store`` has taken yet (None: all taken), from the
    atomic counter ``key`` (``store.add``). The engine threads of one rank share the client behind a lock."""
    lock = threading.Lock()

    def claim() -> int | None:
        with lock:
            i = int(store.add(key, 1)) - 1
        return i if i < n else None

    return claim


def combine_rows(parts: list[list[list[float]]]) -> list[list[float]]:
    """Each member's row from the one rank that reported it: ``parts[rank][member]``, NaN where that rank did
    not evaluate the member. Missing or twice-reported members stop the run (a lost or doubled reward)."""
    rows = []
    for i in range(len(parts[0])):
        by = [r for r, p in enumerate(parts) if not all(math.isnan(v) for v in p[i])]
        if len(by) != 1:
            raise RuntimeError(f"member {i} was reported by ranks {by}: every member must be evaluated by exactly one")
        row = parts[by[0]][i]
        if any(math.isnan(v) for v in row):
            raise RuntimeError(f"rank {by[0]} reported member {i} incompletely: {row}")
        rows.append(row)
    return rows


def collective_timeout_min(cfg: TrainConfig) -> float:
    """A collective gives up a minute after the watchdog (esbatch/train/watchdog.py) would have named the hang."""
    return cfg.run.hang_timeout_s / 60 + 1


def init_ranks(timeout_min: float = 30.0) -> Ranks:
    """Join the process group described by torchrun's or esbatch's SLURM env (RANK, WORLD_SIZE, MASTER_*).

    One process without that env is a world of one and initializes nothing. A rank that dies makes the
    others' next collective fail (gloo sees the closed connection), and the run is resumable from its folder.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    return joined("gloo", timeout_min)


def joined(backend: str, timeout_min: float = 30.0) -> Ranks:
    """Ranks of the process group, initialising it with ``backend`` if nobody has yet."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_min))
    return Ranks(dist.get_rank(), dist.get_world_size())
