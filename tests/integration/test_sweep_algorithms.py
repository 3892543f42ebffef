"""Sweep status is right for every algorithm: sweeps of GRPO runs and of pipelines finish, re-running them
submits nothing (their base config's es.updates differs from their own budget), and a half-done pipeline
resumes its unfinished stage only. Through the local launcher; tests/slurm repeats this on SLURM."""

import signal
from pathlib import Path

import yaml
from gate import Gate
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
    """One GRPO run is enough for what is GRPO's own here (its budget is grpo.updates); several runs of a GRPO sweep
    finishing and not resubmitted: tests/slurm/test_slurm_sweep.py (a 2-run GRPO grid), several runs resuming
    after a raised budget: test_sweep_evals.py. Each GRPO task costs a process and a DeepSpeed start."""
    base(tmp_path, tiny_model_dir, algorithm="grpo")  # es.updates: 50 must not be taken for the budget
    path = sweep_file(tmp_path, "g", grid={"grpo.learning_rate": [0.002]})
    p = run_esbatch("sweep", str(path), timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "1 runs: 1 finished" in p.stdout and p.stdout.count("2/2") == 1, p.stdout
    again = run_esbatch("sweep", str(path))
    assert "skipping 1 finished" in again.stdout and "nothing to submit" in again.stdout, again.stdout
    status = run_esbatch("status", str(tmp_path / "out" / "g")).stdout
    assert "1 runs: 1 finished" in status and status.count("2/2") == 1, status
    raised = run_esbatch("sweep", str(path), "--set", "grpo.updates=3", timeout=900)  # a raised budget continues
    assert "submitting 1 run(s) (1 resume from their folders)" in raised.stdout, raised.stdout
    assert "1 runs: 1 finished" in raised.stdout and raised.stdout.count("3/3") == 1, raised.stdout


def test_a_half_done_pipeline_resumes_its_unfinished_stage(tmp_path, tiny_model_dir):
    """The GRPO stage's scorer waits at the gate inside its update 1 (2 held-out problems, then 2 prompts per
    update), where the Ctrl-C lands: stage 2 ends after that update, 4 of the pipeline's 10 done."""
    with Gate() as g:
        params = {"size": 16, "gate": g.path, "after_examples": 2 + 1 * 2, "argv": "stage2-grpo"}
        base(
            tmp_path,
            tiny_model_dir,
            algorithm="pipeline",
            pipeline={"stages": ["es", "grpo"], "updates": 10, "split": [1, 4]},
            task={"name": "toy:GatedDigitTask", "params": params, "heldout_size": 2, "few_shot": 1},
        )
        path = sweep_file(tmp_path, "p")
        proc = spawn_esbatch("sweep", str(path))
        g.arrivals(1)
        proc.send_signal(signal.SIGINT)
        g.release(stopped=True)  # stage 2 goes on once the stop has been passed down to it
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    (stage2,) = (tmp_path / "out" / "p" / "runs").glob("*/stage2-grpo")
    assert (stage2 / "log.jsonl").read_bytes().count(b"\n") == 2
    stage1_log = (stage2.parent / "stage1-es" / "log.jsonl").read_bytes()
    assert stage1_log.count(b"\n") == 2
    status = run_esbatch("status", str(tmp_path / "out" / "p")).stdout
    done = int(next(w for w in status.split() if w.endswith("/10")).split("/")[0])
    assert "killed" in status and done == 4, status

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
