"""What a researcher compares in the MLflow UI (issue 43), against a real sqlite store, in-process:

* a run's dataset inputs go through the run folder's spool like its metrics: a store that is down keeps them
  there, `esbatch aggregate`'s drain sends them, and sending them again adds nothing;
* `esbatch aggregate` gives the parent run the results, the sweep file and sweep.json as artifacts, the
  experiment a saved compare view grouped by the sweep's keys, and a pipeline's run its stages' joined curves
  (the metric names an ES run logs) and their datasets, each metric step once however often it runs."""

import hashlib
import json

import yaml
from mlflow.tracking import MlflowClient
from store_outage import Outage

from esbatch.aggregate.collect import aggregate
from esbatch.aggregate.mlflow_view import VIEW_KEY, VIEW_TAG
from esbatch.config import config_from_dict
from esbatch.launch.state import SweepDir
from esbatch.tracking import MLflowTracker, TrackingWriter, dataset_input, dataset_source, spool_path
from esbatch.tracking.pending import drain
from esbatch.tracking.spool import Spool
from esbatch.train.rundir import RunDir

ROWS = [("12+30=?", "42"), ("7+8=?", "15"), ("50+1=?", "51")]


def digest(rows):
    """The digest recomputed by hand: sha256 of the problems' compact JSON, 16 hex characters."""
    return hashlib.sha256(json.dumps([list(r) for r in rows], separators=(",", ":")).encode()).hexdigest()[:16]


def inputs_of(client, run_id):
    return {(d.dataset.name, d.dataset.digest): d for d in client.get_run(run_id).inputs.dataset_inputs}


def test_dataset_inputs_wait_in_the_spool_while_the_store_is_down_and_are_sent_once(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder = tmp_path / "run"
    folder.mkdir()
    tr = MLflowTracker(uri, "x", tmp_path / "art", spool_path(folder))
    rid = tr.start("r", {"es.population_size": 4}, {})
    w = TrackingWriter(tr, start=False)
    outage = Outage(monkeypatch, tr.client)
    src = dataset_source(generator={"task": "arithmetic", "params": {"max_digits": 2}, "seed": 3})
    d = dataset_input("arithmetic-train", ROWS, src, "train", "training")
    w.log_inputs([d])
    assert not w.pump() and outage.refused  # the store refused: the write waits in the run folder
    (rec,) = Spool(spool_path(folder)).records()
    assert rec["inputs"] == [d]
    outage.down = False
    drain(folder)  # what `esbatch aggregate` does with a run folder's spool
    drain(folder)
    client = MlflowClient(uri)
    (got,) = inputs_of(client, rid).values()
    ds = got.dataset
    assert (ds.name, ds.digest) == ("arithmetic-train", digest(ROWS))
    assert json.loads(ds.profile)["num_rows"] == 3 and ds.source_type == "code"
    assert json.loads(ds.source)["tags"] == {
        "esbatch.task": "arithmetic",
        "esbatch.params": '{"max_digits": 2}',
        "esbatch.seed": "3",
    }
    assert {t.key: t.value for t in got.tags} == {"mlflow.data.context": "training", "esbatch.split": "train"}
    w.log_inputs([d])  # sent again (a resumed run logs its datasets again): MLflow keeps one
    assert w.pump()
    assert len(client.get_run(rid).inputs.dataset_inputs) == 1
    assert not Spool(spool_path(folder)).pending()


def _logged(rd: RunDir, uri: str, metrics: list[dict], evals: dict[int, float], inputs=None, tags=None):
    """A run folder and its MLflow run, as training leaves them (log.jsonl at step t + 1, eval.jsonl at t)."""
    rd.path.mkdir(parents=True)
    rd.config.write_text(config_from_dict({"es": {"updates": len(metrics)}}).to_yaml())
    for t, m in enumerate(metrics):
        rd.append_update({"t": t, "metrics": m})
    for t, acc in evals.items():
        rd.append_eval({"t": t, "heldout/accuracy": acc})
    tr = MLflowTracker(uri, "cmp", rd.path.parent / "art", spool_path(rd.path))
    rid = tr.start(rd.path.name, {"es.sigma": 0.01}, tags or {})
    for t, m in enumerate(metrics):
        tr.log_metrics(m, step=t + 1)
    for t, acc in evals.items():
        tr.log_metrics({"heldout/accuracy": acc}, step=t)
    if inputs:
        tr.log_inputs(inputs)
    tr.end("FINISHED")
    rd.write_meta(status="finished", done=len(metrics), total_updates=len(metrics), mlflow_run_id=rid, tracking_uri=uri)
    return rid


def test_aggregate_publishes_the_compare_view_and_a_pipelines_joined_curves_once(tmp_path):
    sd = SweepDir(tmp_path / "cmp")
    uri = f"sqlite:///{sd.path / 'mlflow.db'}"
    source = tmp_path / "cmp.yaml"
    source.write_text(yaml.safe_dump({"name": "cmp", "methods": {"ES": {}, "ES->GRPO": {}}}))
    runs = [
        {"key": "es", "label": "method=ES", "index": 0, "point": {"method": "ES"}},
        {"key": "pipe", "label": "method=ES->GRPO", "index": 1, "point": {"method": "ES->GRPO"}},
    ]
    sd.plan.mkdir(parents=True)
    for r in runs:
        sd.plan_path(r["key"]).write_text(config_from_dict({"es": {"updates": 4}}).to_yaml())
    with sd.locked() as m:
        m.update(name="cmp", source=str(source), tracking="online", tracking_uri=uri, experiment="cmp", runs=runs)
    parent = sd.ensure_parent_run()
    train = dataset_input("digits-train", ROWS, dataset_source(generator={"task": "digits"}), "train", "training")
    held = dataset_input("digits-heldout", ROWS[:1], dataset_source(generator={"task": "digits"}), "heldout", "eval")
    kid = {"mlflow.parentRunId": parent, "esbatch.sweep": "cmp"}
    rewards = [{"reward/mean": 0.1 * t, "update/flops": 1e9} for t in range(4)]
    _logged(sd.run_dir("es"), uri, rewards, {0: 0.25, 4: 0.5}, [train, held], {**kid, "esbatch.run_key": "es"})
    pipe = sd.run_dir("pipe")
    pipe.path.mkdir(parents=True)
    pipe.config.write_text(sd.plan_path("pipe").read_text())
    tr = MLflowTracker(uri, "cmp", sd.path / "art", spool_path(pipe.path))
    pid = tr.start("method=ES->GRPO", {}, {**kid, "esbatch.run_key": "pipe", "method": "ES->GRPO"})
    tr.end("FINISHED")  # a pipeline's own run: no metrics (its stages log them)
    pipe.write_meta(
        algorithm="pipeline", status="finished", done=4, total_updates=4, mlflow_run_id=pid, tracking_uri=uri
    )
    stage = {"mlflow.parentRunId": pid}
    _logged(pipe.stage(1, "es"), uri, [{"reward/mean": 0.2}, {"reward/mean": 0.3}], {0: 0.25, 2: 0.5}, [train], stage)
    _logged(pipe.stage(2, "grpo"), uri, [{"reward/mean": 0.6}, {"reward/mean": 0.7}], {0: 0.9, 2: 0.75}, [held], stage)

    out = aggregate(sd.path)
    client = MlflowClient(uri)
    # the pipeline's run: the stages' curves on its update axis (stage 2 starts at step 2; at step 2 both stages
    # scored the same weights, stage 1's score is kept), under the names an ES run logs
    reward = {m.step: m.value for m in client.get_metric_history(pid, "reward/mean")}
    assert reward == {1: 0.2, 2: 0.3, 3: 0.6, 4: 0.7}
    held_acc = {m.step: m.value for m in client.get_metric_history(pid, "heldout/accuracy")}
    assert held_acc == {0: 0.25, 2: 0.5, 4: 0.75}
    assert set(inputs_of(client, pid)) == {("digits-train", digest(ROWS)), ("digits-heldout", digest(ROWS[:1]))}

    # the parent run: every file of results/, the sweep file and sweep.json
    def listed(path=""):
        found = []
        for f in client.list_artifacts(parent, path):
            found += listed(f.path) if f.is_dir else [f.path]
        return found

    arts = set(listed())
    assert {f"results/{p.relative_to(out)}" for p in out.rglob("*") if p.is_file()} <= arts
    assert any(a.endswith(".png") for a in arts) and "results/README.md" in arts
    assert {"sweep/cmp.yaml", "sweep/sweep.json"} <= arts
    # the saved view: the runs grouped by the sweep's own key, the first charts reward and held-out accuracy
    exp = client.get_experiment_by_name("cmp")
    view = json.loads(exp.tags[VIEW_TAG])
    assert view["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "method"}]
    assert [c["metricKey"] for c in view["compareRunCharts"]] == ["reward/mean", "heldout/accuracy"]
    assert client.get_run(parent).data.tags["esbatch.compare_view"] == VIEW_KEY
    assert client.get_run(parent).info.status == "FINISHED"

    aggregate(sd.path)  # again: nothing is added twice
    assert len(client.get_metric_history(pid, "reward/mean")) == 4
    assert len(client.get_run(pid).inputs.dataset_inputs) == 2
    assert not Spool(spool_path(pipe.path)).pending() and not Spool(sd.path / "tracking.pending.jsonl").pending()
