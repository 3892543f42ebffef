"""I/O failures end in one paragraph that names the file and says what to do, a non-zero exit and no traceback
(`esbatch --debug` shows it), run.json "failed" with the reason where it can still be written, and no tmp file
left behind: a damaged model file, and a full disk, a permission error, an immutable file or a read-only file
system at a durable write (injected: root ignores modes here and a full disk cannot be made to order)."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import yaml
from mlflow.tracking import MlflowClient
from toy import toy_config

from esbatch import durable
from esbatch.cli import STORAGE_ADVICE, main


def config(tmp_path, model_dir, name="r"):
    cfg = toy_config(model_dir, es_updates=2, run={"name": name, "seed": 0, "threads": 1, "output_dir": str(tmp_path)})
    cfg["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def tmp_files(folder):
    return [p for p in folder.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize(
    "file, damage",
    [
        ("model.safetensors", lambda b: b[:100]),  # a torn download
        ("tokenizer.json", lambda b: b[:50]),
        ("config.json", lambda b: b"{"),
    ],
)
def test_a_damaged_model_file_is_named_and_the_run_fails_with_why(tmp_path, tiny_model_dir, capsys, file, damage):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model / file).write_bytes(damage((model / file).read_bytes()))
    assert main(["train", str(config(tmp_path, model)), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"{model / file} (" in err and "Copy or download the model again" in err and "Traceback" not in err, err
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["status"] == "failed" and str(model / file) in meta["reason"]
    assert tmp_files(tmp_path) == []
    with pytest.raises(Exception, match="damaged files"):  # --debug: the traceback
        main(["--debug", "train", "--resume", str(tmp_path / "r"), "--no-progress"])


@pytest.mark.parametrize("code", sorted(STORAGE_ADVICE), ids=[errno.errorcode[c] for c in sorted(STORAGE_ADVICE)])
def test_a_failed_durable_write_names_the_file_and_what_to_do(tmp_path, tiny_model_dir, capsys, monkeypatch, code):
    real = durable._fsync_file
    writes = []

    def failing(path):  # the second durable write of run.json fails: the run has started
        writes.append(path.name)
        if path.name.startswith("run.json") and writes.count(path.name) == 2:
            raise OSError(code, os.strerror(code))
        return real(path)

    monkeypatch.setattr(durable, "_fsync_file", failing)
    assert main(["train", str(config(tmp_path, tiny_model_dir)), "--no-progress"]) == 1
    err = capsys.readouterr().err
    run_json = tmp_path / "r" / "run.json"
    assert f"\nerror: {run_json}: {os.strerror(code)}. {STORAGE_ADVICE[code]} (--debug" in err, err
    assert "Traceback" not in err and tmp_files(tmp_path) == []
    meta = json.loads(run_json.read_text())
    assert meta["status"] == "failed" and os.strerror(code) in meta["reason"]  # the next write went through
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(meta["mlflow_run_id"])
    assert run.info.status == "FAILED"
    monkeypatch.setattr(durable, "_fsync_file", lambda p: (_ for _ in ()).throw(OSError(code, os.strerror(code))))
    with pytest.raises(OSError):
        main(["--debug", "train", "--resume", str(tmp_path / "r"), "--no-progress"])
    assert tmp_files(tmp_path) == []


def test_an_os_error_outside_the_storage_list_is_not_reworded(tmp_path, tiny_model_dir, monkeypatch):
    def failing(path):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(durable, "_fsync_file", failing)
    with pytest.raises(OSError, match="Input/output error"):  # unexpected: the traceback, not a guess
        main(["train", str(config(tmp_path, tiny_model_dir)), "--no-progress"])
