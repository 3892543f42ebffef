"""Sweep files expanded into planned runs with stable ids (the file's schema: esbatch/config/sweep.py).

Every run's id is a hash of its resolved config without bookkeeping (names, folders, budgets,
tracking), so re-running a sweep finds its runs again, and raising ``es.updates`` extends them.
Everything is validated here, before anything is submitted.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from esbatch.backends.config import weight_transfer_problem
from esbatch.config.aggregate import parse_specs
from esbatch.config.launcher import LauncherProfile, load_profile
from esbatch.config.loader import find, read_yaml
from esbatch.config.run import RESUME_OVERRIDABLE, Config, config_from_dict, parse_overrides
from esbatch.config.sweep import SWEEP_KEYS, SweepFile
from esbatch.launch.evals import PlannedEval, load_eval_bases, load_threshold_base, plan_evals, plan_threshold
from esbatch.registry import did_you_mean
from esbatch.schema import ConfigError, build, deep_merge, describe, flatten
from esbatch.train.config import TrainConfig

__all__ = ["SWEEP_KEYS", "PlannedRun", "Sweep", "load_sweep", "run_key"]

# Not part of a run's identity: where it is written, how it is logged, how long it trains.
KEY_EXCLUDED = RESUME_OVERRIDABLE | {"run.name", "run.output_dir"}
KEY_EXCLUDED_PREFIXES = ("tracking.",)


@dataclass
class PlannedRun:
    index: int
    key: str
    label: str
    point: dict[str, Any]
    config: TrainConfig


@dataclass
class Sweep:
    name: str
    source: str
    dir: Path
    launcher: str
    profile: LauncherProfile
    experiment: str
    runs: list[PlannedRun]
    analyses: list[Any] = field(default_factory=list)
    aggregate_raw: list[Any] | None = None
    description: str = ""
    evals: list[PlannedEval] = field(default_factory=list)
    train_task: str | None = None
    threshold: dict[str, Any] | None = None  # {task, tau, base_dtype, as_dtype}: the threshold phase (Figure 4)

    @property
    def tracking_uri(self) -> str:
        return self.runs[0].config.tracking.uri if self.runs else ""


def run_key(cfg: TrainConfig) -> str:
    """Stable 12-hex id of a resolved config, ignoring names, folders, budgets and tracking.

    Only values that differ from the schema's defaults are hashed, so adding a config field (with a
    default) in a later esbatch version does not change the ids of existing runs. Sections the algorithm
    does not read (``Algorithm.inert``) are left out too.
    """
    unused = tuple(f"{sec}." for sec in cfg.inert_sections())
    defaults = flatten(type(cfg)().to_dict())
    flat = {
        k: v
        for k, v in flatten(cfg.to_dict()).items()
        if k not in KEY_EXCLUDED and not k.startswith(KEY_EXCLUDED_PREFIXES + unused) and defaults.get(k, k) != v
    }
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _schema_keys() -> tuple[set[str], set[str]]:
    keys, dict_keys = set(), set()
    for key, tp, _default, _help in describe(Config):
        keys.add(key)
        if tp.startswith("dict"):
            dict_keys.add(key)
    return keys, dict_keys


def _check_key(key: str, where: str, errors: list[str]) -> bool:
    keys, dict_keys = _schema_keys()
    if key in keys or any(key.startswith(d + ".") for d in dict_keys):
        return True
    errors.append(
        f"{where}: '{key}' is not a config key.{did_you_mean(key, sorted(keys))} "
        f"List them with `esbatch validate --schema`"
    )
    return False


def _values(v: Any, where: str, errors: list[str]) -> list[Any] | None:
    if isinstance(v, dict) and set(v) == {"values"}:
        v = v["values"]
    if not isinstance(v, list) or not v:
        errors.append(f"{where}: expected a non-empty list of values (or {{values: [...]}}), got {v!r}")
        return None
    return v


def _short(key: str) -> str:
    parts = key.split(".")
    return parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1]


def resolve_sweep_path(name_or_path: str | None) -> Path:
    """A sweep file path, or a sweep name in ./sweeps or the built-in sweeps (default: quickstart)."""
    return find(name_or_path or "quickstart", "sweep")


def load_sweep(
    name_or_path: str | None = None,
    launcher: str | None = None,
    overrides: list[str] | None = None,
    name: str | None = None,
) -> Sweep:
    """Parse, expand and validate a sweep file; raises ConfigError naming every bad key before anything runs.

    ``name`` renames the sweep (its folder and MLflow experiment), e.g. to run it again elsewhere. ``overrides``
    (--set) change the runs' config, except keys under ``evaluate.`` or ``threshold.``, which change those phases
    of the sweep file (e.g. evaluate.set.sampling.n=4 to shrink the evaluation).
    """
    path = resolve_sweep_path(name_or_path)
    src = str(path)
    raw = read_yaml(path)
    if name is not None:
        raw["name"] = name
    phase = [o for o in overrides or [] if o.partition("=")[0].strip().startswith(SWEEP_PHASES)]
    overrides = [o for o in overrides or [] if o not in phase]
    for section, values in parse_overrides(phase).items():
        if not isinstance(raw.get(section), dict):
            raise ConfigError([f"--set {section}...: the sweep has no `{section}:` section to change"], src)
        raw[section] = deep_merge(raw[section], values)
    errors: list[str] = []
    spec = build(SweepFile, raw, "", errors) or SweepFile(name="sweep")  # keep going: report every problem
    base_data = _base(spec, path, overrides, errors)
    axes = _axes(spec, errors)
    n_runs = math.prod(len(a) for a in axes)
    if n_runs > spec.max_runs:  # counted before a single run is built: a 10^6-point grid is refused at once
        sizes = " x ".join(str(len(a)) for a in axes)
        errors.append(
            f"grid: expands to {n_runs} runs ({sizes}), more than max_runs: {spec.max_runs}; check the grid, or set "
            f"max_runs: {n_runs} in the sweep file if you mean it"
        )
        axes = []
    launcher_name = launcher or spec.launcher or "local"
    try:
        profile = load_profile(str(launcher_name), spec.launcher_overrides)
    except ConfigError as e:
        errors += [f"{e.source}: {m}" if e.source else m for m in e.errors]
        profile = LauncherProfile()
    if errors:
        raise ConfigError(errors, src)
    out = Path(spec.output_dir or (base_data.get("run") or {}).get("output_dir") or "esbatch-runs")
    sweep_dir = (out / spec.name).resolve()
    experiment = spec.experiment or spec.name
    uri = (base_data.get("tracking") or {}).get("uri") or f"sqlite:///{sweep_dir / 'mlflow.db'}"
    base_data = deep_merge(base_data, {"tracking": {"uri": uri, "experiment": experiment}})
    if profile.cluster == "slurm" and not (base_data.get("run") or {}).get("threads"):
        base_data = deep_merge(base_data, {"run": {"threads": profile.cpus_per_task}})
    runs = _expand(spec.name, base_data, axes, sweep_dir, src)
    if errors := engine_errors(runs, profile, str(launcher_name)):
        raise ConfigError(errors, src)
    evals: list[PlannedEval] = []
    if spec.evaluate is not None:
        bases = load_eval_bases(spec.evaluate, path, errors)
        if bases:
            evals = plan_evals(spec.evaluate, bases, runs, sweep_dir, experiment, errors)
        if errors:
            raise ConfigError(errors, src)
    threshold = None
    if spec.threshold is not None:
        base, task = load_threshold_base(spec.threshold, spec.evaluate, path, errors)
        if base is not None:
            evals += plan_threshold(spec.threshold, base, runs, sweep_dir, experiment, evals, errors)
        if errors:
            raise ConfigError(errors, src)
        th = spec.threshold
        threshold = {"task": task, "tau": th.tau, "base_dtype": th.base_dtype, "as_dtype": th.as_dtype}

    return Sweep(
        name=spec.name,
        source=str(path.resolve()),
        dir=sweep_dir,
        launcher=str(launcher_name),
        profile=profile,
        experiment=experiment,
        runs=runs,
        analyses=parse_specs(spec.aggregate) if spec.aggregate is not None else [],
        aggregate_raw=spec.aggregate,
        description=spec.description,
        evals=evals,
        train_task=spec.evaluate.train_task if spec.evaluate else None,
        threshold=threshold,
    )


def engine_errors(runs: list[PlannedRun], profile: LauncherProfile, launcher: str) -> list[str]:
    """Runs whose vLLM engines cannot start on the launcher profile's tasks, refused here rather than when the job
    starts on the node: more engines (one per GPU) than the GPUs a task gets, or a GRPO engine whose
    backend.weight_transfer needs CUDA (ipc) on a profile without GPUs (gpus_per_node: 0, the CPU plan)."""
    errors = []
    for r in runs:
        b = r.config.backend
        if b.name != "vllm":
            continue
        if profile.gpus_per_node and b.engines > profile.gpus_per_node:
            errors.append(
                f"run {r.key} ({r.label}): backend.engines: {b.engines} vLLM engines need a GPU each, but "
                f"launcher profile {launcher} gives a task gpus_per_node: {profile.gpus_per_node}; set "
                f"launcher_overrides: {{gpus_per_node: {b.engines}}} or lower backend.engines"
            )
        why = weight_transfer_problem(b.weight_transfer, b.policy_engine, on_gpu=bool(profile.gpus_per_node))
        if r.config.algorithm == "grpo" and why:
            errors.append(
                f"run {r.key} ({r.label}): backend.{why} (launcher profile {launcher}: gpus_per_node: "
                f"{profile.gpus_per_node})"
            )
    return errors


SWEEP_PHASES = ("evaluate.", "threshold.")  # --set keys that change a phase of the sweep file, not the runs


def _base(spec: SweepFile, path: Path, overrides: list[str] | None, errors: list[str]) -> dict[str, Any]:
    """The base run config (a path relative to the sweep file first, then a config name) with the sweep's
    ``config`` overrides and the command line's --set."""
    data: dict[str, Any] = {}
    try:
        rel = path.parent / spec.base
        data = read_yaml(rel if rel.is_file() else find(spec.base, "config"))
    except ConfigError as e:
        errors += [f"base: {m}" for m in e.errors]
    return deep_merge(deep_merge(data, spec.config), parse_overrides(overrides))


def _axes(spec: SweepFile, errors: list[str]) -> list[list[dict[str, Any]]]:
    """One axis per grid key, zip group and the seeds: each a list of {config.key: value} points."""
    axes: list[list[dict[str, Any]]] = []
    for key, v in spec.grid.items():
        vals = _values(v, f"grid.{key}", errors)
        if _check_key(str(key), f"grid.{key}", errors) and vals:
            axes.append([{key: x} for x in vals])
    for i, group in enumerate(spec.zip):
        if not isinstance(group, dict) or not group:
            errors.append(f"zip[{i}]: expected a mapping {{config.key: [values]}}, got {group!r}")
            continue
        cols = {}
        for key, v in group.items():
            vals = _values(v, f"zip[{i}].{key}", errors)
            if _check_key(str(key), f"zip[{i}].{key}", errors) and vals:
                cols[key] = vals
        lens = {k: len(v) for k, v in cols.items()}
        if len(set(lens.values())) > 1:
            errors.append(f"zip[{i}]: every key needs the same number of values, got {lens}")
        elif cols:
            axes.append([dict(zip(cols, row)) for row in zip(*cols.values())])
    if spec.methods:
        axis = _methods_axis(spec.methods, errors)
        if axis:
            axes.append(axis)
    if spec.seeds is not None:
        seeds = _values(spec.seeds, "seeds", errors)
        if seeds and not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            errors.append(f"seeds: expected integers, got {seeds!r}")
        elif seeds:
            axes.append([{"run.seed": s} for s in seeds])
    return axes


METHOD = "method"  # the methods axis: a name in labels and tables, its overrides in the config


def _methods_axis(methods: dict[str, Any], errors: list[str]) -> list[dict[str, Any]]:
    """{name: overrides} -> points {method: name, dotted.key: value, ...} (one axis)."""
    axis = []
    for name, overrides in methods.items():
        if not isinstance(overrides, dict):
            errors.append(f"methods.{name}: expected a mapping of config overrides, e.g. {{algorithm: es}}")
            continue
        flat = flatten(overrides)
        if all(_check_key(k, f"methods.{name}.{k}", errors) for k in list(flat)):
            axis.append({METHOD: str(name), **flat})
    return axis


def _expand(name: str, base: dict[str, Any], axes: list, sweep_dir: Path, src: str) -> list[PlannedRun]:
    """Every point of the axes as a validated run; a problem every run shares is reported once."""
    points = [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*axes)] or [{}]
    from_method = {k for p in points if METHOD in p for k in p if k != METHOD}  # named by the method instead
    varying = [
        k
        for k in dict.fromkeys(k for p in points for k in p)
        if len({repr(p.get(k)) for p in points}) > 1 and k not in from_method
    ]
    runs: list[PlannedRun] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    per_run: dict[str, list[str]] = {}  # message -> the runs it applies to
    for i, point in enumerate(points):
        label = " ".join(f"{_short(k)}={point[k]}" for k in varying) or name
        nested: dict[str, Any] = {}
        for k, v in point.items():
            if k == METHOD:
                continue
            for part in reversed(k.split(".")):
                v = {part: v}
            nested = deep_merge(nested, v)
        try:
            cfg = config_from_dict(deep_merge(base, nested))
        except ConfigError as e:
            for m in e.errors:
                per_run.setdefault(m, []).append(f"run {i} ({label})")
            continue
        key = run_key(cfg)
        if key in seen:
            errors.append(f"run {i} ({label}): same config as run {seen[key]}; the grid has duplicate points")
            continue
        seen[key] = i
        cfg.run.output_dir, cfg.run.name = str(sweep_dir / "runs"), key
        runs.append(PlannedRun(i, key, label, point, cfg))
    for m, where in per_run.items():
        errors.append(f"every run: {m}" if len(where) == len(points) else f"{', '.join(where)}: {m}")
    if errors:
        raise ConfigError(errors, src)
    return runs
