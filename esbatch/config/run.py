"""The run config: what `esbatch train` trains, as validated sections (YAML -> dataclasses).

The shared sections live in esbatch/train/config.py, each algorithm's own section in its package
(es/config.py, grpo/config.py, pipeline.py). Here the algorithms are registered and the whole run config is
assembled from their sections. ``load_config`` collects *all* problems at once and raises ``ConfigError``
whose lines name the YAML path of the key, say why it is wrong and list the valid choices.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from esbatch.config.loader import find, load_yaml, read_yaml
from esbatch.es import ES
from esbatch.es.config import LEGACY_NOISE
from esbatch.grpo import GRPO
from esbatch.pipeline import Pipeline
from esbatch.schema import ConfigError, build, deep_merge
from esbatch.train.config import ALGORITHMS, Algorithm, TrainConfig, assemble
from esbatch.train.sections import RESUMABLE

# Adding an algorithm: its package (an Algorithm subclass with its config section) and one line here.
ALGORITHMS.register("es", ES, help="full-parameter Evolution Strategies (paper App. G.1)")
ALGORITHMS.register("grpo", GRPO, help="GRPO on DeepSpeed (paper Section 2.2)")
ALGORITHMS.register("pipeline", Pipeline, help="stages run one after another (es->grpo, ...)")

BUILTIN: list[type[Algorithm]] = [ALGORITHMS.get(name) for name in ALGORITHMS.names()]
# The run config with every registered algorithm's section (`esbatch validate --schema`, the config reference).
Config = assemble(BUILTIN, module=__name__)

# What a resumed run may change: budgets and bookkeeping, never what the logged updates depend on.
RESUME_OVERRIDABLE = {*RESUMABLE, *(f"{a.section}.{key}" for a in BUILTIN for key in a.resumable)}
# Keys earlier esbatch versions wrote into run folders and plans; accepted and ignored so those stay resumable.
RETIRED = {("backend", "enable_sleep_mode")}


@functools.cache
def config_class(algorithm: Any) -> type[TrainConfig]:
    """``Config``, or for a user's "package.module:Class" algorithm with a section of its own, ``Config`` plus
    that section (an algorithm the registry cannot load is reported by validation, against ``Config``)."""
    if not isinstance(algorithm, str) or algorithm in ALGORITHMS.names() or ALGORITHMS.problem(algorithm):
        return Config
    algo: type[Algorithm] = ALGORITHMS.get(algorithm)
    if not algo.section or algo.section in Config.algorithm_sections or algo.config is None:
        return Config
    return assemble([*BUILTIN, algo])


# ----------------------------------------------------------------------------- loading


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    """Turn ["es.sigma=0.01", "task.params.digits=3"] into a nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set {item!r}: expected key.sub=value, e.g. --set es.sigma=0.01"])
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError([f"--set {item!r}: '{p}' is set to a value and used as a section"])
        try:
            node[parts[-1]] = load_yaml(raw, f"--set {item!r}") if raw.strip() else None
        except ConfigError as e:
            reason = str(e.errors[0]).splitlines()[0].removeprefix("YAML syntax error: ")
            raise ConfigError(
                [f"--set {item!r}: the value is not valid YAML ({reason}); quote it or fix the brackets"]
            ) from None
    return out


def _drop_retired(data: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for section, key in RETIRED:
        if isinstance(data.get(section), dict):
            data[section].pop(key, None)
    return data


def config_from_dict(data: dict[str, Any], source: str | None = None) -> TrainConfig:
    """Validate a plain dict; raises ConfigError listing every problem."""
    errors: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError([f"top level: expected a mapping, got {type(data).__name__}"], source)
    algorithm = data.get("algorithm")
    cfg = build(config_class(algorithm if isinstance(algorithm, str) else None), _drop_retired(data), "", errors)
    if errors:
        raise ConfigError(errors, source)
    return cfg


def load_config(name_or_path: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Load a YAML run config (path or built-in name, default: quickstart), apply --set overrides, validate."""
    path = find(name_or_path or "quickstart", "config")
    data = deep_merge(read_yaml(path), parse_overrides(overrides))
    return config_from_dict(data, str(path))


def load_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The config a run folder recorded (its config.yaml), as its updates were made: a folder written before
    ``es.noise`` existed has no such key and was trained with the legacy generator, so it gets
    ``es.noise: legacy-cpu`` rather than the default of new runs."""
    path = Path(run_dir) / "config.yaml"
    data = read_yaml(path)
    es = data.get("es") if isinstance(data.get("es"), dict) else None
    if es is None or "noise" not in es:
        data = deep_merge(data, {"es": {"noise": LEGACY_NOISE}})
    return config_from_dict(deep_merge(data, parse_overrides(overrides)), str(path))
