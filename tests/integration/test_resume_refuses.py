"""Resume refuses to guess: each damaged run folder either resumes to the undisturbed run's center bit for bit
(a torn last line, a damaged center moved aside) or is refused with a message naming the file, and then not a
byte on disk has changed. A run that failed before its first update is retried with the same command."""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from toy import toy_config

from esbatch.config import config_from_dict
from esbatch.train import train
from esbatch.train.lock import LOCK_FILE
from esbatch.train.rundir import RunDir, RunFolderError

# The two reference runs (`ref`) are a module fixture, built once per xdist worker: one group, so one worker
# runs this module and builds it once (spread over the workers, each of them built it).
pytestmark = pytest.mark.xdist_group("resume_refuses")

UPDATES = 4


def cfg(model_dir: Path, out: Path, name: str, updates: int = UPDATES):
    d = toy_config(
        model_dir,
        es_updates=updates,
        run={"name": name, "seed": 3, "output_dir": str(out), "threads": 1},
        eval={"every": 2},
        checkpoint={"every": 2},
        tracking={"uri": f"sqlite:///{out / 'mlflow.db'}"},
    )
    return config_from_dict(d)


def center(rd: RunDir) -> dict[str, torch.Tensor]:
    return load_file(str(rd.center))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE  # the writer lock the resume held names its holder
    }


@pytest.fixture(scope="module")
def ref(tmp_path_factory, tiny_model_dir):
    """The undisturbed 4-update run, and a 2-update run of the same config (center and log at update 2)."""
    out = tmp_path_factory.mktemp("ref")
    train(cfg(tiny_model_dir, out, "full"), out / "full", progress=False)
    train(cfg(tiny_model_dir, out, "half", updates=2), out / "half", progress=False)
    return out


def damaged_copy(ref: Path, src: str, tmp: Path) -> RunDir:
    shutil.copytree(ref / src, tmp / "r")
    return RunDir(tmp / "r")


def resume(model_dir: Path, rd: RunDir) -> dict:
    c = cfg(model_dir, rd.path.parent, rd.path.name)
    return train(c, rd.path, resume=True, progress=False)


def test_a_torn_last_line_is_redone_exactly_once(ref, tmp_path, tiny_model_dir):
    """Killed while appending update 3: center at 2, log 0..2 complete, update 3 torn -> replay 2, redo 3."""
    rd = damaged_copy(ref, "half", tmp_path)
    full = (ref / "full" / "log.jsonl").read_bytes().splitlines(keepends=True)
    with open(rd.log, "ab") as f:
        f.write(full[2] + full[3][: len(full[3]) // 2])
    assert rd.center_t() == 2
    resume(tiny_model_dir, rd)
    assert same(center(rd), center(RunDir(ref / "full")))
    assert rd.log.read_bytes() == (ref / "full" / "log.jsonl").read_bytes() or len(rd.updates()) == UPDATES
    assert [r["t"] for r in rd.updates()] == [0, 1, 2, 3]


def refused(model_dir: Path, rd: RunDir, *needles: str) -> str:
    before = snapshot(rd.path)
    with pytest.raises(RunFolderError) as e:
        resume(model_dir, rd)
    assert snapshot(rd.path) == before  # refused before anything was written
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_torn_last_line_with_the_center_ahead_is_refused(ref, tmp_path, tiny_model_dir):
    rd = damaged_copy(ref, "full", tmp_path)
    data = rd.log.read_bytes()
    rd.log.write_bytes(data[: len(data) - 40])  # the last record torn, but the final center includes it
    msg = refused(tiny_model_dir, rd, str(rd.center), "holds update 4", "only 3 complete", "torn", "mv ")
    assert "ahead of the log" in msg


def test_a_corrupt_middle_line_is_refused_naming_the_line(ref, tmp_path, tiny_model_dir):
    rd = damaged_copy(ref, "full", tmp_path)
    lines = rd.log.read_bytes().splitlines(keepends=True)
    lines[1] = b'{"t": 1, "seeds": [1, 2\n'
    rd.log.write_bytes(b"".join(lines))
    refused(tiny_model_dir, rd, str(rd.log), "line 2 of 4", "2 complete line(s) follow", "head -n 1")


def test_an_out_of_order_log_is_refused(ref, tmp_path, tiny_model_dir):
    rd = damaged_copy(ref, "full", tmp_path)
    lines = rd.log.read_bytes().splitlines(keepends=True)
    rd.log.write_bytes(b"".join([lines[0], lines[2], lines[1], lines[3]]))
    refused(tiny_model_dir, rd, str(rd.log), "line 2 is update 2, expected 1")


def test_a_missing_log_next_to_a_checkpoint_is_refused(ref, tmp_path, tiny_model_dir):
    rd = damaged_copy(ref, "full", tmp_path)
    rd.log.unlink()
    refused(tiny_model_dir, rd, "log.jsonl is missing", "holds update 4")


def test_a_checkpoint_ahead_of_the_log_is_refused(ref, tmp_path, tiny_model_dir):
    rd = damaged_copy(ref, "full", tmp_path)
    lines = rd.log.read_bytes().splitlines(keepends=True)
    rd.log.write_bytes(b"".join(lines[:3]))  # a whole line lost
    refused(tiny_model_dir, rd, "holds update 4", "only 3 complete", "ahead of the log")


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b"",  # empty
        lambda b: b"\x00garbage, not a safetensors file" * 10,
        lambda b: b[:8] + b"{" * (len(b) - 8),  # a header that is not JSON
    ],
    ids=["truncated", "empty", "garbage", "bad-header"],
)
def test_a_damaged_center_is_named_and_moving_it_aside_replays_from_theta0(ref, tmp_path, tiny_model_dir, damage):
    rd = damaged_copy(ref, "full", tmp_path)
    rd.center.write_bytes(damage(rd.center.read_bytes()))
    refused(tiny_model_dir, rd, str(rd.center), "damaged", f"mv {rd.center} {rd.center}.damaged")
    rd.center.rename(rd.path / "center.safetensors.damaged")  # what the message says to do
    resume(tiny_model_dir, rd)
    assert same(center(rd), center(RunDir(ref / "full")))


def test_a_corrupt_run_json_is_named(ref, tmp_path, tiny_model_dir):
    rd = damaged_copy(ref, "full", tmp_path)
    rd.meta.write_text('{"status": "runn')
    refused(tiny_model_dir, rd, str(rd.meta), "not valid run metadata")


def test_a_run_that_failed_before_its_first_update_is_retried_with_the_same_command(
    ref, tmp_path, tiny_model_dir, monkeypatch
):
    import esbatch.es.trainer as es_trainer

    c = cfg(tiny_model_dir, tmp_path, "retry")

    def boom(*a, **k):
        raise RuntimeError("the first update failed")

    with monkeypatch.context() as m:
        m.setattr(es_trainer, "es_step", boom)
        with pytest.raises(RuntimeError, match="first update failed"):
            train(c, tmp_path / "retry", progress=False)
    rd = RunDir(tmp_path / "retry")
    assert rd.exists() and rd.read_meta()["status"] == "failed"
    train(c, tmp_path / "retry", progress=False)  # the same call again: no "already holds a run"
    assert same(center(rd), center(RunDir(ref / "full")))
    assert rd.read_meta()["status"] == "finished"
    with pytest.raises(FileExistsError, match="already holds a run"):  # a run with updates is never restarted
        train(c, tmp_path / "retry", progress=False)
