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

# The single-process run (`single`) is a module fixture, built once per xdist worker: one group, so one worker
# runs this module and builds it once (spread over the workers, each of them built it).
pytestmark = pytest.mark.xdist_group("es_distributed")

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


# ----------------------------------------------------------------------------- es.restore: inplace over 2 ranks

INPLACE = ("--set", "run.nproc_per_node=2", "--set", "es.restore=inplace", "--set", "model.dtype=bfloat16")


def _records(run_dir: Path) -> list[dict]:
    return [yaml.safe_load(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]


def _replayed(run_dir: Path, replica: int) -> dict[str, torch.Tensor]:
    """Replica ``replica``'s weights rebuilt in this process: theta_0 plus its logged cycles and every update."""
    from esbatch.backends import BACKENDS
    from esbatch.config import config_from_dict
    from esbatch.es.config import backend_setup
    from esbatch.es.replay import replay

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    cfg.tracking.drift = False
    backend = BACKENDS.get("hf").for_es(backend_setup(cfg))
    replay(backend, _records(run_dir), first_replica=replica)
    return backend.center_state_dict()


def test_inplace_ranks_keep_their_own_round_off_logged_so_that_replay_rebuilds_each(tmp_path, tiny_model_dir):
    """Each rank perturbs and restores its own members in bf16 (es.dispatch: dynamic, so who took which member
    comes from the counter): the ranks' weights drift apart, every record lists each rank's members in order, and
    replaying those lists rebuilds both ranks' weights: rank 0's equal center.safetensors bit for bit, and the two
    together give exactly the divergence the run logged after its last update."""
    from esbatch.perturb.inplace import coordinate_sample, divergence

    cfg = str(write_config(tmp_path, tiny_model_dir, "inplace"))
    finish(esbatch("train", cfg, *INPLACE, "--set", "es.dispatch=dynamic"))
    run_dir = tmp_path / "runs" / "inplace"
    records = _records(run_dir)
    assert len(records) == UPDATES
    for r in records:
        assert len(r["replicas"]) == 2 and sorted(r["replicas"][0] + r["replicas"][1]) == list(range(4))
    last = records[-1]["metrics"]
    assert last["replicas/count"] == 2 and last["replicas/differing_fraction"] > 0  # they did drift apart
    rank0, rank1 = _replayed(run_dir, 0), _replayed(run_dir, 1)
    saved = center(run_dir)
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    assert all(torch.equal(saved[k], rank0[k]) for k in saved)
    assert any(not torch.equal(rank0[k], rank1[k]) for k in rank0)
    measured = divergence([coordinate_sample(rank0), coordinate_sample(rank1)])
    assert {k: last[k] for k in measured} == measured


def test_inplace_ranks_resume_bit_exact(tmp_path, tiny_model_dir):
    """Stopped after 3 of 6 updates and resumed to 6: every rank replays its own cycles from theta_0, so the run
    ends where an uninterrupted one does: the same center (rank 0's), records, and divergence between the ranks."""
    straight = str(write_config(tmp_path, tiny_model_dir, "straight"))
    finish(esbatch("train", straight, *INPLACE))
    cut = str(write_config(tmp_path, tiny_model_dir, "cut"))
    finish(esbatch("train", cut, *INPLACE, "--set", "es.updates=3"))
    run_dir = tmp_path / "runs" / "cut"
    finish(esbatch("train", "--resume", str(run_dir), "--set", f"es.updates={UPDATES}"))
    ref, got = center(tmp_path / "runs" / "straight"), center(run_dir)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    a, b = _records(tmp_path / "runs" / "straight"), _records(run_dir)
    keep = ("rewards", "replicas", "update_weights")
    assert [{k: r[k] for k in keep} for r in a] == [{k: r[k] for k in keep} for r in b]
    assert [r["metrics"]["replicas/rms_diff"] for r in a] == [r["metrics"]["replicas/rms_diff"] for r in b]
    assert a[-1]["metrics"]["replicas/rms_diff"] > 0
