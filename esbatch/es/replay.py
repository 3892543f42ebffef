"""Replay: the ES center is theta_0 plus its log (paper App. G.1 run backwards, nothing sampled again).

Every update t is logged as its direction seeds s_j and weights w_j (esbatch/es/core.py), so

    theta_T = theta_0 + sum_{t < T} alpha/N sum_j w_{t,j} eps(s_{t,j})

is recomputed with the trainer's own arithmetic (the backend's ``update``), bit for bit: a resumed run replays
the updates after its newest checkpoint, ``esbatch center RUN --at T`` and every reader of an ES run without a
center file (checkpoint.center: final | none) replay from theta_0 on the CPU. An es.restore: inplace run with
several replicas (engines x ranks) has as many centers; the one it saves and exports, and the one rebuilt here,
is replica 0's (the lead rank's first engine: our choice, the paper does not say which engine it saved).
"""

from __future__ import annotations

import copy
from typing import Any

from esbatch.backends import BACKENDS, ESBackend
from esbatch.es.config import backend_setup
from esbatch.perturb.update import UpdateSpec
from esbatch.train.config import TrainConfig
from esbatch.train.rundir import RunDir, RunFolderError


def replay(backend: ESBackend, records: list[dict[str, Any]], first_replica: int = 0) -> None:
    """Re-apply logged updates to the center: same seeds, same weights, same arithmetic -> same bits.

    In-place backends (es.restore: inplace) first redo the update's perturb/restore cycles, since their round-off
    is part of the center: each of the backend's replicas (engines) those of the replica of the run it stands for,
    ``first_replica`` + k (a rank's engines follow the ranks before it), members in the order it evaluated them.
    """
    cycles = backend.restore_mode == "inplace"
    for r in records:
        if cycles:
            backend.cycles(member_cycles(r, first_replica, backend.replicas))
        backend.update(UpdateSpec.from_record(r))


def member_cycles(record: dict[str, Any], first: int, count: int) -> list[list[tuple[int, float]]]:
    """(seed, scale) of each member replicas ``first`` .. ``first + count - 1`` of an update perturbed and restored,
    in order (the record's ``replicas``; a log written before they were recorded: one replica, member order)."""
    t = record.get("t")
    if "sigma" not in record:
        raise ValueError(
            f"log.jsonl: update {t} records no sigma, which replaying es.restore: inplace needs (each member's "
            "scale is sign * sigma); this log was not written by an inplace run"
        )
    orders = record.get("replicas") or [list(range(len(record["seeds"])))]
    if first + count > len(orders):
        raise ValueError(
            f"log.jsonl: update {t} records the members of {len(orders)} replica(s) (engines x ranks), and replaying "
            f"replicas {first}..{first + count - 1} needs more: resume an es.restore: inplace run with the engines "
            "and ranks it ran with (backend.engines, run.nproc_per_node, run.nodes)"
        )
    seeds, signs, sigma = record["seeds"], record["signs"], record["sigma"]
    listed = [i for order in orders for i in (order if isinstance(order, list) else [order])]
    once = all(type(i) is int for i in listed) and sorted(listed) == list(range(len(seeds)))
    if not once:  # each member was perturbed and restored once, by one replica
        raise RunFolderError(
            f"log.jsonl: update {t} lists its replicas' members as {orders}, not each of its {len(seeds)} members "
            "once: the log is damaged, and replaying it would rebuild other weights than the run's"
        )
    return [[(seeds[i], signs[i] * sigma) for i in orders[k]] for k in range(first, first + count)]


def rebuild_center(cfg: TrainConfig, rd: RunDir, t: int) -> dict[str, Any]:
    """theta_0 of the run plus its first ``t`` logged updates, replayed with the trainer's own arithmetic."""
    records = rd.updates()
    if t > len(records):
        last = f"the last is update {len(records) - 1}" if records else "no update yet"
        raise RunFolderError(
            f"--at {t}: {rd.log} records {len(records)} update(s) ({last}), so the newest center it can rebuild "
            f"is --at {len(records)}"
        )
    c = copy.deepcopy(cfg)
    c.model.device, c.tracking.drift = "cpu", False  # the update arithmetic is the same on CPU, bit for bit
    backend = BACKENDS.get("hf").for_es(backend_setup(c))
    try:
        replay(backend, records[:t])
        return backend.center_state_dict()
    finally:
        backend.close()
