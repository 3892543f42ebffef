"""A stand-in for an MLflow store that is down: the client's reads and writes raise MLflow's "database is locked"
(the transient error a store held by another process gives) while ``down`` (tests/unit/test_tracking_*.py)."""

from __future__ import annotations

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
from mlflow.tracking import MlflowClient

WRITES = ("log_batch", "set_terminated", "update_run", "get_run", "get_metric_history", "log_artifact")


class Outage:
    """The store of one client, its calls counted (``calls``: all of them; ``refused``: those made while down)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, client: MlflowClient, down: bool = True) -> None:
        self.down, self.calls, self.refused = down, 0, 0
        for name in WRITES:
            monkeypatch.setattr(client, name, self._guard(getattr(client, name)))

    def _guard(self, real):
        def call(*args, **kwargs):
            self.calls += 1
            if self.down:
                self.refused += 1
                raise MlflowException(
                    "(sqlite3.OperationalError) database is locked", error_code=TEMPORARILY_UNAVAILABLE
                )
            return real(*args, **kwargs)

        return call
