"""Merging offline MLflow stores into the sweep's store (real MLflow, sqlite): one child run per planned run no
matter how often it is merged, no duplicated metric points, and the counts returned are the ones by hand."""

import pytest

from esbatch.aggregate.collect import merge_offline
from esbatch.launch.state import SweepDir
from esbatch.tracking import MLflowTracker
from esbatch.tracking.merge import merge_run

STEPS = [0, 1, 2]


@pytest.fixture
def offline_sweep(tmp_path):
    sd = SweepDir(tmp_path / "sweep")
    keys = ["k0", "k1", "k2"]
    with sd.locked() as m:
        m.update(
            name="t",
            tracking="offline",
            tracking_uri=f"sqlite:///{sd.path / 'mlflow.db'}",
            experiment="t",
            runs=[{"key": k, "label": f"seed={i}", "index": i, "point": {"run.seed": i}} for i, k in enumerate(keys)],
        )
    src_ids = {}
    for i, key in enumerate(keys[:2]):  # k2 never logged: a folder without a store
        rd = sd.run_dir(key)
        rd.path.mkdir(parents=True)
        tr = MLflowTracker(rd.offline_uri(), "t", rd.path / "mlartifacts")
        run_id = tr.start(
            f"seed={i}", {"es.sigma": 0.05, "run.seed": i}, {"esbatch.sweep": "t", "esbatch.run_key": key}
        )
        for s in STEPS:
            tr.log_metrics({"reward/mean": 0.1 * s + i, "loss": -s}, step=s)
        tr.end("FINISHED")
        rd.write_meta(status="finished", mlflow_run_id=run_id, tracking_uri=rd.offline_uri())
        src_ids[key] = run_id
    sd.run_dir("k2").path.mkdir(parents=True)
    sd.run_dir("k2").write_meta(status="failed")
    return sd, src_ids


def _children(sd):
    from mlflow.tracking import MlflowClient

    meta = sd.read()
    client = MlflowClient(tracking_uri=meta["tracking_uri"])
    exp = client.get_experiment_by_name(meta["experiment"])
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`esbatch.sweep` = 't'", max_results=100)
    kids = [r for r in runs if r.data.tags.get("esbatch.role") != "parent"]
    return client, meta, kids


def test_merging_twice_leaves_one_child_per_run(offline_sweep):
    sd, _ = offline_sweep
    assert merge_offline(sd) == 2  # k0 and k1; k2 has no offline store
    client, meta, kids = _children(sd)
    assert sorted(r.data.tags["esbatch.run_key"] for r in kids) == ["k0", "k1"]
    assert merge_offline(sd) == 2
    client, meta, kids_again = _children(sd)
    assert sorted(r.info.run_id for r in kids_again) == sorted(r.info.run_id for r in kids)
    for r in kids_again:
        i = int(r.data.tags["esbatch.run_key"][1])
        assert r.data.tags["mlflow.parentRunId"] == meta["parent_run_id"]
        assert r.data.params["run.seed"] == str(i)
        assert r.info.status == "FINISHED"
        hist = client.get_metric_history(r.info.run_id, "reward/mean")
        assert sorted((h.step, h.value) for h in hist) == [(s, pytest.approx(0.1 * s + i)) for s in STEPS]
        assert len(client.get_metric_history(r.info.run_id, "loss")) == len(STEPS)


def test_merge_run_returns_the_same_child_and_counts_only_new_points(offline_sweep):
    sd, src_ids = offline_sweep
    parent = sd.ensure_parent_run()
    meta = sd.read()
    dst = MLflowTracker(meta["tracking_uri"], "t")
    src_uri = sd.run_dir("k0").offline_uri()
    args = (meta["tracking_uri"], dst.experiment_id, parent, "t", "k0")
    first_id, added = merge_run(src_uri, src_ids["k0"], *args)
    assert added == 2 * len(STEPS)  # two metrics, three steps each
    # the run goes on offline: one more step of each metric
    src = MLflowTracker(src_uri, "t")
    src.start("seed=0", {}, {}, run_id=src_ids["k0"])
    src.log_metrics({"reward/mean": 9.0, "loss": -3}, step=3)
    src.end("FINISHED")
    second_id, added = merge_run(src_uri, src_ids["k0"], *args)
    assert second_id == first_id and added == 2
    third_id, added = merge_run(src_uri, src_ids["k0"], *args)
    assert third_id == first_id and added == 0
    _, _, kids = _children(sd)
    assert [r.info.run_id for r in kids] == [first_id]
