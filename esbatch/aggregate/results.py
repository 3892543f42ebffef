"""What the aggregator reads: one ``RunResult`` per planned run of a sweep, whether it ran or not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunResult:
    """A sweep run as read back from MLflow (or from its run directory when it never reached MLflow).

    ``params`` holds the run's resolved config flattened to dotted keys with typed values
    (``{"es.population_size": 16, "model.name": "qwen2.5-0.5b-instruct", ...}``). ``history`` maps a
    metric name (e.g. ``"reward/mean"``, ``"heldout/accuracy"``) to ``[(step, value), ...]`` sorted by
    step; ES logs update t's metrics at step t + 1. ``status`` is one of ``finished``, ``running``,
    ``failed``, ``killed``, ``pending``, ``missing`` (planned but nothing on disk or in MLflow).
    """

    key: str
    label: str
    status: str
    params: dict[str, Any]
    total_updates: int
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        pts = self.history.get(metric, [])
        return [s for s, _ in pts], [v for _, v in pts]
