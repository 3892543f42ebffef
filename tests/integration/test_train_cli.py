"""`esbatch train` end to end on a tiny random model: MLflow contents, and resume after SIGKILL is bit-exact.

Kills and signals land inside a chosen update by construction: the run's scorer waits at a gate (tests/gate.py)
on the first scoring call of that update until the test has acted."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from gate import Gate
from safetensors.torch import load_file
from toy import gated, toy_config

ROOT = Path(__file__).resolve().parents[2]
UPDATES = 6


def write_config(tmp: Path, model_dir: Path, name: str, gate: str = "", at_update: int = 0, rank: int = 0) -> Path:
    """The run every test trains; with ``gate``, its scorer on ``rank`` waits there inside update ``at_update``."""
    cfg = toy_config(
        model_dir,
        es_updates=UPDATES,
        run={"name": name, "seed": 3, "output_dir": str(tmp / "runs"), "threads": 1},
        eval={"every": 3},
        checkpoint={"every": 2},
        tracking={"experiment": "tests"},
    )
    if gate:
        cfg = gated(cfg, gate, at_update, rank)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def esbatch(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "esbatch", *args, "--no-progress"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def finish(p: subprocess.Popen) -> str:
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    return out


def center(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "center.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """One uninterrupted run."""
    tmp = tmp_path_factory.mktemp("ref")
    out = finish(esbatch("train", str(write_config(tmp, tiny_model_dir, "ref"))))
    return tmp, tmp / "runs" / "ref", out


def test_run_reports_and_logs_to_mlflow(reference):
    from mlflow.tracking import MlflowClient
    from toy import run_page_sections

    tmp, run_dir, out = reference
    assert "MLflow run" in out and "mlflow ui --backend-store-uri sqlite:///" in out
    client = MlflowClient(f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["es.population_size"] == "4" and run.data.params["task.name"] == "toy:DigitTask"
    assert {"git_commit", "host", "esbatch_version"} <= set(run.data.tags)
    for key in (
        "reward/mean",
        "reward/std",
        "reward/min",
        "reward/max",
        "update/l2",
        "update/changed_fraction",
        "update/rel_distance_from_theta0",
        "time/generation_s",
        "time/perturb_restore_s",
        "time/update_s",
        "update/flops",
    ):
        hist = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in hist) == list(range(1, UPDATES + 1)), key
    acc = client.get_metric_history(run.info.run_id, "heldout/accuracy")
    assert sorted(m.step for m in acc) == [0, 3, 6]
    # the run's MLflow page starts with held-out accuracy and reward
    sections = run_page_sections(run.data.metrics)
    assert sections[:2] == ["heldout", "reward"], sections
    assert "system/peak_rss_mb" in run.data.metrics
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "log.jsonl", "eval.jsonl"} <= arts
    # the run really trained: rewards varied and the center moved
    rel = client.get_metric_history(run.info.run_id, "update/rel_distance_from_theta0")
    assert max(m.value for m in rel) > 0


def test_plot_of_run_directories(reference, tmp_path):
    from esbatch.cli import main

    _, run_dir, _ = reference
    out = tmp_path / "curves.png"
    assert main(["plot", str(run_dir), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["plot", str(tmp_path), "-o", str(out)]) == 2


def test_rerun_without_resume_refuses_to_clobber(reference, tiny_model_dir):
    tmp, run_dir, _ = reference
    p = esbatch("train", str(tmp / "ref.yaml"))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 2 and "--resume" in out


def killed_inside(p: subprocess.Popen, g: Gate, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` once the run waits at the gate, then let it go on (a SIGKILLed one is gone)."""
    g.arrivals(1)
    p.send_signal(sig)
    g.release(stopped=sig != signal.SIGKILL)


@pytest.mark.parametrize("kill_after", [0, 1, 3])
def test_sigkill_then_resume_gives_bit_identical_center(reference, tmp_path, tiny_model_dir, kill_after):
    _, ref_dir, _ = reference
    name = "victim"
    with Gate() as g:
        p = esbatch("train", str(write_config(tmp_path, tiny_model_dir, name, g.path, kill_after)))
        killed_inside(p, g)
        p.wait()
    run_dir = tmp_path / "runs" / name
    log = run_dir / "log.jsonl"
    assert (run_dir / "run.json").exists() and p.returncode == -signal.SIGKILL
    assert (log.read_text().count("\n") if log.exists() else 0) == kill_after  # killed inside update kill_after
    finish(esbatch("train", "--resume", str(run_dir)))
    ref, got = center(ref_dir), center(run_dir)
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert (ref_dir / "log.jsonl").read_text() != ""
    # the logged rewards and weights are identical too
    strip = lambda text: [yaml.safe_load(x)["update_weights"] for x in text.splitlines()]  # noqa: E731
    assert strip(log.read_text()) == strip((ref_dir / "log.jsonl").read_text())


def test_resumed_run_is_one_mlflow_run_with_each_step_once(tmp_path, tiny_model_dir):
    from mlflow.tracking import MlflowClient

    with Gate() as g:
        p = esbatch("train", str(write_config(tmp_path, tiny_model_dir, "once", g.path, 2)))
        killed_inside(p, g)
        p.wait()
    assert (tmp_path / "runs" / "once" / "log.jsonl").read_text().count("\n") == 2
    finish(esbatch("train", "--resume", str(tmp_path / "runs" / "once")))
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")]
    assert sorted(steps) == list(range(1, UPDATES + 1))
    assert run.info.status == "FINISHED"


def test_sigterm_marks_the_run_killed_and_resume_may_extend_the_budget(tmp_path, tiny_model_dir):
    from mlflow.tracking import MlflowClient

    with Gate() as g:
        p = esbatch("train", str(write_config(tmp_path, tiny_model_dir, "term", g.path, 1)))
        killed_inside(p, g, signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
    run_dir = tmp_path / "runs" / "term"
    log = run_dir / "log.jsonl"
    assert p.returncode == 130 and f"esbatch train --resume {run_dir}" in out
    assert log.read_text().count("\n") == 2  # the update it was in finished, then it stopped
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "KILLED"
    bad = esbatch("train", "--resume", str(run_dir), "--set", "es.sigma=0.5")
    out, _ = bad.communicate(timeout=120)
    assert bad.returncode == 2 and "es.sigma=0.5: cannot change this on resume" in out
    finish(esbatch("train", "--resume", str(run_dir), "--set", f"es.updates={UPDATES + 1}"))
    assert log.read_text().count("\n") == UPDATES + 1
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FINISHED"


def test_resume_after_the_last_update_restores_the_final_checkpoint_and_eval(reference, tmp_path):
    """Killed after the last update was logged but before its checkpoint and final evaluation."""
    import shutil

    tmp, ref_dir, _ = reference
    shutil.copytree(tmp / "runs", tmp_path / "runs")
    run_dir = tmp_path / "runs" / "ref"
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["run"]["output_dir"] = str(tmp_path / "runs")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run_dir / "center.safetensors").unlink()
    evals = (run_dir / "eval.jsonl").read_text().splitlines()
    (run_dir / "eval.jsonl").write_text("\n".join(evals[:-1]) + "\n")
    finish(esbatch("train", "--resume", str(run_dir)))
    ref, got = center(ref_dir), center(run_dir)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert (run_dir / "eval.jsonl").read_text().splitlines()[-1] == evals[-1]


def test_a_broken_verifier_stops_the_run_with_one_clear_error(tmp_path, tiny_model_dir):
    """Every response with a digit raises in the scorer: the first update stops past reward.max_score_errors with
    exit 1, one error naming the task and no traceback; run.json and MLflow say failed, no update is logged."""
    from mlflow.tracking import MlflowClient

    cfg = yaml.safe_load(write_config(tmp_path, tiny_model_dir, "broken").read_text())
    cfg["task"]["name"] = "toy:RaisingDigitTask"
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(cfg))
    p = esbatch("train", str(tmp_path / "broken.yaml"))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 1, out
    assert "error: task toy:RaisingDigitTask: its verifier raised on" in out and "Traceback" not in out, out
    assert "ValueError: cannot read" in out
    rd = tmp_path / "runs" / "broken"
    meta = json.loads((rd / "run.json").read_text())
    assert meta["status"] == "failed" and not (rd / "log.jsonl").exists()
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    assert client.get_run(meta["mlflow_run_id"]).info.status == "FAILED"
