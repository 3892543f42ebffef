"""The pieces of the MLflow compare view (issue 43) that are pure logic: the problems' digest, a dataset input as the
spool keeps it, the sweep's keys as tags, the saved view, a pipeline's joined records, and how the spool sends
its new record kinds (a stand-in client: tests/integration/test_mlflow_compare_store.py uses a real store)."""

import hashlib
import json

from esbatch.aggregate.mlflow_view import FIRST_CHARTS, compare_view, group_keys, pipeline_records, view_path
from esbatch.tracking import dataset_input, dataset_source, point_tags, problems_digest
from esbatch.tracking.spool import send

ROWS = [("Wie viel ist 12+30?", "42"), ("7+8", "15")]


def test_the_digest_is_sha256_of_the_problems_in_order():
    text = '[["Wie viel ist 12+30?","42"],["7+8","15"]]'
    assert problems_digest(ROWS) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert problems_digest(ROWS[::-1]) != problems_digest(ROWS)  # another order is another dataset
    assert problems_digest([("12+30é", "42")]) == hashlib.sha256('[["12+30é","42"]]'.encode()).hexdigest()[:16]


def test_a_dataset_input_names_its_source_size_split_and_context():
    d = dataset_input(
        "gsm8k-heldout", ROWS, dataset_source(hub_id="openai/gsm8k", hub_config="main"), "heldout", "eval"
    )
    ds = d["dataset"]
    assert ds["name"] == "gsm8k-heldout" and ds["digest"] == problems_digest(ROWS)
    assert ds["source_type"] == "hugging_face"
    assert json.loads(ds["source"])["path"] == "openai/gsm8k" and json.loads(ds["source"])["config_name"] == "main"
    assert json.loads(ds["profile"]) == {"num_rows": 2, "num_elements": 4}
    assert [c["name"] for c in json.loads(ds["schema"])["mlflow_colspec"]] == ["question", "answer"]
    assert d["tags"] == {"mlflow.data.context": "eval", "esbatch.split": "heldout"}
    assert all(isinstance(v, str) for v in ds.values())  # the spool's JSON line holds it as is
    local = dataset_input("f-train", ROWS, dataset_source(data_path="/data/problems.jsonl"), "train", "training")
    assert "/data/problems.jsonl" in local["dataset"]["source"]


def test_the_sweeps_keys_become_tags_named_as_in_the_sweep():
    assert point_tags({"es.population_size": 8, "method": "ES->GRPO"}) == {
        "es.population_size": "8",
        "method": "ES->GRPO",
    }


def test_the_compare_view_groups_by_the_keys_that_vary_and_charts_reward_and_heldout_first():
    runs = [{"point": {"es.population_size": n, "model.name": "smollm2"}} for n in (4, 8)]
    keys = group_keys(runs)
    assert keys == ["es.population_size"]  # the same model in every run: nothing to group by
    view = compare_view(keys, ["update/flops", "heldout/accuracy", "reward/mean"])
    assert view["groupBy"] == {
        "aggregateFunction": "average",
        "groupByKeys": [{"mode": "tag", "groupByData": "es.population_size"}],
    }
    assert [c["metricKey"] for c in view["compareRunCharts"]] == list(FIRST_CHARTS)
    assert {c["metricSectionId"] for c in view["compareRunCharts"]} == {s["uuid"] for s in view["compareRunSections"]}
    assert view["isAccordionReordered"] is True  # the UI keeps this section first
    assert "tags.`es.population_size`" in view["selectedColumns"] and "metrics.`reward/mean`" in view["selectedColumns"]
    methods = [
        {"point": {"method": "ES", "algorithm": "es"}},
        {"point": {"method": "ES->GRPO", "algorithm": "pipeline", "pipeline.stages": ["es", "grpo"]}},
    ]
    assert group_keys(methods) == ["method"]  # what a method sets is named by the method
    assert view["searchFilter"] == "tags.`esbatch.run_key` LIKE '%'"  # the sweep's runs, not stages or evals
    assert compare_view([], ["reward/mean"])["groupBy"] is None
    assert [c["metricKey"] for c in compare_view([], ["reward/mean"])["compareRunCharts"]] == ["reward/mean"]
    assert view_path("7") == "#/experiments/7?viewStateShareKey=esbatch-compare"


def test_a_pipelines_records_are_one_per_step_and_its_datasets_once():
    d = dataset_input("t-train", ROWS, dataset_source(generator={"task": "t"}), "train", "training")
    hist = {"reward/mean": [(1, 0.2), (2, 0.3)], "heldout/accuracy": [(0, 0.25), (2, 0.5)]}
    recs = pipeline_records("r1", "sqlite:///x.db", hist, [d, d])
    assert [(r.get("step"), r.get("metrics")) for r in recs[:-1]] == [
        (0, {"heldout/accuracy": 0.25}),
        (1, {"reward/mean": 0.2}),
        (2, {"reward/mean": 0.3, "heldout/accuracy": 0.5}),
    ]
    assert recs[-1]["inputs"] == [d] and {r["run_id"] for r in recs} == {"r1"}


class Client:
    """What the spool calls, recorded."""

    def __init__(self):
        self.calls = []

    def get_run(self, rid):
        class Info:
            lifecycle_stage, experiment_id = "active", "5"

        class Run:
            info = Info()

        return Run()

    def log_inputs(self, rid, datasets):
        self.calls.append(("inputs", rid, [(d.dataset.name, d.dataset.digest, len(d.tags)) for d in datasets]))

    def log_batch(self, rid, metrics=(), tags=()):
        self.calls.append(("batch", rid, [(t.key, t.value) for t in tags], len(metrics)))

    def set_experiment_tag(self, exp, k, v):
        self.calls.append(("exp_tag", exp, k, v))


def test_the_spool_sends_dataset_inputs_run_tags_and_experiment_tags():
    d = dataset_input("t-train", ROWS, dataset_source(generator={"task": "t"}), "train", "training")
    c = Client()
    recs = [
        {"run_id": "r", "time": 1, "inputs": [d]},
        {"run_id": "r", "time": 1, "tags": {"esbatch.compare_view": "esbatch-compare"}},
        {"run_id": "r", "time": 1, "experiment_tags": {"mlflow.sharedViewState.k": "{}"}},
    ]
    assert send(c, recs) == 0  # no metric points
    assert c.calls == [
        ("inputs", "r", [("t-train", problems_digest(ROWS), 2)]),
        ("batch", "r", [("esbatch.compare_view", "esbatch-compare")], 0),
        ("exp_tag", "5", "mlflow.sharedViewState.k", "{}"),
    ]
