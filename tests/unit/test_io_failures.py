"""I/O failures end in one paragraph that names the file and says what to do, a non-zero exit and no traceback
(`esbatch --debug` shows it), run.json "failed" with the reason where it can still be written, and no tmp file
left behind: a damaged model file, and a full disk, a permission error, an immutable file or a read-only file
system at a durable write (injected: root ignores modes here and a full disk cannot be made to order)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE
from mlflow.tracking import MlflowClient
from safetensors import SafetensorError
from toy import toy_config

from esbatch import durable
from esbatch.cli import STORAGE_ADVICE, main
from esbatch.tasks import DataFileError
from esbatch.tracking import TrackingWriter
from esbatch.tracking import spool as spooling
from esbatch.tracking.spool import BACKOFF_S
from esbatch.train.rundir import RunDir


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


def damage(db, how):
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2] if how == "truncated" else bytes(len(data)))  # torn copy / zeroed


def test_a_store_that_refuses_every_try_fails_the_run_before_training(tmp_path, tiny_model_dir, capsys, monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(spooling, "pause", sleeps.append)

    def locked(self, *args, **kwargs):
        raise MlflowException("(sqlite3.OperationalError) database is locked", error_code=TEMPORARILY_UNAVAILABLE)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", locked)
    assert main(["train", str(config(tmp_path, tiny_model_dir)), "--no-progress"]) == 1
    err = capsys.readouterr().err
    db = tmp_path / "mlflow.db"
    assert f"error: the MLflow store {db} did not answer after 6 tries (MlflowException: " in err, err
    assert "Traceback" not in err and sleeps == list(BACKOFF_S)
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["status"] == "failed" and "did not answer after 6 tries" in meta["reason"]
    assert not (tmp_path / "r" / "log.jsonl").exists() and tmp_files(tmp_path) == []


def test_a_store_damaged_while_training_costs_no_update(tmp_path, tiny_model_dir, capsys, monkeypatch):
    db = tmp_path / "mlflow.db"
    real = TrackingWriter.pump  # the run's writer thread sends the spool (esbatch/tracking/writer.py)
    sleeps: list[float] = []
    monkeypatch.setattr(spooling, "pause", sleeps.append)
    zeroed: list[int] = []

    def damaged_first(self):  # the store is zeroed under the running training, before its 1st metric is sent
        if not zeroed and any("metrics" in r for r in self.spool.records()):
            zeroed.append(1)
            damage(db, "zeroed")
        return real(self)

    monkeypatch.setattr(TrackingWriter, "pump", damaged_first)
    assert main(["train", str(config(tmp_path, tiny_model_dir)), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"warning: tracking: the MLflow store sqlite:///{db} is unavailable (" in err
    assert "file is not a database" in err and "Traceback" not in err, err
    assert sleeps == []  # a damaged store is not waited for: trying again cannot mend it
    run = tmp_path / "r"
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "finished"
    steps = [json.loads(line)["t"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # every update trained and in the folder, the record
    spooled = [json.loads(line) for line in (run / spooling.FILE).read_text().splitlines()]
    assert [r["step"] for r in spooled if "metrics" in r][:2] == [0, 1] and spooled[-1]["status"] == "FINISHED"
    assert tmp_files(tmp_path) == []


def gsm8k_rows(n=12):
    return [{"question": f"What is {i} + {i}?", "answer": f"{i}+{i} = {2 * i}\n#### {2 * i}"} for i in range(n)]


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet(rows):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "name, data, why",
    [
        ("torn.jsonl", jsonl(gsm8k_rows())[:-30], "line 12, column "),  # a copy cut short: the last line torn
        ("middle.jsonl", jsonl(gsm8k_rows()).replace(b'"What is 4', b"What is 4"), "line 5, column 14: "),
        ("binary.jsonl", b"\x00\xff" * 40, "not UTF-8 text: byte 1"),
        ("torn.parquet", parquet(gsm8k_rows())[:200], "ArrowInvalid: "),
    ],
)
def test_a_damaged_data_file_is_named_and_the_run_fails_with_why(tmp_path, tiny_model_dir, capsys, name, data, why):
    (tmp_path / name).write_bytes(data)
    cfg = toy_config(
        tiny_model_dir,
        es_updates=1,
        run={"name": "r", "seed": 0, "threads": 1, "output_dir": str(tmp_path)},
        task={"name": "gsm8k", "data_path": str(tmp_path / name), "heldout_size": 4, "few_shot": 1},
    )
    cfg["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "r.yaml"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"error: {tmp_path / name}: the data file cannot be read ({why}" in err, err
    assert "Copy or export it again" in err and "Traceback" not in err
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["status"] == "failed" and f"{tmp_path / name}: the data file cannot be read ({why}" in meta["reason"]
    assert "mlflow_run_id" not in meta and tmp_files(tmp_path) == []  # the data is read before MLflow is opened
    with pytest.raises(DataFileError):
        main(["--debug", "train", "--resume", str(tmp_path / "r"), "--no-progress"])


def test_run_json_refusing_every_write_after_the_start_leaves_mlflow_failed_not_running(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    real = durable._fsync_file
    writes = []

    def failing(path):  # an immutable run.json: from its second write on (the start), every write fails
        writes.append(path.name)
        if path.name.startswith("run.json") and writes.count(path.name) >= 2:
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        return real(path)

    monkeypatch.setattr(durable, "_fsync_file", failing)
    assert main(["train", str(config(tmp_path, tiny_model_dir)), "--no-progress"]) == 1
    assert f"{tmp_path / 'r' / 'run.json'}: Operation not permitted" in capsys.readouterr().err
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("esbatch").experiment_id])
    assert run.info.status == "FAILED" and tmp_files(tmp_path) == []


def test_a_library_write_that_fills_the_disk_reads_as_a_full_disk(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import safetensors.torch

    def full(tensors, filename, metadata=None):  # safetensors reports the errno only in its message
        Path(filename).write_bytes(b"\0" * 10)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["train", str(config(tmp_path, tiny_model_dir)), "--no-progress"]) == 1
    center = tmp_path / "r" / "center.safetensors"
    assert f"error: {center}: No space left on device. {STORAGE_ADVICE[errno.ENOSPC]}" in capsys.readouterr().err
    meta = json.loads((tmp_path / "r" / "run.json").read_text())
    assert meta["status"] == "failed" and "No space left on device" in meta["reason"]
    assert not center.exists() and tmp_files(tmp_path) == []


def test_an_export_cut_short_leaves_no_half_written_folder(tmp_path):
    rd = RunDir(tmp_path / "r")
    rd.path.mkdir()

    def save(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 10)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as e:
        rd.write_export(save, t=3)
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(rd.final_model))
    assert list(rd.path.iterdir()) == []
