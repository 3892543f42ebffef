"""Which kind of YAML file a document is (run config, sweep, launcher profile, eval config)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from esbatch.config.eval import EvalConfig
from esbatch.config.launcher import LauncherProfile
from esbatch.config.loader import KINDS
from esbatch.config.run import Config
from esbatch.config.sweep import SweepFile

SCHEMAS = {"config": Config, "sweep": SweepFile, "launcher": LauncherProfile, "eval": EvalConfig}


def detect_kind(data: dict[str, Any], path: Path | None = None) -> str:
    """Which kind of file ``data`` is: by its keys, and by its folder where the keys leave a tie."""
    keys = set(data)
    score = {k: len(keys & {f.name for f in dataclasses.fields(cls)}) for k, cls in SCHEMAS.items()}
    best = max(score.values())
    top = [k for k, s in score.items() if s == best]
    if path is not None:
        folders = {part for part in Path(path).resolve().parts}
        hinted = [k for k in top if KINDS[k][0] in folders]
        if hinted:
            return hinted[0]
        if best == 0:
            hinted = [k for k in KINDS if KINDS[k][0] in folders]
            if hinted:
                return hinted[0]
    if len(top) == 1 and best > 0:
        return top[0]
    if "grid" in keys or "zip" in keys or "seeds" in keys:
        return "sweep"
    return "config" if best == 0 or "config" in top else top[0]
