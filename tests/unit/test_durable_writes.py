"""Issue 29: a crash between write and rename at any durable write leaves the reader the old file or the new one,
never a partial one, and no tmp file behind (esbatch/durable.py).

Faults are injected at four points of one durable write: mid-write (ENOSPC after half the bytes), the fsync before
the rename (ENOSPC), the rename itself, and right after the rename. Each writer case runs a real (tiny) operation
and fails the first durable write of its call site; the test then reads the target (the old bytes, or absent, before
the rename; the new bytes after it) and looks for tmp files. Static checks tie the cases to the code: every function
of esbatch that calls ``durable.*`` has a case here, and no module writes a run-state file (config.yaml, run.json,
metrics.json, ...) with write_text, open(..., "w") or copyfile directly.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from esbatch import durable

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "esbatch"
POINTS = ("write", "fsync", "rename", "after-rename")
TMP = re.compile(r"\.tmp\d+")


class Injected(OSError):
    """The injected fault (a full disk)."""

    def __init__(self, where: str) -> None:
        super().__init__(errno.ENOSPC, f"injected at {where}: No space left on device")


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if TMP.search(p.name))


def _read(p: Path) -> bytes | None:
    return p.read_bytes() if p.exists() else None


def _site() -> tuple[str, str]:
    """The esbatch function (file, qualified name) that called into esbatch/durable.py."""
    f = sys._getframe(1)
    while f is not None:
        path = Path(f.f_code.co_filename)
        if path.is_relative_to(PKG) and path != PKG / "durable.py":
            return str(path.relative_to(ROOT)), unmutated(f.f_code.co_qualname)
        f = f.f_back
    return "", ""


def unmutated(qualname: str) -> str:
    """The source's name of a function mutmut renamed (`C.xǁCǁf__mutmut_orig` is `C.f`, `x_f__mutmut_3` is
    `f`), so that mutation testing (docs/benchmarks.md) finds the call sites."""
    qualname = re.sub(r"xǁ\w+ǁ(\w+?)__mutmut_\w+", r"\1", qualname)
    return re.sub(r"(^|\.)x_(\w+?)__mutmut_\w+", r"\1\2", qualname)


class _Halfway:
    """A file whose first write stores half of its data, then fails as a full disk does."""

    def __init__(self, f: Any, where: str) -> None:
        self.f, self.where = f, where

    def write(self, data: Any) -> int:
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise Injected(self.where)

    def __enter__(self) -> _Halfway:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


@dataclass
class Faults:
    """Spies on every durable write; fails the first one from ``site`` (None: any) at ``point`` (None: no fault)."""

    site: tuple[str, str] | None
    point: str | None
    sites: list[tuple[str, str]] = field(default_factory=list)  # the call site of every durable write
    fired: bool = False
    target: Path | None = None
    old: bytes | None = None
    new: bytes | None = None
    armed_tmp: Path | None = None

    def install(self, mp: pytest.MonkeyPatch) -> None:
        real_replacing, real_replace, real_fsync_file = durable.replacing, os.replace, durable._fsync_file
        real_open = open

        @contextlib.contextmanager
        def replacing(path: Any) -> Iterator[Path]:
            site = _site()
            self.sites.append(site)
            arm = self.point is not None and self.armed_tmp is None and not self.fired and self.site in (None, site)
            if arm:
                self.target = Path(path)
                self.old = _read(self.target)
                self.armed_tmp = durable.tmp_path(path)
            try:
                with real_replacing(path) as tmp:
                    yield tmp
            finally:
                if arm:
                    self.armed_tmp = None

        def opening(file: Any, mode: str = "r", *a: Any, **kw: Any) -> Any:
            f = real_open(file, mode, *a, **kw)
            if self.point == "write" and self.armed_tmp is not None and Path(file) == self.armed_tmp and "w" in mode:
                self.fired = True
                return _Halfway(f, "write")
            return f

        def fsync_file(path: Path) -> None:
            if self.point == "fsync" and self.armed_tmp is not None and Path(path) == self.armed_tmp:
                self.fired = True
                raise Injected("fsync")
            real_fsync_file(path)

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            if self.armed_tmp is not None and Path(src) == self.armed_tmp:
                if self.point == "rename":
                    self.fired = True
                    raise Injected("rename")
                self.new = Path(src).read_bytes()
                real_replace(src, dst, **kw)
                if self.point == "after-rename":  # e.g. the process killed right after the rename
                    self.fired = True
                    raise Injected("after-rename")
                return
            real_replace(src, dst, **kw)

        mp.setattr(durable, "replacing", replacing)
        mp.setattr(durable, "open", opening, raising=False)
        mp.setattr(durable, "_fsync_file", fsync_file)
        mp.setattr(os, "replace", replace)


# ----------------------------------------------------------------------------------------------- the module itself
WRITERS: dict[str, Callable[[Path, bytes], Any]] = {
    "write_text": lambda p, b: durable.write_text(p, b.decode()),
    "write_bytes": durable.write_bytes,
    "open_text": lambda p, b: _open_text(p, b),
    "replacing": lambda p, b: _replacing(p, b),
}


def _open_text(p: Path, b: bytes) -> None:
    with durable.open_text(p, newline="") as f:
        f.write(b.decode())


def _replacing(p: Path, b: bytes) -> None:
    with durable.replacing(p) as tmp:
        tmp.write_bytes(b)  # a library's save(tmp)


@pytest.mark.parametrize("fn", sorted(WRITERS))
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("old", [b"old,1\nold,2\n", None], ids=["replace", "create"])
def test_a_fault_leaves_the_old_or_the_new_file_and_no_tmp(tmp_path, monkeypatch, fn, point, old):
    target = tmp_path / "metrics.json"
    if old is not None:
        target.write_bytes(old)
    new = b'{"new": [' + b"1, " * 5000 + b"2]}\n"
    if fn == "replacing" and point == "write":
        pytest.skip("the block writes the tmp file itself (a library's save): no durable write to fail")
    faults = Faults(None, point)
    faults.install(monkeypatch)
    with pytest.raises(Injected):
        WRITERS[fn](target, new)
    assert faults.fired
    assert _read(target) == (new if point == "after-rename" else old)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("fn", sorted(WRITERS))
def test_without_a_fault_the_new_bytes_replace_the_old(tmp_path, fn):
    target = tmp_path / "run.json"
    target.write_bytes(b"old")
    WRITERS[fn](target, b"new\nline\n")
    assert target.read_bytes() == b"new\nline\n" and _leftovers(tmp_path) == []


def test_an_interrupt_in_the_block_removes_the_tmp_file(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old: 1\n")
    with pytest.raises(KeyboardInterrupt), durable.open_text(target) as f:
        f.write("new: ")
        raise KeyboardInterrupt
    assert target.read_text() == "old: 1\n" and _leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------ the call sites
def _rundir(root: Path) -> Any:
    from esbatch.train.rundir import RunDir

    rd = RunDir(root / "run")
    rd.path.mkdir(parents=True)
    return rd


def _toy(request: pytest.FixtureRequest, **sections: Any) -> dict[str, Any]:
    from toy import toy_config

    sections.setdefault("es_updates", 1)
    return toy_config(request.getfixturevalue("tiny_model_dir"), heldout=0, eval={"every": 0}, **sections)


def _eval_cfg(root: Path, request: pytest.FixtureRequest) -> Any:
    from esbatch.config.eval import eval_config_from_dict

    d = {
        "name": "ev",
        "output_dir": str(root / "evals"),
        "model": {"name": str(request.getfixturevalue("tiny_model_dir")), "dtype": "float32"},
        "sampling": {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "greedy": False, "batch_size": 8},
        "ks": [1, 2],
        "tracking": {"experiment": "evals", "uri": f"sqlite:///{root / 'mlflow.db'}"},
        "tasks": [{"name": "toy:DigitTask", "params": {"size": 16}, "limit": 2, "few_shot": 1}],
    }
    return eval_config_from_dict(d)


def write_meta(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    rd = _rundir(root)
    rd.meta.write_text(json.dumps({"status": "running", "done": 1}))
    return lambda: rd.write_meta(status="stopped", done=2)


def save_center(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    import torch

    rd = _rundir(root)
    rd.save_center({"w": torch.zeros(256)}, 1)
    return lambda: rd.save_center({"w": torch.ones(256)}, 2)


def link_center(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    import torch

    from esbatch.train.rundir import RunDir

    rd, stage = _rundir(root), RunDir(root / "run" / "stage1-es")
    rd.save_center({"w": torch.zeros(256)}, 1)
    stage.save_center({"w": torch.ones(256)}, 2)
    return lambda: rd.link_center(stage.center)


def fingerprint_record(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.config import config_from_dict
    from esbatch.train import fingerprint

    rd, d = _rundir(root), _toy(request)
    fingerprint.record(rd, config_from_dict(d))
    d["run"]["seed"] = 4
    cfg = config_from_dict(d)
    return lambda: fingerprint.record(rd, cfg)


def run_config(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """A new run's config.yaml (RunSession): the first durable write of `esbatch train`."""
    from esbatch.config import config_from_dict
    from esbatch.train import train

    d = _toy(request, es_updates=1)
    d["run"]["output_dir"] = str(root)
    d["tracking"] = {"uri": f"sqlite:///{root / 'mlflow.db'}"}
    cfg = config_from_dict(d)
    return lambda: train(cfg, root / "run", progress=False)


def resume_config(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """`esbatch train --resume RUN --set es.updates=N` rewrites config.yaml before training on."""
    from esbatch.cli import main
    from esbatch.config import config_from_dict
    from esbatch.train import fingerprint

    rd, d = _rundir(root), _toy(request, es_updates=1)
    cfg = config_from_dict(d)
    rd.config.write_text(cfg.to_yaml())
    fingerprint.record(rd, cfg)
    rd.meta.write_text(json.dumps({"status": "stopped", "algorithm": "es", "done": 0}))
    return lambda: main(["train", "--resume", str(rd.path), "--set", "es.updates=2", "--no-progress"])


def sweep_record(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.launch.state import SweepDir

    sd = SweepDir(root / "sweep")
    sd.path.mkdir()
    sd.meta_path.write_text(json.dumps({"name": "s", "submissions": []}))

    def op() -> None:
        with sd.locked() as meta:
            meta["submissions"].append({"job": "1"})

    return op


def plan_file(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.launch.submit import _write_if_changed

    (root / "plan.yaml").write_text("es:\n  updates: 1\n")
    return lambda: _write_if_changed(root / "plan.yaml", "es:\n  updates: 2\n")


def parameter_count(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.models import _write_count

    (root / "count.json").write_text('{"parameters": 5}\n')
    return lambda: 0 if _write_count(root / "count.json", 7) else 1  # a cache: it says whether it kept the count


def aggregate_csv(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.aggregate.tables import write_csv

    (root / "t.csv").write_text("a,b\n0,0\n")
    return lambda: write_csv(root / "t.csv", ["a", "b"], [[1, 2.5], [3, float("nan")]])


def aggregate_md(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.aggregate.tables import finish

    (root / "final.md").write_text("# old\n")
    return lambda: finish(SimpleNamespace(name="final"), root, "Final", "| a |\n|---|\n| 1 |", [])


def report_index(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.aggregate.report import write_report

    (root / "README.md").write_text("# old index\n")
    return lambda: write_report([], [], root, "title")


def diversity_csv(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.analyze.diversity import Series, write_csv

    (root / "diversity.csv").write_text("old\n")
    return lambda: write_csv([Series("a", "es", [])], root / "diversity.csv")


def diversity_md(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.analyze.diversity import Series, write_markdown

    (root / "diversity.md").write_text("old\n")
    return lambda: write_markdown([Series("a", "es", []), Series("b", "grpo", [])], root / "diversity.md")


def drift_csv(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.analyze.drift import _csv

    (root / "topk.csv").write_text("old\n")
    return lambda: _csv(root / "topk.csv", [{"type": "mlp", "layer": 0, "count": 3}])


def drift_outputs(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.analyze.drift import DriftStats, write_outputs

    (root / "d").mkdir()
    (root / "d" / "table4.md").write_text("old\n")
    s = DriftStats(label="a", algorithm="es", t=1)
    return lambda: write_outputs(s, root / "d", [s], None)


def _cell() -> Any:
    from esbatch.diagnose.protocol import Cell

    plus, center, minus = [1.0, 2.0, 0.5], [1.0, 1.5, 0.7], [0.5, 1.0, 0.2]
    return Cell("regenerated", "common", 0.01, plus, center, minus, [(0, 0, 0), (0, 0, 1), (1, 0, 0)])


def kappa_tables(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.diagnose.report import write_outputs

    (root / "kappa.csv").write_text("old\n")
    c = _cell()
    return lambda: write_outputs([c], root)


def kappa_config(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """`esbatch diagnose kappa` writes config.yaml and protocol.json beside its tables (kappa itself stubbed)."""
    import yaml

    import esbatch.cli
    from esbatch.cli import main

    c = _cell()
    request.getfixturevalue("monkeypatch").setattr(esbatch.cli, "run_kappa", lambda *a, **kw: [c])
    (root / "out").mkdir()
    (root / "out" / "config.yaml").write_text("old: 1\n")
    (root / "c.yaml").write_text(yaml.safe_dump(_toy(request)))
    args = ["--prompts", "2", "--sigmas", "0.01", "--no-progress", "-o", str(root / "out")]
    return lambda: main(["diagnose", "kappa", str(root / "c.yaml"), *args])


def eval_tables(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.eval.runner import EvalDir, write_tables

    ed = EvalDir(root / "ev")
    ed.path.mkdir()
    (ed.path / "table.csv").write_text("old\n")
    return lambda: write_tables(ed, {"math": {"pass@1": 0.5, "problems": 2}}, ["pass@1"], "t")


def eval_summary(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.eval.runner import EvalDir, summarize

    cfg = _eval_cfg(root, request)
    ed = EvalDir(root / "ev")
    ed.path.mkdir()
    (ed.path / "passk.csv").write_text("task,k,pass_at_k\n")
    return lambda: summarize(cfg, ed, "src", {et.label or et.name: [] for et in cfg.task_list()})


def eval_config(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.eval.runner import evaluate

    cfg = _eval_cfg(root, request)
    return lambda: evaluate(cfg, progress=False)


def _trained(root: Path, request: pytest.FixtureRequest, **sections: Any) -> Any:
    """A run folder as training leaves it after one update (config.yaml, run.json, center.safetensors), by hand."""
    from safetensors.torch import load_file

    rd, d = _rundir(root), _toy(request, **sections)
    d["model"]["name"] = str(request.getfixturevalue("tiny_model_dir"))
    rd.config.write_text(yaml.safe_dump(d))
    rd.meta.write_text(json.dumps({"status": "finished", "algorithm": d.get("algorithm", "es"), "done": 1}))
    base = load_file(str(next(Path(d["model"]["name"]).glob("*.safetensors"))))
    rd.save_center({k: v.float() * 1.01 for k, v in base.items()}, 1)
    return rd


def stored_center(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """`esbatch center RUN --at T -o FILE` of a GRPO run: its stored center copied out."""
    from esbatch.eval.center import center_at

    rd = _trained(root, request, algorithm="grpo", es=None, es_updates=None, grpo={"updates": 1})
    (root / "out.safetensors").write_bytes(b"old")
    return lambda: center_at(rd.path, 1, root / "out.safetensors")


def thresholded(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """`esbatch threshold RUN --tau T`: s_tau.json and config.yaml beside the thresholded center."""
    from esbatch.analyze.threshold import ensure_thresholded

    rd = _trained(root, request)
    return lambda: ensure_thresholded(rd.path, 0.005)


def threshold_curve(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """Figure 4's table (the CSV beside the PNG) from an eval of a run."""
    from esbatch.analyze.threshold import plot_threshold_curve

    rd = _rundir(root)
    rd.config.write_text(yaml.safe_dump(_toy(request)))
    ev = root / "ev"
    ev.mkdir()
    (ev / "metrics.json").write_text(json.dumps({"tasks": {"toy:DigitTask": {"pass@1": 0.5}}}))
    (ev / "config.yaml").write_text(yaml.safe_dump({"checkpoint": str(rd.path)}))
    (root / "curve.csv").write_text("old\n")
    return lambda: plot_threshold_curve([ev], root / "curve.png")


def _pipeline(root: Path, request: pytest.FixtureRequest, threads: int = 1) -> Any:
    from esbatch.config import config_from_dict

    d = _toy(request, algorithm="pipeline", es_updates=None)
    d["pipeline"] = {"stages": ["es", "grpo"], "updates": 2}
    d["run"] = {**d["run"], "output_dir": str(root), "threads": threads}
    d["tracking"] = {"uri": f"sqlite:///{root / 'mlflow.db'}"}
    return config_from_dict(d)


def pipeline_stage(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """A pipeline writes each stage's config file before it starts the stage (here the fault stops it first)."""
    from esbatch.train import train

    cfg = _pipeline(root, request)
    return lambda: train(cfg, root / "run", progress=False)


def pipeline_resume(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """A resumed pipeline rewrites its config.yaml (what a resume may change) before its stages."""
    import esbatch.pipeline
    from esbatch.train import train

    class Stopped(Exception):
        pass

    def stop(*args: Any) -> None:
        raise Stopped

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(esbatch.pipeline, "_run_stage", stop)
        with pytest.raises(Stopped):
            train(_pipeline(root, request), root / "run", progress=False)
    cfg = _pipeline(root, request, threads=2)
    return lambda: train(cfg, root / "run", resume=True, progress=False)


def _sweep(root: Path, request: pytest.FixtureRequest) -> Any:
    """A sweep folder as `esbatch sweep` plans it, by hand: run r1 stopped before its first update."""
    from esbatch.config import config_from_dict
    from esbatch.launch.evals import RUN_PREFIX
    from esbatch.launch.state import SweepDir
    from esbatch.train import fingerprint

    sd = SweepDir(root / "sweep")
    sd.plan.mkdir(parents=True)
    rd, d = sd.run_dir("r1"), _toy(request)
    rd.path.mkdir(parents=True)
    rd.config.write_text(config_from_dict(d).to_yaml())
    fingerprint.record(rd, config_from_dict(d))
    rd.meta.write_text(json.dumps({"status": "stopped", "algorithm": "es", "done": 0}))
    d["es"]["updates"] = 2  # the plan's budget grew: the task rewrites the run's config.yaml
    sd.plan_path("r1").write_text(config_from_dict(d).to_yaml())
    key = f"{RUN_PREFIX}e1"
    ev = _eval_cfg(root, request).to_dict()
    sd.eval_plan_path(key).write_text(yaml.safe_dump({**ev, "checkpoint": str(rd.path)}))
    evals = [{"key": key, "label": "e1", "source": "r1", "point": {}}]
    sd.meta_path.write_text(
        json.dumps({"name": "s", "tracking": "offline", "runs": [{"key": "r1", "label": "r1"}], "evals": evals})
    )
    return sd, key


def sweep_run_task(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    from esbatch.launch.task import run_task

    sd, _ = _sweep(root, request)
    return lambda: run_task(sd.path, "r1")


def sweep_eval_task(root: Path, request: pytest.FixtureRequest) -> Callable[[], Any]:
    """A sweep's eval of a run records which center it evaluates (source.json) before it evaluates."""
    from esbatch.launch.task import run_task

    sd, key = _sweep(root, request)
    return lambda: run_task(sd.path, key)


@dataclass(frozen=True)
class Case:
    site: tuple[str, str]
    setup: Callable[[Path, pytest.FixtureRequest], Callable[[], Any]]
    points: tuple[str, ...] = POINTS


LIB = ("fsync", "rename", "after-rename")  # a library writes the tmp file: no durable write to fail halfway
CASES = {
    "run.json": Case(("esbatch/train/rundir.py", "RunDir.write_meta"), write_meta),
    "center": Case(("esbatch/train/rundir.py", "RunDir.save_center"), save_center, LIB),
    "center link": Case(("esbatch/train/rundir.py", "RunDir.link_center"), link_center, LIB),
    "fingerprint": Case(("esbatch/train/fingerprint.py", "record"), fingerprint_record),
    "config.yaml": Case(("esbatch/train/lifecycle.py", "RunSession._open"), run_config),
    "config.yaml resume": Case(("esbatch/cli.py", "_train_config"), resume_config),
    "sweep.json": Case(("esbatch/launch/state.py", "SweepDir.locked"), sweep_record),
    "plan": Case(("esbatch/launch/submit.py", "_write_if_changed"), plan_file),
    "parameter count": Case(("esbatch/models.py", "_write_count"), parameter_count),
    "aggregate csv": Case(("esbatch/aggregate/tables.py", "write_csv"), aggregate_csv),
    "aggregate md": Case(("esbatch/aggregate/tables.py", "finish"), aggregate_md),
    "report index": Case(("esbatch/aggregate/report.py", "write_report"), report_index),
    "diversity csv": Case(("esbatch/analyze/diversity.py", "write_csv"), diversity_csv),
    "diversity md": Case(("esbatch/analyze/diversity.py", "write_markdown"), diversity_md),
    "drift csv": Case(("esbatch/analyze/drift.py", "_csv"), drift_csv),
    "drift tables": Case(("esbatch/analyze/drift.py", "write_outputs"), drift_outputs),
    "kappa tables": Case(("esbatch/diagnose/report.py", "write_outputs"), kappa_tables),
    "kappa config": Case(("esbatch/cli.py", "cmd_diagnose_kappa"), kappa_config),
    "eval tables": Case(("esbatch/eval/runner.py", "write_tables"), eval_tables),
    "eval passk": Case(("esbatch/eval/runner.py", "summarize"), eval_summary),
    "eval config": Case(("esbatch/eval/runner.py", "_evaluate"), eval_config),
    "eval mlflow.json": Case(("esbatch/eval/runner.py", "log_to_mlflow"), eval_config),
    "stored center": Case(("esbatch/eval/center.py", "_write_center"), stored_center, LIB),
    "s_tau.json": Case(("esbatch/analyze/threshold.py", "_threshold_run"), thresholded),
    "pipeline stage": Case(("esbatch/pipeline.py", "_run_stage"), pipeline_stage),
    "pipeline resume": Case(("esbatch/pipeline.py", "Pipeline.run"), pipeline_resume),
    "sweep run task": Case(("esbatch/launch/task.py", "run_task"), sweep_run_task),
    "sweep eval task": Case(("esbatch/launch/task.py", "run_eval_task"), sweep_eval_task),
    "threshold curve": Case(("esbatch/analyze/threshold.py", "plot_threshold_curve"), threshold_curve),
}


def _injected(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, Injected):
            return True
        e = e.__cause__ or e.__context__
    return False


@pytest.mark.parametrize(
    ("name", "point"), [(n, p) for n, c in CASES.items() for p in c.points], ids=lambda v: v.replace(" ", "-")
)
def test_a_fault_at_each_writer_leaves_the_old_or_the_new_file_and_no_tmp(tmp_path, monkeypatch, request, name, point):
    case = CASES[name]
    op = case.setup(tmp_path, request)
    faults = Faults(case.site, point)
    faults.install(monkeypatch)
    raised: BaseException | None = None
    try:
        rc = op()
    except BaseException as e:  # noqa: BLE001 - the injected fault, maybe wrapped, is what is expected
        raised, rc = e, None
    assert faults.fired, f"no durable write from {case.site}; the writes were from {faults.sites}"
    assert _injected(raised) or rc not in (None, 0), f"the fault was swallowed: {raised!r}, returned {rc!r}"
    assert faults.target is not None
    want = faults.new if point == "after-rename" else faults.old
    assert _read(faults.target) == want, f"{faults.target}: neither the old file nor the new one"
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------ static checks
@functools.cache
def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(f.relative_to(ROOT)), ast.parse(f.read_text(encoding="utf-8"))) for f in sorted(PKG.rglob("*.py"))]


def _functions(tree: ast.AST, qual: tuple[str, ...] = ()) -> Iterator[tuple[str, ast.AST]]:
    """(qualified name as in co_qualname, node) of the module and every function, each with its own statements."""
    if isinstance(tree, ast.Module):
        yield "<module>", tree
    for ch in ast.iter_child_nodes(tree):
        if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if "__mutmut_" in ch.name and not ch.name.endswith("__mutmut_orig"):
                continue  # under mutation testing: a mutant's copy of a function (`_orig` is the source's)
            yield unmutated(".".join((*qual, ch.name))), ch
            yield from _functions(ch, (*qual, ch.name, "<locals>"))
        elif isinstance(ch, ast.ClassDef):
            yield from _functions(ch, (*qual, ch.name))
        else:
            yield from _functions(ch, qual)


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``fn`` outside its nested functions and classes."""
    for ch in ast.iter_child_nodes(fn):
        if not isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield ch
            yield from _own_nodes(ch)


def durable_sites() -> set[tuple[str, str]]:
    sites = set()
    for path, tree in _modules():
        if path == "esbatch/durable.py":
            continue
        for qual, fn in _functions(tree):
            for n in _own_nodes(fn):
                f = getattr(n, "func", None)
                if (
                    isinstance(f, ast.Attribute)
                    and isinstance(f.value, ast.Name)
                    and f.value.id == "durable"
                    and f.attr != "as_os_error"  # reads an error, writes nothing
                ):
                    sites.add((path, qual))
    return sites


def test_every_durable_write_in_esbatch_has_a_fault_case():
    cases = {c.site for c in CASES.values()}
    sites = durable_sites()
    assert sites - cases == set(), "a new durable writer: add a case to CASES that reaches it"
    assert cases - sites == set(), "a case names a function that writes nothing durably any more"


# What a run folder, a sweep folder, an eval folder or an analysis folder holds: written through esbatch/durable.py
RECORD_FILE = re.compile(r"\.(json|yaml|yml|csv|md|safetensors)$")
RECORD_NAMES = {"config.yaml", "run.json", "source.json", "metrics.json", "config.fingerprint.json", "sweep.json"}
NOT_RUN_STATE = ("esbatch/sandbox/",)  # a sandboxed program's scratch folder and /proc files
IN_PLACE_OK = {  # (module, function): why an in-place write there is not a run-state record
    ("esbatch/train/rundir.py", "RunDir.write_export"): "final_model/'s record, inside the tmp folder swapped in",
}


@functools.cache
def _record_idents() -> frozenset[str]:
    """Names bound to a record's file name (``S_TAU = "s_tau.json"``) or path (``self.config = path / CONFIG``)."""
    names: set[str] = set()
    for _, tree in _modules():
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
                if RECORD_FILE.search(n.value.value) or n.value.value in RECORD_NAMES:
                    names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    for _, tree in _modules():
        for n in ast.walk(tree):
            if isinstance(n, ast.Assign) and _mentions_record(n.value, names, {}):
                for t in n.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return frozenset(names)


def _mentions_record(expr: ast.AST, idents: Any, local: dict[str, list[ast.AST]], depth: int = 0) -> bool:
    for n in ast.walk(expr):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            if n.value in RECORD_NAMES or RECORD_FILE.search(n.value):
                return True
        elif isinstance(n, ast.Attribute) and n.attr in idents:
            return True
        elif isinstance(n, ast.Name):
            if n.id in idents:
                return True
            if depth < 2 and any(_mentions_record(v, idents, local, depth + 1) for v in local.get(n.id, [])):
                return True
    return False


def _mode(call: ast.Call, pos: int) -> str:
    m = call.args[pos] if len(call.args) > pos else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return m.value if isinstance(m, ast.Constant) and isinstance(m.value, str) else "r"


def _written(call: ast.Call) -> ast.AST | None:
    """The path an in-place write call writes: Path.write_text/write_bytes, open(p, "w"), p.open("w"), copyfile."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr in ("write_text", "write_bytes"):
        return f.value
    if isinstance(f, ast.Attribute) and f.attr == "open" and not isinstance(f.value, ast.Name):
        return f.value if set(_mode(call, 0)) & set("wx+") else None
    if isinstance(f, ast.Name) and f.id == "open" and call.args:
        return call.args[0] if set(_mode(call, 1)) & set("wx+") else None
    if isinstance(f, ast.Attribute) and f.attr in ("copyfile", "copy", "copy2") and len(call.args) > 1:
        return call.args[1]
    return None


def in_place_record_writes(
    modules: list[tuple[str, ast.Module]] | None = None, ok: Any = IN_PLACE_OK
) -> list[tuple[str, str, int, str]]:
    """(module, function, line, call) of each write of a run-state record that bypasses esbatch/durable.py."""
    idents = _record_idents()
    found = []
    for path, tree in _modules() if modules is None else modules:
        if path == "esbatch/durable.py" or path.startswith(NOT_RUN_STATE):
            continue
        for qual, fn in _functions(tree):
            nodes = list(_own_nodes(fn))
            local: dict[str, list[ast.AST]] = {}
            for n in nodes:
                if isinstance(n, ast.Assign):
                    for t in n.targets:
                        if isinstance(t, ast.Name):
                            local.setdefault(t.id, []).append(n.value)
            for n in nodes:
                if not isinstance(n, ast.Call) or (target := _written(n)) is None:
                    continue
                if _inside_durable_block(target, nodes):
                    continue
                if _mentions_record(target, idents, local) and (path, qual) not in ok:
                    found.append((path, qual, n.lineno, ast.unparse(n)[:100]))
    return found


def _inside_durable_block(target: ast.AST, nodes: list[ast.AST]) -> bool:
    """``with durable.replacing(p) as tmp: copyfile(src, tmp)``: the write goes to the tmp file."""
    if not isinstance(target, ast.Name):
        return False
    for n in nodes:
        if isinstance(n, ast.With):
            for item in n.items:
                f = getattr(item.context_expr, "func", None)
                v = item.optional_vars
                if isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "durable" and isinstance(v, ast.Name):
                    if v.id == target.id:
                        return True
    return False


def test_no_module_writes_a_run_state_record_in_place():
    assert in_place_record_writes() == [], "write it with esbatch/durable.py (tmp + fsync + rename)"
    allowed = {(m, q) for m, q, _, _ in in_place_record_writes(ok=())}
    assert allowed == set(IN_PLACE_OK), "an IN_PLACE_OK entry that writes nothing any more"


@pytest.mark.parametrize(
    "code",
    [
        'def f(rd):\n    rd.config.write_text("x")\n',
        'def f(folder):\n    (folder / "metrics.json").write_text("{}")\n',
        'def f(out):\n    with open(out / "table.csv", "w", newline="") as fh:\n        fh.write("a")\n',
        'def f(sd):\n    p = sd.path / "sweep.json"\n    p.write_text("{}")\n',
        'def f(a, b):\n    shutil.copyfile(a, b / "config.yaml")\n',
        'def f(out):\n    out.with_suffix(".csv").open("w").write("a")\n',
    ],
)
def test_the_static_check_finds_an_in_place_write(code):
    """The check itself: each snippet, as a new module of the package, is found; written durably, it is not."""
    found = in_place_record_writes([("esbatch/new.py", ast.parse(code))])
    line = next(
        i for i, text in enumerate(code.splitlines(), 1) if "write_text" in text or "open" in text or "copy" in text
    )
    assert [(m, q, n) for m, q, n, _ in found] == [("esbatch/new.py", "f", line)]
    durably = 'def f(rd):\n    with durable.replacing(rd.config) as tmp:\n        shutil.copyfile("a", tmp)\n'
    assert in_place_record_writes([("esbatch/new.py", ast.parse(durably))]) == []
