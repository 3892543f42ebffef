"""Sweep files: a base config plus a grid of overrides, expanded into planned runs with stable ids.

    name: popsize                     # the sweep folder is <output_dir>/<name>
    base: gsm8k-qwen                  # built-in config name or a path (relative to this file)
    config: {es: {updates: 300}}      # overrides applied to every run
    grid:                             # cartesian product (W&B-style {values: [...]} also accepted)
      es.population_size: [8, 16, 32, 64]
    zip:                              # values that go together, one group per entry
      - model.name: [qwen2.5-0.5b-instruct, qwen2.5-1.5b-instruct]
        es.sigma: [0.001, 0.0005]
    seeds: [0]                        # run.seed values (another grid axis)
    launcher: a100                    # a profile in launchers/; fields overridable below
    launcher_overrides: {time: "12:00:00"}
    aggregate: [...]                  # tables and plots, see esbatch/aggregate/report.py

Every run's id is a hash of its resolved config without bookkeeping (names, folders, budgets,
tracking), so re-running a sweep finds its runs again, and raising ``es.updates`` extends them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from esbatch.config import (
    RESUME_OVERRIDABLE,
    ConfigError,
    TrainConfig,
    config_from_dict,
    deep_merge,
    describe,
    flatten,
    parse_overrides,
    resolve_config_path,
)
from esbatch.launch.profile import REPO_ROOT, LauncherProfile, load_profile
from esbatch.registry import did_you_mean

SWEEP_KEYS = {
    "name": "sweep name; its folder is <output_dir>/<name> (letters, digits, - _ .)",
    "description": "free text shown by `esbatch status`",
    "base": "built-in config name or YAML path every run starts from (default: quickstart)",
    "config": "nested overrides applied to every run",
    "grid": "{config.key: [values]}: cartesian product",
    "zip": "[{config.key: [values], ...}]: keys in one group vary together",
    "seeds": "run.seed values, one more grid axis",
    "launcher": "launcher profile name (launchers/NAME.yaml) or path",
    "launcher_overrides": "fields of the launcher profile changed for this sweep",
    "output_dir": "where the sweep folder goes (default: the base config's run.output_dir)",
    "experiment": "MLflow experiment (default: the sweep name)",
    "aggregate": "tables and plots written by `esbatch aggregate` (see README)",
}
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

    @property
    def tracking_uri(self) -> str:
        return self.runs[0].config.tracking.uri if self.runs else ""


def run_key(cfg: TrainConfig) -> str:
    """Stable 12-hex id of a resolved config, ignoring names, folders, budgets and tracking.

    Only values that differ from the schema's defaults are hashed, so adding a config field (with a
    default) in a later esbatch version does not change the ids of existing runs.
    """
    # sections the algorithm does not read are inert (a pipeline reads both es and grpo)
    unused = {"es": ("grpo.", "pipeline."), "grpo": ("es.", "pipeline.")}.get(cfg.algorithm, ())
    defaults = flatten(TrainConfig().to_dict())
    flat = {
        k: v
        for k, v in flatten(cfg.to_dict()).items()
        if k not in KEY_EXCLUDED and not k.startswith(KEY_EXCLUDED_PREFIXES + unused) and defaults.get(k, k) != v
    }
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _schema_keys() -> tuple[set[str], set[str]]:
    keys, dict_keys = set(), set()
    for key, tp, _default, _help in describe():
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
    """A sweep file path, or a name in ./sweeps or the repository's sweeps/ (default: quickstart)."""
    name = name_or_path or "quickstart"
    p = Path(name)
    if p.is_file():
        return p
    for d in (Path.cwd() / "sweeps", REPO_ROOT / "sweeps"):
        if (d / f"{name}.yaml").exists():
            return d / f"{name}.yaml"
    names = sorted({q.stem for d in (Path.cwd() / "sweeps", REPO_ROOT / "sweeps") for q in d.glob("*.yaml")})
    raise ConfigError(
        [f"{name}: no such sweep file or sweep name.{did_you_mean(name, names)} Shipped sweeps: {', '.join(names)}"]
    )


def load_sweep(
    name_or_path: str | None = None, launcher: str | None = None, overrides: list[str] | None = None
) -> Sweep:
    """Parse, expand and validate a sweep file; raises ConfigError naming every bad key before anything runs."""
    path = resolve_sweep_path(name_or_path)
    src = str(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"YAML syntax error: {e}"], src) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"top level: expected a mapping, got {type(raw).__name__}"], src)
    errors: list[str] = []
    for k in raw:
        if k not in SWEEP_KEYS:
            errors.append(
                f"{k}: unknown sweep key.{did_you_mean(str(k), list(SWEEP_KEYS))} Valid keys: {', '.join(SWEEP_KEYS)}"
            )
    name = raw.get("name")
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
        errors.append(f"name: {SWEEP_KEYS['name']}; got {name!r}")
        name = "sweep"

    # ---- base config (path relative to the sweep file first)
    base_data: dict[str, Any] = {}
    base = raw.get("base", "quickstart")
    try:
        rel = path.parent / str(base)
        bpath = rel if rel.is_file() else resolve_config_path(str(base))
        base_data = yaml.safe_load(bpath.read_text()) or {}
    except ConfigError as e:
        errors += [f"base: {m}" for m in e.errors]
    common = raw.get("config") or {}
    if not isinstance(common, dict):
        errors.append(f"config: expected a mapping of config overrides, got {type(common).__name__}")
        common = {}
    base_data = deep_merge(deep_merge(base_data, common), parse_overrides(overrides))

    # ---- axes: grid keys, zip groups, seeds
    axes: list[list[dict[str, Any]]] = []
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict):
        errors.append(f"grid: expected a mapping {{config.key: [values]}}, got {type(grid).__name__}")
        grid = {}
    for key, v in grid.items():
        vals = _values(v, f"grid.{key}", errors)
        if _check_key(str(key), f"grid.{key}", errors) and vals:
            axes.append([{key: x} for x in vals])
    zips = raw.get("zip") or []
    if not isinstance(zips, list):
        errors.append("zip: expected a list of groups, e.g. [{model.name: [a, b], es.sigma: [0.001, 0.0005]}]")
        zips = []
    for i, group in enumerate(zips):
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
    if "seeds" in raw:
        seeds = _values(raw["seeds"], "seeds", errors)
        if seeds and not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            errors.append(f"seeds: expected integers, got {seeds!r}")
        elif seeds:
            axes.append([{"run.seed": s} for s in seeds])

    # ---- launcher profile
    launcher_name = launcher or raw.get("launcher") or "local"
    lo = raw.get("launcher_overrides") or {}
    profile = LauncherProfile()
    if not isinstance(lo, dict):
        errors.append("launcher_overrides: expected a mapping of launcher profile fields")
        lo = {}
    try:
        profile = load_profile(str(launcher_name), lo)
    except ConfigError as e:
        errors += [f"{e.source}: {m}" if e.source else m for m in e.errors]

    # ---- output folder, experiment
    out = Path(raw.get("output_dir") or (base_data.get("run") or {}).get("output_dir") or "esbatch-runs")
    sweep_dir = (out / name).resolve()
    experiment = raw.get("experiment") or name
    uri = (base_data.get("tracking") or {}).get("uri") or f"sqlite:///{sweep_dir / 'mlflow.db'}"

    # ---- aggregate specs (validated now, used by `esbatch aggregate`)
    analyses: list[Any] = []
    if raw.get("aggregate") is not None:
        from esbatch.aggregate.report import parse_analyses

        try:
            analyses = parse_analyses(raw.get("aggregate"), "aggregate")
        except ConfigError as e:
            errors += e.errors
    if errors:
        raise ConfigError(errors, src)

    # ---- expand and validate every run
    points = [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*axes)] or [{}]
    varying = [k for k in dict.fromkeys(k for p in points for k in p) if len({repr(p.get(k)) for p in points}) > 1]
    runs: list[PlannedRun] = []
    seen: dict[str, int] = {}
    per_run: dict[str, list[str]] = {}  # message -> the runs it applies to
    for i, point in enumerate(points):
        label = " ".join(f"{_short(k)}={point[k]}" for k in varying) or name
        nested: dict[str, Any] = {}
        for k, v in point.items():
            for part in reversed(k.split(".")):
                v = {part: v}
            nested = deep_merge(nested, v)
        data = deep_merge(base_data, nested)
        data = deep_merge(data, {"tracking": {"uri": uri, "experiment": experiment}})
        if profile.cluster == "slurm" and not (data.get("run") or {}).get("threads"):
            data = deep_merge(data, {"run": {"threads": profile.cpus_per_task}})
        try:
            cfg = config_from_dict(data)
        except ConfigError as e:
            for m in e.errors:
                per_run.setdefault(m, []).append(f"run {i} ({label})")
            continue
        key = run_key(cfg)
        if key in seen:
            errors.append(f"run {i} ({label}): same config as run {seen[key]}; the grid has duplicate points")
            continue
        seen[key] = i
        cfg.run.output_dir = str(sweep_dir / "runs")
        cfg.run.name = key
        runs.append(PlannedRun(i, key, label, point, cfg))
    for m, where in per_run.items():  # a problem of the base config repeats in every run: say it once
        errors.append(f"every run: {m}" if len(where) == len(points) else f"{', '.join(where)}: {m}")
    if errors:
        raise ConfigError(errors, src)
    return Sweep(
        name=name,
        source=str(path.resolve()),
        dir=sweep_dir,
        launcher=str(launcher_name),
        profile=profile,
        experiment=experiment,
        runs=runs,
        analyses=analyses,
        aggregate_raw=raw.get("aggregate"),
        description=str(raw.get("description") or ""),
    )
