"""The run folder's append-only logs byte for byte: one JSON object and one newline per record, so a resumed run
reads back every complete update and keeps appending valid JSONL."""

import json
import os

import pytest

from esbatch.train.rundir import RunDir, RunFolderError


def _rec(t):
    return {"t": t, "metrics": {"reward/mean": 0.25 * t}, "seeds": [t, t + 1]}


def _line(rec):
    return (json.dumps(rec) + "\n").encode()


def test_each_appended_update_is_one_complete_line_on_disk(tmp_path):
    rd = RunDir(tmp_path)
    for t in range(3):
        rd.append_update(_rec(t))
        assert rd.log.read_bytes() == b"".join(_line(_rec(i)) for i in range(t + 1))
    assert rd.log.read_bytes().count(b"\n") == 3
    assert rd.updates() == [_rec(0), _rec(1), _rec(2)]


def test_each_appended_eval_is_one_complete_line_on_disk(tmp_path):
    rd = RunDir(tmp_path)
    evs = [{"t": 0, "heldout/accuracy": 0.5}, {"t": 2, "heldout/accuracy": 0.75}]
    for e in evs:
        rd.append_eval(e)
    assert rd.eval_log.read_bytes() == _line(evs[0]) + _line(evs[1])
    assert rd.evals() == evs


def test_a_killed_run_resumes_and_continues_its_log(tmp_path):
    rd = RunDir(tmp_path)
    for t in range(2):
        rd.append_update(_rec(t))
    rd.append_eval({"t": 1, "heldout/accuracy": 0.5})
    # a fresh process opens the folder: both updates are complete, nothing torn, nothing to repair
    again = RunDir(tmp_path)
    point = again.check_resume()
    assert point.records == [_rec(0), _rec(1)] and point.torn is False
    size = again.log.stat().st_size
    again.repair_log()
    assert again.log.stat().st_size == size
    again.append_update(_rec(2))
    assert again.updates() == [_rec(0), _rec(1), _rec(2)]
    assert again.progress() == 3
    assert again.log.read_bytes() == _line(_rec(0)) + _line(_rec(1)) + _line(_rec(2))
    assert [e["t"] for e in again.evals()] == [1]


def test_a_torn_last_line_is_redone_once_and_the_log_stays_valid(tmp_path):
    rd = RunDir(tmp_path)
    rd.append_update(_rec(0))
    rd.append_update(_rec(1))
    with open(rd.log, "ab") as f:  # a kill in the middle of writing update 2
        f.write(_line(_rec(2))[:10])
    point = rd.check_resume()
    assert point.records == [_rec(0), _rec(1)] and point.torn is True
    rd.repair_log()
    assert rd.log.read_bytes() == _line(_rec(0)) + _line(_rec(1))
    rd.append_update(_rec(2))
    rd.append_update(_rec(3))
    assert [r["t"] for r in RunDir(tmp_path).check_resume().records] == [0, 1, 2, 3]


def test_discarded_updates_are_complete_lines_too(tmp_path):
    rd = RunDir(tmp_path)
    for t in range(4):
        rd.append_update(_rec(t))
    rd.discard_updates_after(2)
    assert rd.log.read_bytes() == _line(_rec(0)) + _line(_rec(1))
    assert (tmp_path / RunDir.DISCARDED).read_bytes() == _line(_rec(2)) + _line(_rec(3))
    rd.append_update(_rec(2))
    assert rd.updates() == [_rec(0), _rec(1), _rec(2)]


def test_a_complete_line_out_of_order_is_refused(tmp_path):
    rd = RunDir(tmp_path)
    rd.append_update(_rec(0))
    rd.append_update(_rec(2))
    with pytest.raises(RunFolderError, match="expected 1"):
        rd.check_resume()


def _export(files):
    def save(folder):
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)

    return save


def test_a_second_export_replaces_the_first_and_records_its_update(tmp_path):
    rd = RunDir(tmp_path)
    rd.write_export(_export({"model.safetensors": b"old", "stale.json": b"{}"}), t=2)
    assert rd.export_t() == 2
    rd.write_export(_export({"model.safetensors": b"new"}), t=5)
    assert rd.export_t() == 5 and (rd.final_model / "model.safetensors").read_bytes() == b"new"
    assert not (rd.final_model / "stale.json").exists()  # the old folder is gone, not merged into
    assert sorted(p.name for p in tmp_path.iterdir()) == [rd.final_model.name]  # no .old / .tmp folder left


def test_a_center_linked_across_file_systems_is_copied(tmp_path, monkeypatch):
    source = tmp_path / "stage1" / "center.safetensors"
    source.parent.mkdir()
    source.write_bytes(b"weights")
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()

    def cross_device(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    rd.link_center(source)
    assert rd.center.read_bytes() == b"weights" and not rd.center.samefile(source)
    assert sorted(p.name for p in rd.path.iterdir()) == [rd.center.name]
    monkeypatch.undo()
    rd.link_center(source)  # the same file system: a hard link
    assert rd.center.samefile(source)
