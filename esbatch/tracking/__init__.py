"""Experiment tracking (MLflow), imported lazily: mlflow takes seconds to import."""

from esbatch.tracking.mlflow_tracker import (
    MLflowTracker,
    NullTracker,
    default_tracking_uri,
    log_artifacts_to,
    parent_tag,
    run_tags,
)
from esbatch.tracking.spool import TrackingStoreError, spool_path
from esbatch.tracking.writer import TrackingWriter

__all__ = [
    "MLflowTracker",
    "NullTracker",
    "default_tracking_uri",
    "log_artifacts_to",
    "parent_tag",
    "run_tags",
    "spool_path",
    "TrackingStoreError",
    "TrackingWriter",
]
