"""The stress tier: races, chaos and signal storms repeat ESBATCH_STRESS=N times (default: once, in every run).

Each such test is marked ``stress`` (`pytest -m stress` runs them alone); its scenario holds by construction
(gates, not timing) in every repetition, so more repetitions look for rarer interleavings of the real processes,
not for a different outcome. docs/benchmarks.md, "Test suite time": the last N=10 run."""

from __future__ import annotations

import os


def stress(default: int = 1) -> int:
    """How many times a stress scenario repeats: ESBATCH_STRESS when set (a whole number >= 1), else ``default``."""
    raw = os.environ.get("ESBATCH_STRESS", "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"ESBATCH_STRESS={raw!r}: give a whole number of repetitions, at least 1")
    return int(raw)
