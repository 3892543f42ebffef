"""Sweep status is right for every algorithm: sweeps of GRPO runs and of pipelines finish, re-running them
submits nothing (their base config's es.updates differs from their own budget), and a half-done pipeline
resumes its unfinished stage only. Through the local launcher; tests/slurm repeats this on SLURM."""

import signal
import time
from pathlib import Path

import yaml
from toy import run_esbatch, spawn_esbatch, toy_config


def base(tmp: Path, model_dir: Path, **extra) -> Path:
    cfg = toy_config(
        model_dir,
        heldout=2,
        gen_batch=16,
        es_updates=50,
        grpo={"group_size": 4, "batch_size": 2, "learning_rate": 1e-3, "updates": 2},
        eval={"every": 0},
        checkpoint={"every": 1},
        **extra,
    )
    p = tmp / "base.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def sweep_file(tmp: Path, name: str, **fields) -> Path:
    sweep = {"name": name, "base": "base.yaml", "output_dir": str(tmp / "out"), "launcher": "local", **fields}
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(sweep))
    return p


def test_a_grpo_sweep_finishes_and_is_not_resubmitted(tmp_path, tiny_model_dir):
    base(tmp_path, tiny_model_dir, algorithm="grpo")  # es.updates: 50 must not be taken for the budget
    path = sweep_file(tmp_path, "g", grid={"grpo.learning_rate": [0.001, 0.002]})
    p = run_esbatch("sweep", str(path), timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "2 runs: 2 finished" in p.stdout and p.stdout.count("2/2") == 2, p.stdout
    again = run_esbatch("sweep", str(path))
    assert "skipping 2 finished" in again.stdout and "nothing to submit" in again.stdout, again.stdout
    status = run_esbatch("status", str(tmp_path / "out" / "g")).stdout
    assert "2 runs: 2 finished" in status and status.count("2/2") == 2, status
    raised = run_esbatch("sweep", str(path), "--set", "grpo.updates=3", timeout=900)  # a raised budget continues
    assert "submitting 2 run(s) (2 resume from their folders)" in raised.stdout, raised.stdout
    assert "2 runs: 2 finished" in raised.stdout and raised.stdout.count("3/3") == 2, raised.stdout


def test_a_half_done_pipeline_resumes_its_unfinished_stage(tmp_path, tiny_model_dir):
    base(
        tmp_path,
        tiny_model_dir,
        algorithm="pipeline",
        pipeline={"stages": ["es", "grpo"], "updates": 10, "split": [1, 4]},
    )
    path = sweep_file(tmp_path, "p")
    proc = spawn_esbatch("sweep", str(path))
    runs = tmp_path / "out" / "p" / "runs"
    deadline = time.time() + 600
    stage2 = None
    while time.time() < deadline and proc.poll() is None:
        found = list(runs.glob("*/stage2-grpo/log.jsonl")) if runs.exists() else []
        if found and found[0].read_bytes().count(b"\n") >= 1:
            stage2 = found[0].parent
            break
        time.sleep(0.1)
    assert stage2 is not None, "stage 2 never started"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    stage1_log = (stage2.parent / "stage1-es" / "log.jsonl").read_bytes()
    assert stage1_log.count(b"\n") == 2
    status = run_esbatch("status", str(tmp_path / "out" / "p")).stdout
    done = int(next(w for w in status.split() if w.endswith("/10")).split("/")[0])
    assert "killed" in status and 3 <= done < 10, status

    p = run_esbatch("sweep", str(path), timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "submitting 1 run(s) (1 resume from their folders)" in p.stdout and "1 runs: 1 finished" in p.stdout
    assert "10/10" in p.stdout
    assert (stage2.parent / "stage1-es" / "log.jsonl").read_bytes() == stage1_log  # stage 1 was not redone
    assert (stage2 / "log.jsonl").read_bytes().count(b"\n") == 8
    task_log = (stage2.parent / "task.log").read_text()
    second = task_log[task_log.rindex("resume=True") :]
    assert "pipeline stage stage2-grpo" in second and "pipeline stage stage1-es" not in second
    assert (stage2.parent / "center.safetensors").exists()  # the pipeline's own center: the last stage's
    again = run_esbatch("sweep", str(path))
    assert "skipping 1 finished" in again.stdout and "nothing to submit" in again.stdout, again.stdout
