"""A local launcher records its exit codes in its own sweep.json entry, never in another launcher's."""

import json

from esbatch.launch.local import save_submission
from esbatch.launch.state import SweepDir


def _record(pid, token, keys):
    return {
        "kind": "local",
        "job_id": f"local-{pid}",
        "keys": keys,
        "time": "2026-12-01T19:21:10",
        "pids": {},
        "token": token,
    }


def test_the_entry_is_found_by_its_token_not_its_position(tmp_path):
    sd = SweepDir(tmp_path / "sweep")
    a, b = _record(1, "aa", ["k1"]), _record(1, "bb", ["k2"])  # same pid and second: runs, then evals
    with sd.locked() as meta:
        meta["submissions"] = [dict(a), dict(b)]
    b["exit_codes"] = {"k2": 0}
    assert save_submission(sd, b)
    subs = json.loads(sd.meta_path.read_text())["submissions"]
    assert subs == [a, b]


def test_a_replaced_sweep_folder_keeps_the_new_launchers_entry(tmp_path, capsys):
    sd = SweepDir(tmp_path / "sweep")
    old = _record(9087, "old", ["ca48ec940cba"])
    new = _record(9692, "new", ["61a3f97fd7cf"])
    with sd.locked() as meta:  # the folder was deleted and a new sweep started: its submission is at index 0
        meta["submissions"] = [dict(new)]
    old["exit_codes"] = {"ca48ec940cba": 1}  # the old launcher, still stopping, saves its exit codes
    assert not save_submission(sd, old)
    assert json.loads(sd.meta_path.read_text())["submissions"] == [new]
    assert "no longer holds submission local-9087" in capsys.readouterr().err
