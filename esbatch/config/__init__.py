"""Validated YAML configs: run configs, sweep files, launcher profiles, eval configs and aggregate analyses.

One schema mechanism (schema.py) and one loader (loader.py) serve them all; ``esbatch validate FILE`` tells
the kind of a file and checks it without loading a model.
"""

from esbatch.config.run import (
    RESUME_OVERRIDABLE,
    Config,
    config_from_dict,
    load_config,
    load_run_config,
    parse_overrides,
)
from esbatch.es.config import ESConfig
from esbatch.grpo.config import GRPOConfig
from esbatch.pipeline import PipelineConfig
from esbatch.schema import ConfigError, deep_merge, describe, flatten, setting
from esbatch.train.config import TrainConfig
from esbatch.train.sections import (
    BackendConfig,
    CheckpointConfig,
    GenerationConfig,
    InTrainingEvalConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    TaskConfig,
    TrackingConfig,
)

__all__ = [
    "RESUME_OVERRIDABLE",
    "BackendConfig",
    "CheckpointConfig",
    "Config",
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
