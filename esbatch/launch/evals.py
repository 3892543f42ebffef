"""A sweep's evaluation phase (paper RQ1): every trained run's final model and every base model, one eval each.

    evaluate: {config: eval-easy, base_models: true, train_task: GSM8K, set: {sampling: {n: 32}}}

Each eval is planned like a run: a stable key (``ev-...`` for a trained run, ``base-...`` for a base model,
hashed from what it evaluates and the resolved eval config, so a changed protocol is a new eval, never mixed
into an old folder), its resolved config in ``plan/<key>.eval.yaml``, its folder ``evals/<key>/`` (the layout
of esbatch/eval/runner.py: samples appended chunk by chunk, so a killed eval continues). An eval of a trained
run starts when that run's training has finished (local launcher: right after it; SLURM: an array with
``--dependency=aftercorr`` on the training array, task i after task i); base-model evals start at once.

The threshold phase (``threshold: {tau: [...], config: ..., task: ...}``, paper Figure 4) adds, per trained run
and tau, an eval ``thr-...`` of the checkpoint ``runs/<key>/thresholded/tau-<tau>/``: the same kind of job, after
the same training, which first writes that checkpoint (or reuses it when intact: esbatch/analyze/threshold.py)
and then evaluates it on the target task. The unthresholded final model (tau 0) is the curve's anchor: the
``evaluate:`` eval of the run when its resolved config is the same, else one more ``thr-`` eval of the run.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esbatch.analyze.threshold import tau_dir
from esbatch.config.eval import eval_config_from_dict
from esbatch.config.loader import find, read_yaml
from esbatch.registry import did_you_mean
from esbatch.schema import ConfigError, deep_merge
from esbatch.train.rundir import RunFolderError

BASE_PREFIX, RUN_PREFIX, THRESHOLD_PREFIX = "base-", "ev-", "thr-"
SOURCE_FILE = "source.json"  # which center an eval of a trained run evaluated: {run, updates}


@dataclass
class PlannedEval:
    key: str
    label: str
    source: str | None  # the trained run's key; None = a base model
    point: dict[str, Any]  # the run's sweep point (method, model.name, ...) or {model.name: ...} for a base model
    config: dict[str, Any]  # the eval config (checkpoint set for trained runs)
    tau: float | None = None  # a point of the threshold curve: its tau (0 = the unthresholded anchor)


def is_eval_key(key: str) -> bool:
    return key.startswith((BASE_PREFIX, RUN_PREFIX, THRESHOLD_PREFIX))


def _hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def load_eval_bases(spec: Any, sweep_path: Path, errors: list[str]) -> list[dict[str, Any]]:
    """The sweep's eval config(s) as dicts (each a path relative to the sweep file first, then a built-in name)."""
    out, labels = [], []
    for name in [spec.config] if isinstance(spec.config, str) else spec.config:
        try:
            rel = sweep_path.parent / name
            data = deep_merge(read_yaml(rel if rel.is_file() else find(name, "eval")), spec.set)
            labels += [t.label or t.name for t in eval_config_from_dict(data).task_list()]
            out.append(data)
        except ConfigError as e:
            errors.extend(f"evaluate.config: {m}" for m in e.errors)
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        errors.append(
            f"evaluate.config: task labels {', '.join(dup)} appear in more than one eval config; relabel them"
        )
    if spec.train_task is not None and out and spec.train_task not in labels:
        errors.append(
            f"evaluate.train_task: '{spec.train_task}' is not a task label of {spec.config}."
            f"{did_you_mean(spec.train_task, labels)} Its labels: {', '.join(labels)}"
        )
    return out


def plan_evals(
    spec: Any, bases: list[dict[str, Any]], runs: list[Any], sweep_dir: Path, experiment: str, errors: list[str]
) -> list[PlannedEval]:
    """Per eval config: one eval per run (its final center) and, with ``base_models``, one per distinct base
    model (and one per evaluate-only model)."""
    out: list[PlannedEval] = []
    for base in bases:
        suffix = f" [{base.get('name', 'eval')}]" if len(bases) > 1 else ""
        for e in _plan_one(spec, base, runs, sweep_dir, experiment, errors):
            e.label += suffix
            out.append(e)
    return sorted(out, key=lambda e: e.source is not None)  # evals that start at once first


def _plan_one(
    spec: Any, eval_base: dict[str, Any], runs: list[Any], sweep_dir: Path, experiment: str, errors: list[str]
) -> list[PlannedEval]:
    uri = runs[0].config.tracking.uri if runs else None
    common = {"output_dir": str(sweep_dir / "evals"), "tracking": {"uri": uri, "experiment": experiment}}
    out: list[PlannedEval] = []
    bases: dict[str, PlannedEval] = {}
    for r in runs:
        model = r.config.to_dict()["model"]
        cfg = deep_merge(copy.deepcopy(eval_base), {**common, "model": model})
        if not _valid(cfg, f"evaluate (run {r.key}, {r.label})", errors):
            continue
        key = RUN_PREFIX + _hash(r.key, cfg)
        planned = {**cfg, "name": key, "checkpoint": str(sweep_dir / "runs" / r.key)}
        out.append(PlannedEval(key, f"{r.label} (eval)", r.key, dict(r.point), planned))
        if spec.base_models and not model.get("init_weights"):
            bkey = BASE_PREFIX + _hash(cfg)
            if bkey not in bases:
                point = {"method": "Base", "model.name": model["name"]}
                bases[bkey] = PlannedEval(bkey, f"base {model['name']}", None, point, {**cfg, "name": bkey})
    for i, m in enumerate(spec.models):
        extra = _extra_eval(m, eval_base, common, f"evaluate.models[{i}]", errors)
        if extra is not None:
            bases.setdefault(extra.key, extra)
    return list(bases.values()) + out


def load_threshold_base(
    spec: Any, evaluate: Any, sweep_path: Path, errors: list[str]
) -> tuple[dict[str, Any] | None, str | None]:
    """The threshold phase's eval config as a dict and its target task's label (``task``, else the evaluate
    phase's ``train_task`` when the config has it, else the config's only task)."""
    try:
        rel = sweep_path.parent / spec.config
        data = deep_merge(read_yaml(rel if rel.is_file() else find(spec.config, "eval")), spec.set)
        labels = [t.label or t.name for t in eval_config_from_dict(data).task_list()]
    except ConfigError as e:
        errors.extend(f"threshold.config: {m}" for m in e.errors)
        return None, None
    if spec.task is not None:
        if spec.task not in labels:
            errors.append(
                f"threshold.task: '{spec.task}' is not a task label of {spec.config}.{did_you_mean(spec.task, labels)} "
                f"Its labels: {', '.join(labels)}"
            )
            return None, None
        return data, spec.task
    train_task = getattr(evaluate, "train_task", None)
    if train_task in labels:
        return data, train_task
    if len(labels) == 1:
        return data, labels[0]
    errors.append(
        f"threshold.task: {spec.config} has {len(labels)} tasks; name the target task whose Pass@1 the curve shows "
        f"(one of {', '.join(labels)})"
    )
    return None, None


def plan_threshold(
    spec: Any,
    eval_base: dict[str, Any],
    runs: list[Any],
    sweep_dir: Path,
    experiment: str,
    planned: list[PlannedEval],
    errors: list[str],
) -> list[PlannedEval]:
    """Per selected run: the tau-0 anchor (``planned``'s eval of the run when it has the same config: marked, not
    planned again) and one eval per tau of ``runs/<key>/thresholded/tau-<tau>/``, in tau order."""

    methods = list(dict.fromkeys(str(r.point["method"]) for r in runs if "method" in r.point))
    wanted = [str(m) for m in spec.methods]
    unknown = [m for m in wanted if m not in methods]
    if unknown:
        valid = f"the sweep's methods: {', '.join(methods)}" if methods else "the sweep has no `methods:` axis"
        errors.append(
            f"threshold.methods: {', '.join(map(repr, unknown))} not a method of this sweep."
            f"{did_you_mean(unknown[0], methods)} Valid: {valid}"
        )
        return []
    chosen = [r for r in runs if not wanted or r.point.get("method") in wanted]
    if not chosen:
        errors.append(f"threshold: no trained run to threshold (runs: {len(runs)}, methods: {wanted or 'all'})")
        return []
    uri = runs[0].config.tracking.uri
    common = {"output_dir": str(sweep_dir / "evals"), "tracking": {"uri": uri, "experiment": experiment}}
    by_key = {e.key: e for e in planned}
    out: list[PlannedEval] = []
    for r in chosen:
        cfg = deep_merge(copy.deepcopy(eval_base), {**common, "model": r.config.to_dict()["model"]})
        if not _valid(cfg, f"threshold (run {r.key}, {r.label})", errors):
            continue
        run_dir = sweep_dir / "runs" / r.key
        anchor = by_key.get(RUN_PREFIX + _hash(r.key, cfg))  # the evaluate phase's eval of this final model
        if anchor is not None:
            anchor.tau = 0.0
        else:
            key = THRESHOLD_PREFIX + _hash(r.key, cfg, 0.0)
            planned_cfg = {**cfg, "name": key, "checkpoint": str(run_dir)}
            out.append(PlannedEval(key, f"{r.label} (tau=0)", r.key, dict(r.point), planned_cfg, 0.0))
        for tau in spec.tau:
            key = THRESHOLD_PREFIX + _hash(r.key, cfg, tau)
            planned_cfg = {**cfg, "name": key, "checkpoint": str(tau_dir(run_dir, tau))}
            out.append(PlannedEval(key, f"{r.label} (tau={tau:g})", r.key, dict(r.point), planned_cfg, tau))
    return out


def _extra_eval(
    m: Any, eval_base: dict[str, Any], common: dict[str, Any], where: str, errors: list[str]
) -> PlannedEval | None:
    """A model evaluated as given, never trained here (e.g. the paper's released Hard-setting GRPO checkpoint)."""
    if not isinstance(m, dict) or set(m) - {"method", "model", "as"} or "method" not in m or "model" not in m:
        errors.append(f"{where}: expected {{method: NAME, model: {{name: ...}}, as: MODEL_NAME}}, got {m!r}")
        return None
    cfg = deep_merge(copy.deepcopy(eval_base), {**common, "model": m["model"]})
    if not _valid(cfg, where, errors):
        return None
    key = BASE_PREFIX + _hash(m["method"], cfg)
    point = {"method": str(m["method"]), "model.name": m.get("as") or cfg["model"]["name"]}
    return PlannedEval(key, f"{m['method']} {cfg['model']['name']}", None, point, {**cfg, "name": key})


def _valid(cfg: dict[str, Any], where: str, errors: list[str]) -> bool:
    try:
        eval_config_from_dict(cfg)
    except ConfigError as e:
        errors.extend(f"{where}: {m}" for m in e.errors if f"{where}: {m}" not in errors)
        return False
    return True


def eval_done(folder: Path) -> bool:
    """Finished: the eval wrote its summary and logged it (metrics.json with its MLflow run id)."""
    try:
        return bool(json.loads((folder / "metrics.json").read_text()).get("mlflow_run_id"))
    except (OSError, ValueError, AttributeError):
        return False


def eval_progress(folder: Path) -> int:
    """Problems evaluated so far, over every task: complete (newline-ended) lines of samples/*.jsonl. Counted
    without parsing: `esbatch status` and the progress display poll it every few seconds."""
    n = 0
    for f in sorted((folder / "samples").glob("*.jsonl")):
        with open(f, "rb") as fh:
            n += sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
    return n


class DamagedSource(RunFolderError):
    """An eval folder's source record cannot be read: which center it evaluated is unknown."""


def source_record(folder: Path) -> dict[str, Any]:
    """What the eval in ``folder`` evaluated: {"run": key, "updates": t}; {} when it has no record (a base-model
    eval, or one stopped before it began). A record that cannot be read raises ``DamagedSource`` naming it."""
    path = folder / SOURCE_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise DamagedSource(f"{path}: cannot be read ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("updates", 0), int):
        raise DamagedSource(f"{path}: not an eval source record (want {{'run': key, 'updates': int}})")
    return record


def evaluated_updates(folder: Path) -> int | None | str:
    """The source run's update the eval in ``folder`` evaluated; None without a record, "damaged" when unknown."""
    try:
        return source_record(folder).get("updates")
    except DamagedSource:
        return "damaged"


def eval_disk_state(folder: Path, source_t: int | None, source_finished: bool) -> str:
    """pending | finished | interrupted | stale (it evaluated an older center of a run trained further since).

    ``source_t`` is the trained run's updates done now (None for a base model)."""
    if not folder.exists():
        return "pending"
    if source_t is not None and evaluated_updates(folder) not in (None, source_t):
        return "stale"  # also a damaged record: which center it evaluated is unknown, so it is evaluated again
    if eval_done(folder):
        return "finished" if source_t is None or source_finished else "stale"
    return "interrupted"
