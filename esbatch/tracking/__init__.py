"""Experiment tracking (MLflow), imported lazily: mlflow takes seconds to import."""

from esbatch.tracking.mlflow_tracker import (
    MLflowTracker,
    NullTracker,
    dataset_input,
    dataset_source,
    default_tracking_uri,
    log_artifacts_to,
    parent_tag,
    point_tags,
    problems_digest,
    run_tags,
)
from esbatch.tracking.spool import TrackingStoreError, spool_path
from esbatch.tracking.writer import TrackingWriter

__all__ = [
    "MLflowTracker",
    "NullTracker",
    "dataset_input",
    "dataset_source",
    "default_tracking_uri",
    "log_artifacts_to",
    "parent_tag",
    "point_tags",
    "problems_digest",
    "run_tags",
    "spool_path",
    "TrackingStoreError",
    "TrackingWriter",
]
