"""Two writers of one folder, from the command line: the second exits 2 naming the first and changes nothing;
once the first has ended, the same command proceeds. Each scenario runs once, ESBATCH_STRESS=N times in the
stress tier (tests/stress.py; it ran 10 times in every run before issue 40).

"B while A writes" is true by construction: A is a real `esbatch train --resume` (or `esbatch sweep`) whose
scorer waits at a gate (tests/gate.py) inside its update, holding the writer lock, until the test releases it.
Rep i's second writer is rep i+1's first one (one more update each time), so every refused command is shown to
proceed once the folder is free."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest
import yaml
from gate import Gate, gate_path
from stress import stress
from toy import run_esbatch, spawn_esbatch, toy_config

REPS = stress()
pytestmark = pytest.mark.stress


def gated_toy(model_dir: Path, gate: str, out: Path, **kw) -> dict:
    """A toy config whose scorer waits at ``gate`` at the first problem it scores in a process."""
    cfg = toy_config(model_dir, es_updates=1, eval={"every": 0}, **kw)
    # idle_tracking: the run's writer thread has sent what the run logged at its start (its dataset inputs) before
    # the run waits at the gate, so the files and store compared meanwhile change only if the refused command writes
    params = {"size": 16, "gate": gate, "idle_tracking": True}
    cfg["task"] = {**cfg["task"], "name": "toy:GatedDigitTask", "params": params}
    cfg["tracking"] = {"uri": f"sqlite:///{out / 'mlflow.db'}"}
    return cfg


def files(*folders: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() for d in folders for p in sorted(d.rglob("*")) if p.is_file()
    }


def refused(p, holder: int) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr  # one line, nothing else printed
    assert f"is being written by process {holder} on host {socket.gethostname()} (since " in lines[0]
    assert "Wait for that process to end or stop it (kill " in lines[0] and "nothing was changed" in lines[0]


def start_gated(g: Gate, *args: str):
    a = spawn_esbatch(*args)
    (tag,) = g.arrivals(1)  # A is inside its update, holding the lock
    assert int(tag) == a.pid
    return a


def finish(g: Gate, a) -> None:
    g.release()
    out, _ = a.communicate(timeout=600)
    assert a.returncode == 0, out


def reopen(path: str) -> Gate:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return Gate(path)


def trained_run(tmp: Path, model_dir: Path) -> tuple[Path, str, Path]:
    gate = gate_path()
    out = tmp / "out"
    cfg = gated_toy(model_dir, gate, out, run={"name": "r", "seed": 3, "threads": 1, "output_dir": str(out)})
    (tmp / "r.yaml").write_text(yaml.safe_dump(cfg))
    p = run_esbatch("train", str(tmp / "r.yaml"), "--no-progress")  # no gate open yet: passes at once
    assert p.returncode == 0, p.stdout + p.stderr
    return out / "r", gate, out


def test_a_second_resume_of_a_run_folder_is_refused(tmp_path, tiny_model_dir):
    run, gate, out = trained_run(tmp_path, tiny_model_dir)
    for i in range(REPS):
        with reopen(gate) as g:
            a = start_gated(g, "train", "--resume", str(run), "--set", f"es.updates={i + 2}", "--no-progress")
            before = files(run)
            db = (out / "mlflow.db").read_bytes()
            b = run_esbatch("train", "--resume", str(run), "--set", f"es.updates={i + 3}", "--no-progress")
            refused(b, a.pid)
            assert files(run) == before and (out / "mlflow.db").read_bytes() == db, f"rep {i}"
            finish(g, a)
    p = run_esbatch("train", "--resume", str(run), "--set", f"es.updates={REPS + 2}", "--no-progress")
    assert p.returncode == 0, p.stdout + p.stderr  # the last refused command, now alone: it proceeds
    assert (run / "log.jsonl").read_text().count("\n") == REPS + 2  # every update logged once


def test_center_is_refused_while_a_training_writes_the_run(tmp_path, tiny_model_dir):
    run, gate, out = trained_run(tmp_path, tiny_model_dir)
    for i in range(REPS):
        with reopen(gate) as g:
            a = start_gated(g, "train", "--resume", str(run), "--set", f"es.updates={i + 2}", "--no-progress")
            before = files(run)
            b = run_esbatch("center", str(run), "--at", "1")
            refused(b, a.pid)
            assert files(run) == before, f"rep {i}"
            finish(g, a)
        p = run_esbatch("center", str(run), "--at", "1")  # the training has ended: it proceeds
        assert p.returncode == 0, p.stdout + p.stderr
        assert (run / "snapshots" / "center-1.safetensors").exists()


def test_a_second_sweep_of_a_sweep_folder_is_refused(tmp_path, tiny_model_dir):
    gate = gate_path()
    out = tmp_path / "out"
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(gated_toy(tiny_model_dir, gate, out)))
    sweep = {"name": "two", "base": "base.yaml", "output_dir": str(out), "grid": {"es.sigma": [0.05]}}
    sweep["launcher"] = "local"
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    sd = out / "two"
    for i in range(REPS):
        with reopen(gate) as g:
            sweep_args = ("sweep", str(path), "--set", f"es.updates={i + 1}")
            a = spawn_esbatch(*sweep_args)
            g.arrivals(1)  # its one run is inside its update; the sweep driver holds the sweep lock meanwhile
            before = files(sd / "plan", sd / "runs") | {"sweep.json": (sd / "sweep.json").read_text()}
            b = run_esbatch("sweep", str(path), "--set", f"es.updates={i + 2}")
            refused(b, a.pid)
            after = files(sd / "plan", sd / "runs") | {"sweep.json": (sd / "sweep.json").read_text()}
            assert after == before, f"rep {i}"
            finish(g, a)
    p = run_esbatch("sweep", str(path), "--set", f"es.updates={REPS + 1}")
    assert p.returncode == 0, p.stdout + p.stderr
    (key,) = [d for d in (sd / "runs").iterdir()]
    assert (key / "log.jsonl").read_text().count("\n") == REPS + 1  # each update trained once
