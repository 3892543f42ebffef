"""An eval folder's source record (source.json: which update of its run it scored), read by the sweep state,
the eval task and aggregate: missing means "no record", damaged is said as such and never read as "no record"
(an unreadable record used to become {} and the eval counted as current)."""

from __future__ import annotations

import json

import pytest

from esbatch.launch.evals import SOURCE_FILE, DamagedSource, eval_disk_state, evaluated_updates, source_record

FINISHED = json.dumps({"mlflow_run_id": "abc"})


def folder(tmp_path, source: str | None, finished: bool = True):
    f = tmp_path / "e"
    f.mkdir()
    if source is not None:
        (f / SOURCE_FILE).write_text(source)
    if finished:
        (f / "metrics.json").write_text(FINISHED)
    return f


DAMAGED = ["", "{", '{"run": "r", "updates": "3"}', "[3]", "null", '{"updates": 3.5}']


@pytest.mark.parametrize("text", DAMAGED)
def test_a_damaged_record_is_named_and_the_eval_is_stale(tmp_path, text):
    f = folder(tmp_path, text)
    with pytest.raises(DamagedSource, match=SOURCE_FILE):
        source_record(f)
    assert evaluated_updates(f) == "damaged"
    assert eval_disk_state(f, 3, True) == "stale"  # which center it scored is unknown: evaluated again


def test_an_unreadable_record_is_damaged(tmp_path):
    f = folder(tmp_path, None)
    (f / SOURCE_FILE).mkdir()  # reading it raises IsADirectoryError, an OSError that is not "missing"
    assert evaluated_updates(f) == "damaged"


@pytest.mark.parametrize(
    "recorded, now, finished, state",
    [
        (3, 3, True, "finished"),
        (3, 4, True, "stale"),  # the run trained further after this eval
        (None, 3, True, "finished"),  # no record (stopped before it wrote one; older sweeps)
        (3, 3, False, "stale"),  # the run itself is not finished: its final center is still to come
        (3, None, True, "finished"),  # a base-model eval: no source run
    ],
)
def test_states_at_each_boundary(tmp_path, recorded, now, finished, state):
    f = folder(tmp_path, None if recorded is None else json.dumps({"run": "r", "updates": recorded}))
    assert eval_disk_state(f, now, finished) == state


def test_pending_and_interrupted(tmp_path):
    assert eval_disk_state(tmp_path / "none", 3, True) == "pending"
    f = folder(tmp_path, json.dumps({"run": "r", "updates": 3}), finished=False)
    assert eval_disk_state(f, 3, True) == "interrupted"
