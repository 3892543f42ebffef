"""ES over 2 processes (torchrun, gloo on CPU): the population is split, only rewards travel, and the
final center equals the single-process run's bit for bit. A rank that dies fails the run loudly and
the run resumes to the same center."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from gate import Gate
from test_train_cli import center, esbatch, finish, write_config  # noqa: F401 - shared CLI helpers

from esbatch.tracking import MLflowTracker

UPDATES = 6


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("single")
    finish(esbatch("train", str(write_config(tmp, tiny_model_dir, "one"))))
    return tmp / "runs" / "one"


def _weights(run_dir: Path) -> list:
    return [yaml.safe_load(x)["update_weights"] for x in (run_dir / "log.jsonl").read_text().splitlines()]


def test_two_ranks_give_the_single_process_center_bit_for_bit(single, tmp_path, tiny_model_dir):
    out = finish(esbatch("train", str(write_config(tmp_path, tiny_model_dir, "two")), "--set", "run.nproc_per_node=2"))
    assert "starting 2 ranks" in out
    run_dir = tmp_path / "runs" / "two"
    ref, got = center(single), center(run_dir)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert _weights(run_dir) == _weights(single)
    assert any(w != 0 for ws in _weights(run_dir) for w in ws)  # the rewards varied: the updates were real
    # one MLflow run (rank 0's), tagged with the world size, each step once
    meta = yaml.safe_load((run_dir / "run.json").read_text())
    tracker = MLflowTracker(meta["tracking_uri"], "tests")
    run = tracker.client.get_run(meta["mlflow_run_id"])
    assert run.data.tags["world_size"] == "2" and run.info.status == "FINISHED"
    steps = [m.step for m in tracker.client.get_metric_history(run.info.run_id, "reward/mean")]
    assert steps == list(range(1, UPDATES + 1))


def test_two_ranks_taking_members_from_the_store_give_the_single_process_center_bit_for_bit(
    single, tmp_path, tiny_model_dir
):
    """es.dispatch: dynamic: the ranks take members from a counter in torchrun's store; which rank evaluated
    which member then varies, the rewards and the center do not."""
    cfg = str(write_config(tmp_path, tiny_model_dir, "dyn"))
    finish(esbatch("train", cfg, "--set", "run.nproc_per_node=2", "--set", "es.dispatch=dynamic"))
    run_dir = tmp_path / "runs" / "dyn"
    ref, got = center(single), center(run_dir)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert _weights(run_dir) == _weights(single)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["es"]["dispatch"] == "dynamic"


def test_a_dead_rank_fails_the_run_loudly_and_it_resumes_bit_exact(single, tmp_path, tiny_model_dir):
    """Rank 1 waits at the gate inside update 2 (its pid is its tag) and is killed there; rank 0 is then waiting
    for it in the update's reward exchange."""
    with Gate() as g:
        cfg = write_config(tmp_path, tiny_model_dir, "victim", g.path, 2, rank=1)
        p = esbatch("train", str(cfg), "--set", "run.nproc_per_node=2")
        (victim,) = g.arrivals(1)
        os.kill(int(victim), signal.SIGKILL)
    run_dir = tmp_path / "runs" / "victim"
    log = run_dir / "log.jsonl"
    out, _ = p.communicate(timeout=300)
    assert p.returncode != 0, out
    assert "a rank failed" in out
    assert log.read_text().count("\n") == 2  # updates 0 and 1; update 2 never finished
    status = yaml.safe_load((run_dir / "run.json").read_text())["status"]
    assert status in ("failed", "killed")
    finish(esbatch("train", "--resume", str(run_dir)))  # config.yaml keeps nproc_per_node: 2
    ref, got = center(single), center(run_dir)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert _weights(run_dir) == _weights(single)
