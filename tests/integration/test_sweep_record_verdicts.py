"""A sweep record or run folder that esbatch cannot use gets one named verdict from every command (issue 44, D8).

`sweep.json` holding ``{}`` made status and aggregate end in KeyError; a run whose log.jsonl was deleted next to
its checkpoint read "finished" in status and aggregate but was refused as damaged by resume.
"""

from __future__ import annotations

import json

import pytest
import torch

from esbatch.cli import main
from esbatch.config import config_from_dict
from esbatch.launch.state import SWEEP_RECORD_KEYS, SweepDir, disk_state, folder_problem
from esbatch.train.rundir import RunDir, RunFolderError


@pytest.mark.parametrize("command", ["status", "aggregate"])
@pytest.mark.parametrize(
    "record, lacks",
    [
        ({}, "'name', 'tracking_uri', 'experiment', 'runs'"),
        ({"name": "s", "tracking_uri": "sqlite:///x.db", "experiment": "s"}, "'runs'"),
    ],
)
def test_a_sweep_record_without_its_keys_is_a_named_error(tmp_path, capsys, command, record, lacks):
    sd = SweepDir(tmp_path / "s")
    sd.path.mkdir()
    sd.meta_path.write_text(json.dumps(record))
    assert main([command, str(sd.path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {sd.meta_path}: not a valid sweep record (it lacks {lacks}, which every submission ")
    assert f"mv {sd.meta_path} {sd.meta_path}.damaged" in err
    assert json.loads(sd.meta_path.read_text()) == record  # nothing written
    assert SWEEP_RECORD_KEYS == ("name", "tracking_uri", "experiment", "runs")


def test_a_missing_sweep_record_is_still_an_empty_one_before_the_first_submission(tmp_path):
    assert SweepDir(tmp_path / "new").read(require=SWEEP_RECORD_KEYS) == {}


def finished_run(path) -> RunDir:
    rd = RunDir(path)
    rd.path.mkdir(parents=True)
    rd.config.write_text("x: 1\n")
    rd.meta.write_text(json.dumps({"status": "finished", "algorithm": "es"}))
    for t in range(2):
        rd.append_update({"t": t, "metrics": {"reward/mean": 0.5}})
    rd.save_center({"w": torch.zeros(2)}, 2)
    return rd


def test_a_run_whose_log_was_deleted_is_damaged_for_status_and_resume_alike(tmp_path):
    plan = config_from_dict({"model": {"name": "nobody/no-model"}, "es": {"updates": 2, "batch_size": 4}})
    rd = finished_run(tmp_path / "r")
    assert folder_problem(rd) is None
    assert disk_state(rd, plan)[:3] == ("finished", 2, 2)
    rd.log.unlink()
    with pytest.raises(RunFolderError) as resume:
        rd.check_resume()
    assert str(resume.value).startswith(f"{rd.log} is missing next to a checkpoint ({rd.center} holds update 2)")
    assert folder_problem(rd) == str(resume.value)  # status, sweep and aggregate give resume's words
    assert disk_state(rd, plan)[0] == "damaged"


def test_a_log_behind_its_checkpoint_is_damaged_for_status_too(tmp_path):
    plan = config_from_dict({"model": {"name": "nobody/no-model"}, "es": {"updates": 2, "batch_size": 4}})
    rd = finished_run(tmp_path / "r")
    rd.log.write_text(rd.log.read_text().splitlines(keepends=True)[0])  # one update logged, the center at 2
    assert disk_state(rd, plan)[0] == "damaged"
    assert "the checkpoint is ahead of the log" in folder_problem(rd)
