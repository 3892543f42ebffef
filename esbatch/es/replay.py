"""Replay: the ES center is theta_0 plus its log (paper App. G.1 run backwards, nothing sampled again).

Every update t is logged as its direction seeds s_j and weights w_j (esbatch/es/core.py), so

    theta_T = theta_0 + sum_{t < T} alpha/N sum_j w_{t,j} eps(s_{t,j})

is recomputed with the trainer's own arithmetic (the backend's ``update``), bit for bit: a resumed run replays
the updates after its newest checkpoint, ``esbatch center RUN --at T`` and every reader of an ES run without a
center file (checkpoint.center: final | none) replay from theta_0 on the CPU.
"""

from __future__ import annotations

import copy
from typing import Any

from esbatch.backends import BACKENDS, ESBackend
from esbatch.es.config import backend_setup
from esbatch.perturb.update import UpdateSpec
from esbatch.train.config import TrainConfig
from esbatch.train.rundir import RunDir, RunFolderError


def replay(backend: ESBackend, records: list[dict[str, Any]]) -> None:
    """Re-apply logged updates to the center: same seeds, same weights, same arithmetic -> same bits.

    In-place backends (es.restore: inplace) first redo the update's perturb/restore cycles, member by member in
    the order es_step evaluated them (one process: the logged order), since their round-off is part of the center.
    """
    cycles = backend.restore_mode == "inplace"
    for r in records:
        if cycles:
            if "sigma" not in r:
                raise ValueError(
                    f"log.jsonl: update {r.get('t')} records no sigma, which replaying es.restore: inplace needs "
                    "(each member's scale is sign * sigma); this log was not written by an inplace run"
                )
            for seed, sign in zip(r["seeds"], r["signs"]):
                backend.perturb(seed, sign * r["sigma"])
                backend.restore()
        backend.update(UpdateSpec.from_record(r))


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
