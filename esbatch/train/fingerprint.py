"""A run's config fingerprint: what its logged updates depend on, checked on every resume.

``<run>/config.fingerprint.json`` holds the sha256 of the resolved config without the keys a resume may change
(``resume_overridable``: budgets, evaluation and checkpoint cadence, and bookkeeping: run.name, run.output_dir,
tracking.*), and the flat resolved values of every key, compared key by key to name what changed (a key that a
later esbatch added, at its default, is no change). A resume whose config differs
outside those keys (config.yaml edited by hand, or a `--set`) is refused naming each key, old -> new; an allowed
change is returned so the run records it (run.json's ``resumes`` and an MLflow tag ``resume.<n>.changed``), and
the file is updated to the config the run continues with. A folder written before fingerprints existed resumes
as before, once with a note, and is fingerprinted from then on.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from esbatch import durable, schema
from esbatch.schema import flatten
from esbatch.train.config import ALGORITHMS, TrainConfig
from esbatch.train.rundir import RunDir, RunFolderError
from esbatch.train.sections import RESUMABLE

FILE = "config.fingerprint.json"
BOOKKEEPING = ("run.name", "run.output_dir", "tracking")  # where a run is and where it logs, not what it computes


def resume_overridable() -> set[str]:
    """The keys (and sections) a resumed run may change: esbatch/config/run.py's RESUME_OVERRIDABLE and the
    bookkeeping a moved folder or a sweep task rewrites."""
    algos = [ALGORITHMS.get(n) for n in ALGORITHMS.names()]
    return {*RESUMABLE, *(f"{a.section}.{k}" for a in algos if a.section for k in a.resumable), *BOOKKEEPING}


def allowed(key: str, keys: set[str]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def flat_values(cfg: TrainConfig) -> dict[str, Any]:
    """Every resolved key's value as JSON would write it (lists stay lists)."""
    return json.loads(json.dumps(flatten(cfg.to_dict()), default=str))


def digest(values: dict[str, Any], keys: set[str]) -> str:
    kept = {k: v for k, v in values.items() if not allowed(k, keys)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def path(rd: RunDir) -> Path:
    return rd.path / FILE


def record(rd: RunDir, cfg: TrainConfig) -> None:
    """Write the fingerprint of ``cfg`` (atomically); the run folder's writer only."""
    values = flat_values(cfg)
    p = path(rd)
    durable.write_text(p, json.dumps({"sha256": digest(values, resume_overridable()), "values": values}, indent=1))


def _defaults(cfg: TrainConfig) -> dict[str, Any]:
    return json.loads(json.dumps({k: d for k, _, d, _ in schema.describe(type(cfg))}, default=str))


def _show(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else repr(v)


def check(rd: RunDir, cfg: TrainConfig) -> dict[str, tuple[Any, Any]] | None:
    """The allowed keys whose value ``cfg`` changes ({key: (old, new)}); None for a folder without a fingerprint.
    Reads only; raises RunFolderError naming every other changed key."""
    p = path(rd)
    if not p.exists():
        return None
    try:
        old = json.loads(p.read_text())["values"]
        if not isinstance(old, dict):
            raise TypeError("'values' is not a mapping")
    except (ValueError, KeyError, TypeError) as e:
        raise RunFolderError(
            f"{p}: not a valid config fingerprint ({e}). Restore it from a backup, or delete it to resume without "
            "the check (it is written again from the config the run continues with)."
        ) from None
    new, keys = flat_values(cfg), resume_overridable()
    missing = object()
    added_at_default = {k for k in new.keys() - old.keys() if new[k] == _defaults(cfg).get(k, missing)}
    changed = {  # a key a later esbatch added, at its default, is no change: defaults keep the earlier behaviour
        k: (old.get(k, missing), new.get(k, missing))
        for k in sorted((old.keys() | new.keys()) - added_at_default)
        if old.get(k, missing) != new.get(k, missing)
    }
    fixed = {k: v for k, v in changed.items() if not allowed(k, keys)}
    if fixed:
        lines = "; ".join(
            f"{k}: {'(unset)' if a is missing else _show(a)} -> {'(unset)' if b is missing else _show(b)}"
            for k, (a, b) in fixed.items()
        )
        raise RunFolderError(
            f"{rd.path}: the config differs from the one its updates were made with ({lines}); "
            f"a resume may change only budgets and bookkeeping: {', '.join(sorted(keys))}. Undo the change "
            f"(in {rd.config} or --set), or start a new run with it. Nothing was changed."
        )
    return {k: v for k, v in changed.items() if v[0] is not missing and v[1] is not missing}


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    """'es.updates: 2 -> 3; eval.every: 0 -> 1' (an MLflow tag value)."""
    return "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in changes.items())
