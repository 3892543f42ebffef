"""Validated YAML configs: run configs, sweep files, launcher profiles, eval configs and aggregate analyses.

One schema mechanism (schema.py) and one loader (loader.py) serve them all; ``esbatch validate FILE`` tells
the kind of a file and checks it without loading a model.
"""

from esbatch.config.run import (
    RESUME_OVERRIDABLE,
    BackendConfig,
    CheckpointConfig,
    ESConfig,
    GenerationConfig,
    GRPOConfig,
    InTrainingEvalConfig,
    ModelConfig,
    PipelineConfig,
    RewardConfig,
    RunConfig,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
    config_from_dict,
    load_config,
    load_run_config,
    parse_overrides,
)
from esbatch.schema import ConfigError, deep_merge, describe, flatten, setting

__all__ = [
    "RESUME_OVERRIDABLE",
    "BackendConfig",
    "CheckpointConfig",
    "ConfigError",
    "ESConfig",
    "GRPOConfig",
    "GenerationConfig",
    "InTrainingEvalConfig",
    "ModelConfig",
    "PipelineConfig",
    "RewardConfig",
    "RunConfig",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "config_from_dict",
    "deep_merge",
    "describe",
    "flatten",
    "load_config",
    "load_run_config",
    "parse_overrides",
    "setting",
]
