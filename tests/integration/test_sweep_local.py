"""`esbatch sweep` with the local launcher (the README's main job, on the tiny model): run, Ctrl-C, resume.

The Ctrl-C lands inside update 2 of the first run by construction: its scorer waits at a gate (tests/gate.py)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from gate import Gate, gate_path
from mlflow.tracking import MlflowClient
from toy import gated, toy_config

from esbatch.tasks import TASKS

ROOT = Path(__file__).resolve().parents[2]
UPDATES = 4


def write_sweep(tmp: Path, model_dir: Path, gate: str = "") -> Path:
    base = gated(toy_config(model_dir, es_updates=UPDATES, eval={"every": 3}, checkpoint={"every": 2}), gate, 2)
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = {
        "name": "loc",
        "base": "base.yaml",  # relative to the sweep file
        "output_dir": str(tmp / "out"),
        "grid": {"es.population_size": [2, 4]},
        "launcher": "local",
        "aggregate": [
            {"kind": "scaling", "name": "table", "cols": "es.population_size", "reference": 4},
            {"kind": "curves", "name": "curves", "hue": "es.population_size", "smoothing": 0.5, "band_window": 3},
        ],
    }
    p = tmp / "loc.yaml"
    p.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return p


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "esbatch", *args], env=env(), cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_dry_run_submits_nothing(tmp_path, tiny_model_dir):
    p = run_cli("sweep", str(write_sweep(tmp_path, tiny_model_dir)), "--dry-run")
    assert p.returncode == 0, p.stderr
    assert "sweep loc: 2 runs, launcher local" in p.stdout and "population_size=2" in p.stdout
    assert "would run 2 task(s) here, 1 at a time (nothing run)" in p.stdout
    assert not (tmp_path / "out").exists()


def test_interrupted_local_sweep_resumes_without_duplicates(tmp_path, tiny_model_dir):
    gate = gate_path()
    path = write_sweep(tmp_path, tiny_model_dir, gate)
    sweep_dir = tmp_path / "out" / "loc"
    with Gate(gate) as g:
        proc = subprocess.Popen(
            [sys.executable, "-m", "esbatch", "sweep", str(path)],
            env=env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        g.arrivals(1)  # the first run is inside update 2, updates 0 and 1 logged and checkpointed
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops its task, which marks the run killed
        g.release(stopped=True)  # the task goes on once the launcher has passed the stop on
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    first = json.loads((sweep_dir / "sweep.json").read_text())["runs"][0]["key"]
    assert (sweep_dir / "runs" / first / "log.jsonl").read_text().count("\n") == 3, out  # it finished update 2
    assert "run `esbatch sweep` again" in out
    status = run_cli("status", str(sweep_dir)).stdout
    assert "killed" in status and "pending" in status, status

    p = run_cli("sweep", str(path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "submitting 2 run(s) (1 resume from their folders)" in p.stdout
    assert p.stdout.count("finished") >= 2 and f"{UPDATES}/{UPDATES}" in p.stdout
    assert (sweep_dir / "results" / "table.md").exists() and (sweep_dir / "results" / "curves.png").exists()

    client = MlflowClient(f"sqlite:///{sweep_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("loc")
    runs = client.search_runs([exp.experiment_id])
    kids = [r for r in runs if r.data.tags.get("esbatch.role") != "parent"]
    assert len(runs) == 3 and len(kids) == 2  # one parent, one child per run: the resume reused its run
    for k in kids:
        steps = [m.step for m in client.get_metric_history(k.info.run_id, "reward/mean")]
        assert sorted(steps) == list(range(1, UPDATES + 1))  # each update logged exactly once
        assert k.info.status == "FINISHED"
    # the compare view (issue 43): each run tagged by the sweep's own key, with the grid's value; its problems as
    # MLflow datasets (once, though one run was resumed), digests of the problems it used; the parent the results
    assert sorted(k.data.tags["es.population_size"] for k in kids) == ["2", "4"]
    assert all(k.data.tags["es.population_size"] == k.data.params["es.population_size"] for k in kids)
    cfg = yaml.safe_load((sweep_dir / "runs" / first / "config.yaml").read_text())
    task = cfg["task"]["name"]
    sp = TASKS.get(task)(None, **cfg["task"]["params"])
    sp = sp.splits(cfg["task"]["train_size"], cfg["task"]["heldout_size"], cfg["task"]["few_shot"], cfg["run"]["seed"])
    for k in kids:
        inputs = {d.dataset.name: d for d in client.get_run(k.info.run_id).inputs.dataset_inputs}
        assert set(inputs) == {f"{task}-train", f"{task}-heldout"}
        for split, context in (("train", "training"), ("heldout", "eval")):
            text = json.dumps([[e.question, e.answer] for e in sp[split]], separators=(",", ":"))
            d = inputs[f"{task}-{split}"]
            assert d.dataset.digest == hashlib.sha256(text.encode()).hexdigest()[:16]
            assert json.loads(d.dataset.profile)["num_rows"] == len(sp[split])
            assert {t.key: t.value for t in d.tags}["mlflow.data.context"] == context
    (parent,) = [r for r in runs if r.data.tags.get("esbatch.role") == "parent"]
    arts = {f.path for d in ("results", "sweep") for f in client.list_artifacts(parent.info.run_id, d)}
    assert {"results/table.md", "results/curves.png", "sweep/loc.yaml", "sweep/sweep.json"} <= arts
    # and a third call finds everything done
    p = run_cli("sweep", str(path))
    assert "skipping 2 finished" in p.stdout and "nothing to submit" in p.stdout

    # read-only commands on damaged run folders change no byte of them, and a damaged run.json is named
    one, two = sorted((sweep_dir / "runs").iterdir())
    with open(one / "eval.jsonl", "ab") as f:
        f.write(b'{"t": 9, "heldout/acc')  # a torn tail
    lines = (one / "log.jsonl").read_bytes().splitlines(keepends=True)
    (one / "log.jsonl").write_bytes(lines[0] + b"not json\n" + b"".join(lines[2:]))  # a corrupt middle line
    (two / "run.json").write_text("{")
    before = {p: p.read_bytes() for d in (one, two) for p in sorted(d.rglob("*")) if p.is_file()}
    status = run_cli("status", str(sweep_dir))
    assert status.returncode == 0 and "damaged" in status.stdout, status.stdout + status.stderr
    assert run_cli("aggregate", str(sweep_dir)).returncode == 0
    # one verdict (issue 44): the corrupt log line that status reads as damaged is what plot refuses, by name
    p = run_cli("plot", str(one), "-o", str(tmp_path / "curves.png"))
    assert p.returncode == 2 and "damaged" in p.stderr and "log.jsonl" in p.stderr, p.stdout + p.stderr
    assert run_cli("ls").returncode == 0
    p = run_cli("sweep", str(path))
    assert "damaged, not resubmitted" in p.stdout and f"{two / 'run.json'}: not valid run metadata" in p.stdout
    assert {p: p.read_bytes() for p in before} == before
