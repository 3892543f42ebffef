"""One stop policy everywhere: a storm of SIGINT and SIGTERM during a local sweep whose runs share one sqlite
MLflow store leaves no run stuck RUNNING, no locked database, and every run resumable bit for bit.

Every stop lands mid-update by construction: the runs' scorer waits at a gate (tests/gate.py) inside update 1
until the test has signalled, and the storm goes on while the released runs write to the store and exit."""

import json
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from gate import Gate, gate_path
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from stress import stress
from toy import gated, logged, run_esbatch, spawn_esbatch, toy_config

UPDATES = 4


def write_sweep(tmp: Path, model_dir: Path, gate: str) -> Path:
    """Runs that wait at ``gate`` on their first scoring call of update 1 (one logged update, so all are writing
    to the store)."""
    base = toy_config(
        model_dir,
        heldout=2,
        es_updates=UPDATES,
        eval={"every": 2},
        checkpoint={"every": 2},
        run={"seed": 5, "threads": 1},
    )
    base = gated(base, gate, 1)
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = {
        "name": "storm",
        "base": "base.yaml",
        "output_dir": str(tmp / "out"),
        "grid": {"es.population_size": [2, 4, 6]},
        "launcher": "local",
        "launcher_overrides": {"array_parallelism": 3, "cpus_per_task": 1},
    }
    path = tmp / "storm.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


def storm(pids: list[int], rounds: int) -> None:
    """``rounds`` of SIGINT / SIGTERM (alternating) to every process still there."""
    sigs = [signal.SIGINT, signal.SIGTERM]
    for i in range(rounds):
        for pid in pids:
            try:
                os.kill(pid, sigs[i % 2])
            except ProcessLookupError:
                pass


@pytest.mark.stress
def test_signal_storm_on_a_local_sweep_loses_nothing(tmp_path, tiny_model_dir):
    gate = gate_path()
    path = write_sweep(tmp_path, tiny_model_dir, gate)
    ref = run_esbatch("sweep", str(path), "--name", "calm", timeout=900)  # the undisturbed reference (no gate yet)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]

    for rep in range(stress()):  # the stress tier repeats the storm on new sweep folders, one calm reference
        storm_once(tmp_path, path, gate, "storm" if rep == 0 else f"storm-{rep}")


def storm_once(tmp_path: Path, path: Path, gate: str, name: str) -> None:
    """One storm on the sweep ``path`` under the name ``name``, checked against the calm reference."""
    sd = tmp_path / "out" / name
    os.makedirs(os.path.dirname(gate), exist_ok=True)  # a closed gate removes its folder: open it again
    with Gate(gate) as g:
        proc = spawn_esbatch("sweep", str(path), "--name", name)
        g.arrivals(3)  # every run is inside update 1, its update 0 logged and in the store
        pids = [proc.pid, *json.loads((sd / "sweep.json").read_text())["submissions"][-1]["pids"].values()]
        storm(pids, 20)
        g.release(stopped=True)
        while proc.poll() is None:  # signals go on while the runs finish update 1, write the store and exit
            storm(pids, 2)
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "interrupted: run `esbatch sweep` again" in out, out[-3000:]
    assert [logged(r) for r in (sd / "runs").iterdir()] == [2, 2, 2]  # each stopped after the update it was in

    # the store is not locked: a write transaction goes through at once
    con = sqlite3.connect(sd / "mlflow.db", timeout=0.5)
    con.execute("BEGIN IMMEDIATE")
    con.rollback()
    con.close()
    client = MlflowClient(f"sqlite:///{sd / 'mlflow.db'}")
    kids = [
        r
        for r in client.search_runs([client.get_experiment_by_name(name).experiment_id])
        if r.data.tags.get("esbatch.role") != "parent"
    ]
    assert kids and all(r.info.status in ("KILLED", "FINISHED") for r in kids), [r.info.status for r in kids]
    for rd in (sd / "runs").iterdir():
        assert json.loads((rd / "run.json").read_text())["status"] in ("killed", "finished")

    again = run_esbatch("sweep", str(path), "--name", name, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "3 runs: 3 finished" in again.stdout
    for rd in (sd / "runs").iterdir():
        calm = tmp_path / "out" / "calm" / "runs" / rd.name
        a, b = load_file(calm / "center.safetensors"), load_file(rd / "center.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rd.name
    kids = [
        r
        for r in client.search_runs([client.get_experiment_by_name(name).experiment_id])
        if r.data.tags.get("esbatch.role") != "parent"
    ]
    assert len(kids) == 3
    for r in kids:
        assert r.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "reward/mean")]
        assert sorted(steps) == list(range(1, UPDATES + 1))


def test_sigterm_stops_an_eval_between_chunks_and_the_same_command_continues(tmp_path, tiny_model_dir):
    """Chunks of 4 problems: the scorer waits at the gate on its first response to chunk 2, the signals land
    there, chunk 2 is finished and written, and the eval stops before chunk 3."""
    gate = gate_path()
    params = {"size": 64, "gate": gate, "after_examples": 4}
    cfg = {
        "name": "e",
        "output_dir": str(tmp_path / "evals"),
        "model": {"name": str(tiny_model_dir), "dtype": "float32"},
        "sampling": {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "batch_size": 2},
        "ks": [1, 2],
        "tasks": [{"name": "toy:GatedDigitTask", "label": "digits", "params": params, "limit": 48}],
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    samples = tmp_path / "evals" / "e" / "samples" / "digits.jsonl"
    with Gate(gate) as g:
        proc = spawn_esbatch("eval", str(path), "--no-progress")
        g.arrivals(1)
        for _ in range(5):
            proc.send_signal(signal.SIGTERM)
        g.release(stopped=True)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-2000:]
    assert samples.read_bytes().count(b"\n") == 8  # chunks 1 and 2, whole
    p = run_esbatch("eval", str(path), "--no-progress")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [json.loads(x) for x in samples.read_text().splitlines()]
    assert sorted(r["i"] for r in rows) == list(range(48))  # every problem once: nothing lost, nothing twice


def test_cancel_stops_a_local_sweep_from_another_shell(tmp_path, tiny_model_dir):
    """One run at a time: the first waits at the gate inside update 1 while `esbatch cancel` runs in another
    process; it stops after that update and the two runs never started stay pending."""
    gate = gate_path()
    path = write_sweep(tmp_path, tiny_model_dir, gate)
    spec = yaml.safe_load(path.read_text())
    spec["launcher_overrides"] = {"array_parallelism": 1}
    path.write_text(yaml.safe_dump(spec))
    sd = tmp_path / "out" / "storm"
    with Gate(gate) as g:
        proc = spawn_esbatch("sweep", str(path))
        g.arrivals(1)
        p = run_esbatch("cancel", str(path))
        assert p.returncode == 0 and "cancelled 1 queued or running run(s)" in p.stdout, p.stdout + p.stderr
        g.release(stopped=True)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-2000:]
    status = run_esbatch("status", str(sd)).stdout
    assert "1 killed, 2 pending" in status, status
    assert sorted(logged(r) for r in (sd / "runs").iterdir()) == [2]  # update 0, and update 1 it was in
