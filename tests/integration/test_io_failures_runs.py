"""A damaged MLflow store (torn or zeroed) is named before training, the run is failed with why, and once the
store is moved aside as the message says, a new one resumes the run (moved from tests/unit/test_io_failures.py,
issue 40: each case trains and opens stores, seconds each)."""

import json
import os

import pytest
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from mlflow.tracking import MlflowClient
from unit.test_io_failures import config, damage, tmp_files

from esbatch.cli import main
from esbatch.tracking import TrackingStoreError


@pytest.mark.parametrize("how", ["truncated", "zeroed"])
def test_a_damaged_tracking_store_is_named_before_training_and_a_new_store_resumes_the_run(
    tmp_path, tiny_model_dir, capsys, how
):
    path = config(tmp_path, tiny_model_dir)
    db = tmp_path / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()  # a whole store, then damaged
    damage(db, how)
    before = db.read_bytes()
    assert main(["train", str(path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"error: the MLflow store {db} is damaged (" in err and f"mv {db} {db}.damaged" in err, err
    assert "Traceback" not in err
    run = tmp_path / "r"
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "failed" and f"the MLflow store {db} is damaged" in meta["reason"]
    assert "mlflow_run_id" not in meta and not (run / "log.jsonl").exists()  # nothing trained, nothing to lose
    assert db.read_bytes() == before and tmp_files(tmp_path) == []
    with pytest.raises(TrackingStoreError):
        main(["--debug", "train", "--resume", str(run), "--no-progress"])
    os.replace(db, tmp_path / "mlflow.db.damaged")  # what the message says to do, then a new process:
    SqlAlchemyStore._engine_map.pop(f"sqlite:///{db}").dispose()  # here, MLflow's cached connections go
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "finished"
    assert MlflowClient(f"sqlite:///{db}").get_run(meta["mlflow_run_id"]).info.status == "FINISHED"
