"""The config fingerprint (esbatch/train/fingerprint.py), as a property over every key of the run config: a
resume whose config.yaml changes any key outside budgets and bookkeeping (RESUME_OVERRIDABLE, run.name,
run.output_dir, tracking.*) is refused naming that key, old -> new; a change of an allowed key is not refused
and is returned to be recorded."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
from config_keys import changed, field_of

from esbatch.config import RESUME_OVERRIDABLE, Config, config_from_dict
from esbatch.schema import describe
from esbatch.train import fingerprint
from esbatch.train.rundir import RunDir, RunFolderError

BOOKKEEPING = {"run.name", "run.output_dir"}
KEYS = [k for k, *_ in describe(Config) if "[]" not in k]  # eval.tasks[].x: inside eval.tasks, a key of its own


def may_change(key: str) -> bool:
    return key in RESUME_OVERRIDABLE or key in BOOKKEEPING or key.startswith("tracking.")


def base():
    return config_from_dict({"es": {"updates": 4}, "eval": {"ks": [1, 2]}})


@pytest.fixture
def run(tmp_path):
    rd = RunDir(tmp_path)
    fingerprint.record(rd, base())
    return rd


def test_the_allowed_set_is_resume_overridable_plus_bookkeeping():
    keys = fingerprint.resume_overridable()
    assert RESUME_OVERRIDABLE <= keys and keys - RESUME_OVERRIDABLE == {"run.name", "run.output_dir", "tracking"}


@pytest.mark.parametrize("key", KEYS)
def test_every_key_outside_budgets_and_bookkeeping_refuses_a_resume(run, key):
    cfg = copy.deepcopy(base())
    obj, f = field_of(cfg, key)
    old = getattr(obj, f.name)
    setattr(obj, f.name, changed(old, f))
    if may_change(key):
        got = fingerprint.check(run, cfg)
        assert got and all(k == key or k.startswith(key + ".") for k in got), got
        return
    with pytest.raises(RunFolderError) as e:
        fingerprint.check(run, cfg)
    msg = str(e.value)
    assert f"{key}" in msg and " -> " in msg and "a resume may change only budgets and bookkeeping" in msg
    assert "es.updates" in msg.split("bookkeeping:")[1]  # it says which keys may change


def test_an_unchanged_config_and_a_folder_without_fingerprint(run, tmp_path):
    assert fingerprint.check(run, base()) == {}
    assert fingerprint.check(RunDir(tmp_path / "old"), base()) is None  # before fingerprints: not checked


def test_the_message_names_old_and_new_values(run):
    cfg = base()
    cfg.es.sigma, cfg.es.updates = 0.5, 9
    with pytest.raises(RunFolderError, match=r"es\.sigma: 0\.001 -> 0\.5\)"):
        fingerprint.check(run, cfg)
    cfg.es.sigma = 0.001
    assert fingerprint.check(run, cfg) == {"es.updates": (4, 9)}
    assert fingerprint.describe({"es.updates": (4, 9)}) == "es.updates: 4 -> 9"


def test_a_key_a_later_version_added_is_no_change_at_its_default_and_a_change_otherwise(run):
    record = fingerprint.path(run)
    data = json.loads(record.read_text())
    del data["values"]["es.sigma"]  # as if es.sigma did not exist when the run started
    record.write_text(json.dumps(data))
    assert fingerprint.check(run, base()) == {}  # 0.001, its default
    cfg = base()
    cfg.es.sigma = 0.5
    with pytest.raises(RunFolderError, match=r"es\.sigma: \(unset\) -> 0\.5"):
        fingerprint.check(run, cfg)


@pytest.mark.parametrize("text", ["", "{", '{"values": []}', '{"sha256": "x"}', "[1]"])
def test_a_damaged_fingerprint_is_named_with_what_to_do(run, text):
    fingerprint.path(run).write_text(text)
    with pytest.raises(RunFolderError, match="not a valid config fingerprint.*delete it to resume"):
        fingerprint.check(run, base())


def test_the_recorded_sha256_covers_exactly_the_keys_a_resume_may_not_change(run, tmp_path):
    rec = json.loads(fingerprint.path(run).read_text())
    keys = fingerprint.resume_overridable()
    kept = {k: v for k, v in rec["values"].items() if not fingerprint.allowed(k, keys)}
    assert rec["sha256"] == hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()
    assert "es.sigma" in kept and "es.updates" not in kept and not any(k.startswith("tracking.") for k in kept)
    other = RunDir(tmp_path / "other")
    other.path.mkdir()
    cfg = base()
    cfg.es.updates, cfg.run.name = 9, "elsewhere"  # a budget and bookkeeping: the same sha256
    fingerprint.record(other, cfg)
    assert json.loads(fingerprint.path(other).read_text())["sha256"] == rec["sha256"]
    cfg.es.sigma = 0.5
    fingerprint.record(other, cfg)
    assert json.loads(fingerprint.path(other).read_text())["sha256"] != rec["sha256"]
    assert [p.name for p in other.path.iterdir()] == [fingerprint.FILE]  # written atomically, no tmp left


def test_keys_that_appear_or_vanish_are_named_unset_and_several_are_listed(run):
    cfg = base()
    cfg.task.params = {**cfg.task.params, "extra": 1}  # a key the recorded config did not have, not a default
    cfg.model.name = "another-model"
    with pytest.raises(RunFolderError) as e:
        fingerprint.check(run, cfg)
    msg = str(e.value)
    assert "(model.name: 'smollm2-135m-instruct' -> 'another-model'; task.params: {} -> (unset); " in msg, msg
    assert "; task.params.extra: (unset) -> 1); a resume may change only" in msg, msg
    data = json.loads(fingerprint.path(run).read_text())
    data["values"]["task.params.gone"] = 2  # recorded then, absent now
    fingerprint.path(run).write_text(json.dumps(data))
    with pytest.raises(RunFolderError, match=r"\(task\.params\.gone: 2 -> \(unset\)\)"):
        fingerprint.check(run, base())


def test_an_allowed_key_that_appears_is_no_recorded_change(run):
    data = json.loads(fingerprint.path(run).read_text())
    del data["values"]["es.updates"]  # a budget the recorded config did not have
    fingerprint.path(run).write_text(json.dumps(data))
    assert fingerprint.check(run, base()) == {}  # allowed, and not an (old, new) pair to record
