"""How a sweep's evals are submitted on SLURM (esbatch/launch/slurm.py:submit), with the sbatch calls recorded
instead of made: evals that can start go in one array, a run's evals in arrays aligned with the training array
(task i after training task i: aftercorr), one array per eval config, and a misaligned eval waits on its task."""

import pytest

from esbatch.config.launcher import LauncherProfile
from esbatch.launch import slurm
from esbatch.launch.state import SweepDir


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    calls = []

    def fake_array(profile, sd, job_name, keys, dependency=None):
        job = str(100 + len(calls))
        calls.append((job_name, list(keys), dependency))
        return {"kind": "slurm", "job_id": job, "array": len(keys) > 1, "keys": list(keys)}

    monkeypatch.setattr(slurm, "_array", fake_array)
    return calls, SweepDir(tmp_path / "sw"), LauncherProfile(cluster="slurm", max_array_size=10, aggregate_job=False)


def test_each_eval_config_gets_an_array_aligned_with_the_training_array(recorded):
    calls, sd, profile = recorded
    keys = ["r1", "r2", "base-a", "ev-1a", "ev-2a", "ev-1b", "ev-2b"]
    after = {"ev-1a": "r1", "ev-2a": "r2", "ev-1b": "r1", "ev-2b": "r2"}
    slurm.submit(profile, sd, "s", keys, after)
    assert calls == [
        ("esbatch-s-eval", ["base-a"], None),
        ("esbatch-s", ["r1", "r2"], None),
        ("esbatch-s-eval", ["ev-1a", "ev-2a"], "aftercorr:101"),
        ("esbatch-s-eval", ["ev-1b", "ev-2b"], "aftercorr:101"),
    ]


def test_an_eval_that_cannot_be_aligned_waits_on_its_own_training_task(recorded):
    calls, sd, profile = recorded
    slurm.submit(profile, sd, "s", ["r1", "r2", "ev-2"], {"ev-2": "r2"})
    assert calls == [("esbatch-s", ["r1", "r2"], None), ("esbatch-s-eval", ["ev-2"], "afterok:100_1")]


def test_a_single_run_is_a_plain_job_and_its_eval_waits_with_afterok(recorded):
    calls, sd, profile = recorded
    slurm.submit(profile, sd, "s", ["r1", "ev-1"], {"ev-1": "r1"})
    assert calls == [("esbatch-s", ["r1"], None), ("esbatch-s-eval", ["ev-1"], "afterok:100")]


def test_arrays_split_past_the_array_size_keep_their_evals_aligned(recorded):
    calls, sd, profile = recorded
    profile.max_array_size = 2
    runs = ["r1", "r2", "r3"]
    slurm.submit(profile, sd, "s", [*runs, *(f"ev-{r}" for r in runs)], {f"ev-{r}": r for r in runs})
    assert calls == [
        ("esbatch-s", ["r1", "r2"], None),
        ("esbatch-s-eval", ["ev-r1", "ev-r2"], "aftercorr:100"),
        ("esbatch-s", ["r3"], None),
        ("esbatch-s-eval", ["ev-r3"], "afterok:102"),
    ]


def test_eval_progress_counts_complete_lines_only(tmp_path):
    """What `esbatch status` shows for an eval: problems whose line was completed (a killed eval's torn tail
    is not a problem evaluated)."""
    from esbatch.launch.evals import eval_progress

    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "A.jsonl").write_text('{"i": 0}\n{"i": 1}\n{"i": 2')
    (tmp_path / "samples" / "B.jsonl").write_text('{"i": 0}\n')
    assert eval_progress(tmp_path) == 3 and eval_progress(tmp_path / "absent") == 0


def test_the_sweep_bar_counts_updates_of_runs_only_and_evals_as_finished_over_planned() -> None:
    from esbatch.launch.state import RunState
    from esbatch.launch.submit import _bar_figures

    states = [
        RunState("a", "ES", "finished", 8, 8, None, None, None, None),
        RunState("b", "GRPO", "running", 3, 8, None, None, None, None),
        RunState("ev-1", "ES (eval)", "finished", 96, None, None, None, None, None, "eval"),
        RunState("ev-2", "GRPO (eval)", "running", 40, None, None, None, None, None, "eval"),
    ]
    done, total, post = _bar_figures(states)
    assert (done, total) == (11, 16)  # before the fix: 147 of 16
    assert post == {"finished": 1, "running": 1, "evals": "1/2"}
