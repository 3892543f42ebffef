"""One stop policy everywhere: a storm of SIGINT and SIGTERM during a local sweep whose runs share one sqlite
MLflow store leaves no run stuck RUNNING, no locked database, and every run resumable bit for bit."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from toy import ROOT, run_esbatch, spawn_esbatch, toy_config

UPDATES = 4


def write_sweep(tmp: Path, model_dir: Path) -> Path:
    base = toy_config(
        model_dir,
        heldout=2,
        es_updates=UPDATES,
        eval={"every": 2},
        checkpoint={"every": 2},
        run={"seed": 5, "threads": 1},
    )
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


def logged(run_dir: Path) -> int:
    log = run_dir / "log.jsonl"
    return log.read_bytes().count(b"\n") if log.exists() else 0


def test_signal_storm_on_a_local_sweep_loses_nothing(tmp_path, tiny_model_dir):
    path = write_sweep(tmp_path, tiny_model_dir)
    ref = run_esbatch("sweep", str(path), "--name", "calm", timeout=900)  # the undisturbed reference
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]

    proc = spawn_esbatch("sweep", str(path))
    sd = tmp_path / "out" / "storm"
    deadline = time.time() + 300
    while time.time() < deadline:  # every run has logged an update: all three are writing to the store
        runs = sorted((sd / "runs").iterdir()) if (sd / "runs").exists() else []
        if len(runs) == 3 and all(logged(r) >= 1 for r in runs):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before the storm"
    pids = list(json.loads((sd / "sweep.json").read_text())["submissions"][-1]["pids"].values())
    sigs = [signal.SIGINT, signal.SIGTERM]
    for i in range(40):  # 2 s of signals to the launcher and to every task, alternating kinds
        for pid in [proc.pid, *pids]:
            try:
                os.kill(pid, sigs[i % 2])
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "interrupted: run `esbatch sweep` again" in out, out[-3000:]
    assert any(logged(r) < UPDATES for r in (sd / "runs").iterdir()), "the storm came too late to interrupt"

    # the store is not locked: a write transaction goes through at once
    con = sqlite3.connect(sd / "mlflow.db", timeout=0.5)
    con.execute("BEGIN IMMEDIATE")
    con.rollback()
    con.close()
    client = MlflowClient(f"sqlite:///{sd / 'mlflow.db'}")
    kids = [
        r
        for r in client.search_runs([client.get_experiment_by_name("storm").experiment_id])
        if r.data.tags.get("esbatch.role") != "parent"
    ]
    assert kids and all(r.info.status in ("KILLED", "FINISHED") for r in kids), [r.info.status for r in kids]
    for rd in (sd / "runs").iterdir():
        assert json.loads((rd / "run.json").read_text())["status"] in ("killed", "finished")

    again = run_esbatch("sweep", str(path), timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "3 runs: 3 finished" in again.stdout
    for rd in (sd / "runs").iterdir():
        calm = tmp_path / "out" / "calm" / "runs" / rd.name
        a, b = load_file(calm / "center.safetensors"), load_file(rd / "center.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rd.name
    kids = [
        r
        for r in client.search_runs([client.get_experiment_by_name("storm").experiment_id])
        if r.data.tags.get("esbatch.role") != "parent"
    ]
    assert len(kids) == 3
    for r in kids:
        assert r.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "reward/mean")]
        assert sorted(steps) == list(range(1, UPDATES + 1))


def test_sigterm_stops_an_eval_between_chunks_and_the_same_command_continues(tmp_path, tiny_model_dir):
    cfg = {
        "name": "e",
        "output_dir": str(tmp_path / "evals"),
        "model": {"name": str(tiny_model_dir), "dtype": "float32"},
        "sampling": {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "batch_size": 2},
        "ks": [1, 2],
        "tasks": [{"name": "toy:DigitTask", "params": {"size": 64}, "limit": 48}],
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "esbatch", "eval", str(path), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples = tmp_path / "evals" / "e" / "samples" / "toy:DigitTask.jsonl"
    while proc.poll() is None and not (samples.exists() and samples.read_bytes().count(b"\n") >= 4):
        time.sleep(0.05)
    for _ in range(5):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    done = samples.read_bytes().count(b"\n")
    assert 4 <= done < 48
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [json.loads(x) for x in samples.read_text().splitlines()]
    assert sorted(r["i"] for r in rows) == list(range(48))  # every problem once: nothing lost, nothing twice


def test_cancel_stops_a_local_sweep_from_another_shell(tmp_path, tiny_model_dir):
    path = write_sweep(tmp_path, tiny_model_dir)
    spec = yaml.safe_load(path.read_text())
    spec["launcher_overrides"] = {"array_parallelism": 1}
    path.write_text(yaml.safe_dump(spec))
    base = yaml.safe_load((tmp_path / "base.yaml").read_text())
    base["es"]["updates"] = 400  # long enough that the cancel lands while the first run trains, also under load
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "esbatch", "sweep", str(path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sd = tmp_path / "out" / "storm"
    while proc.poll() is None and not any(logged(r) >= 1 for r in (sd / "runs").glob("*")):
        time.sleep(0.05)
    p = run_esbatch("cancel", str(path))
    assert p.returncode == 0 and "cancelled 1 queued or running run(s)" in p.stdout, p.stdout + p.stderr
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-2000:]
    status = run_esbatch("status", str(sd)).stdout
    assert "1 killed, 2 pending" in status, status
