"""Merging an offline run's store into the sweep's (esbatch/tracking/merge.py), pinned where planted faults
survived tests/unit/test_faults_merge.py (issue 44 D6, mutmut 3.8.1): the tags kept, the child's name and start,
params and metrics in MLflow's batch sizes, each new point once, the artifacts' root and the status. The two
stores are stand-ins that log every call (no MLflow store is opened)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from esbatch.tracking import merge


class Src:
    def __init__(self, status="FINISHED", n_params=3, history=None, tags=None) -> None:
        self.run = SimpleNamespace(
            info=SimpleNamespace(run_name="lr=0.1", start_time=111, end_time=999, status=status),
            data=SimpleNamespace(
                tags=tags
                if tags is not None
                else {"mlflow.runName": "lr=0.1", "mlflow.user": "u", "mlflow.source.name": "s", "esbatch.k": "v"},
                params={f"p{i:03d}": str(i) for i in range(n_params)},
                metrics={k: 0.0 for k in (history or {})},
            ),
        )
        self.history = history or {}
        self.calls: list[tuple] = []

    def get_run(self, rid):
        self.calls.append(("get_run", rid))
        return self.run

    def get_metric_history(self, rid, name):
        self.calls.append(("history", rid, name))
        return [SimpleNamespace(step=s, timestamp=t, value=v) for s, t, v in self.history[name]]

    def download_artifacts(self, rid, path, dst):
        self.calls.append(("download_artifacts", rid, path))
        out = Path(dst) / "art"
        out.mkdir()
        return str(out)


class Dst:
    def __init__(self, existing=None, history=None) -> None:
        self.existing, self.history = existing, history or {}
        self.calls: list[tuple] = []

    def search_runs(self, exps, filter_string, max_results):
        self.calls.append(("search_runs", exps, filter_string, max_results))
        return [self.existing] if self.existing else []

    def create_run(self, experiment_id, **kw):
        self.calls.append(("create_run", experiment_id, kw))
        return SimpleNamespace(info=SimpleNamespace(run_id="new"))

    def log_batch(self, rid, metrics=None, params=None, tags=None):
        if params is not None:
            self.calls.append(("params", rid, [(p.key, p.value) for p in params]))
        if tags is not None:
            self.calls.append(("tags", rid, sorted((t.key, t.value) for t in tags)))
        if metrics is not None:
            self.calls.append(("metrics", rid, [(m.key, m.value, m.timestamp, m.step) for m in metrics]))

    def get_metric_history(self, rid, name):
        self.calls.append(("history", rid, name))
        return [SimpleNamespace(step=s, timestamp=t) for s, t in self.history.get(name, [])]

    def log_artifacts(self, rid, local):
        self.calls.append(("log_artifacts", rid, Path(local).name))

    def set_terminated(self, rid, status, end_time):
        self.calls.append(("set_terminated", rid, status, end_time))

    def update_run(self, rid, status):
        self.calls.append(("update_run", rid, status))


@pytest.fixture
def stores(monkeypatch):
    made: dict[str, object] = {}
    locks: list[str] = []

    def client(tracking_uri):
        return made[tracking_uri]

    @contextlib.contextmanager
    def lock(uri):
        locks.append(uri)
        yield

    monkeypatch.setattr("mlflow.tracking.MlflowClient", client)
    monkeypatch.setattr(merge, "sqlite_lock", lock)
    return made, locks


def kinds(dst, kind):
    return [c for c in dst.calls if c[0] == kind]


def test_a_new_child_gets_the_runs_name_start_kept_tags_params_metrics_artifacts_and_end(stores):
    made, locks = stores
    hist = {"loss": [(1, 10, 0.5), (2, 20, 0.25)]}
    made["src"], made["dst"] = Src(n_params=250, history=hist), Dst()
    dst_id, added = merge.merge_run("src", "run-a", "dst", "exp1", "parent", "sw", "key1")
    dst = made["dst"]
    assert (dst_id, added) == ("new", 2) and locks == ["dst"]
    assert made["src"].calls == [
        ("get_run", "run-a"),
        ("history", "run-a", "loss"),
        ("download_artifacts", "run-a", ""),
    ]
    assert dst.calls[0] == (
        "search_runs",
        ["exp1"],
        "tags.`esbatch.sweep` = 'sw' and tags.`esbatch.run_key` = 'key1'",
        5,
    )
    (create,) = kinds(dst, "create_run")
    assert create == (
        "create_run",
        "exp1",
        {
            "run_name": "lr=0.1",
            "tags": {"mlflow.runName": "lr=0.1", "esbatch.k": "v", "mlflow.parentRunId": "parent"},
            "start_time": 111,
        },
    )
    assert [(c[1], len(c[2])) for c in kinds(dst, "params")] == [("new", 100), ("new", 100), ("new", 50)]
    assert [p for c in kinds(dst, "params") for p in c[2]] == [(f"p{i:03d}", str(i)) for i in range(250)]
    assert kinds(dst, "history") == []  # a new child has no points to read
    assert kinds(dst, "metrics") == [("metrics", "new", [("loss", 0.5, 10, 1), ("loss", 0.25, 20, 2)])]
    assert made["src"].calls[-1] == ("download_artifacts", "run-a", "")
    assert kinds(dst, "log_artifacts") == [("log_artifacts", "new", "art")]
    assert dst.calls[-1] == ("set_terminated", "new", "FINISHED", 999)
    assert kinds(dst, "tags") == [] and kinds(dst, "update_run") == []


def test_a_run_without_a_parent_gets_no_parent_tag(stores):
    made, _ = stores
    made["src"], made["dst"] = Src(n_params=0), Dst()
    merge.merge_run("src", "a", "dst", "e", None, "sw", "k")
    (create,) = kinds(made["dst"], "create_run")
    assert create[2]["tags"] == {"mlflow.runName": "lr=0.1", "esbatch.k": "v"}
    assert kinds(made["dst"], "params") == []


def test_tags_kept_are_esbatchs_and_the_run_name_only(stores):
    made, _ = stores
    tags = {"mlflow.runName": "n", "mlflow.x": "1", "MLFLOW.y": "2", "mlflow.runname": "3", "other": "4"}
    made["src"], made["dst"] = Src(tags=tags), Dst()
    merge.merge_run("src", "a", "dst", "e", None, "sw", "k")
    assert kinds(made["dst"], "create_run")[0][2]["tags"] == {"mlflow.runName": "n", "MLFLOW.y": "2", "other": "4"}


@pytest.mark.parametrize("status", ["FINISHED", "FAILED", "KILLED"])
def test_a_finished_run_ends_its_child_with_its_status_and_end(stores, status):
    made, _ = stores
    made["src"], made["dst"] = Src(status=status), Dst()
    merge.merge_run("src", "a", "dst", "e", None, "sw", "k")
    assert made["dst"].calls[-1] == ("set_terminated", "new", status, 999)


@pytest.mark.parametrize("status", ["RUNNING", "SCHEDULED", "finished"])
def test_a_run_not_ended_sets_its_childs_status(stores, status):
    made, _ = stores
    made["src"], made["dst"] = Src(status=status), Dst()
    merge.merge_run("src", "a", "dst", "e", None, "sw", "k")
    assert made["dst"].calls[-1] == ("update_run", "new", status)
    assert kinds(made["dst"], "set_terminated") == []


def test_merging_again_adds_only_new_points_to_the_same_child(stores):
    made, locks = stores
    existing = SimpleNamespace(info=SimpleNamespace(run_id="old-child"))
    hist = {"loss": [(1, 10, 0.5), (2, 20, 0.25), (2, 21, 0.2)], "acc": [(1, 10, 1.0)]}
    made["src"] = Src(history=hist)
    made["dst"] = Dst(existing=existing, history={"loss": [(1, 10), (2, 20)], "acc": [(1, 10)]})
    dst_id, added = merge.merge_run("src", "a", "dst", "e", "p", "sw", "k")
    dst = made["dst"]
    assert (dst_id, added) == ("old-child", 1)
    assert kinds(dst, "create_run") == [] and kinds(dst, "params") == []
    assert kinds(dst, "tags") == [
        ("tags", "old-child", [("esbatch.k", "v"), ("mlflow.parentRunId", "p"), ("mlflow.runName", "lr=0.1")])
    ]
    assert kinds(dst, "history") == [("history", "old-child", "loss"), ("history", "old-child", "acc")]
    assert kinds(dst, "metrics") == [("metrics", "old-child", [("loss", 0.2, 21, 2)])]  # none for acc: no call
    assert dst.calls[-1] == ("set_terminated", "old-child", "FINISHED", 999)


def test_metric_points_go_in_batches_of_a_thousand(stores):
    made, _ = stores
    made["src"], made["dst"] = Src(history={"m": [(s, s, float(s)) for s in range(2500)]}), Dst()
    _, added = merge.merge_run("src", "a", "dst", "e", None, "sw", "k")
    batches = kinds(made["dst"], "metrics")
    assert added == 2500 and [len(b[2]) for b in batches] == [1000, 1000, 500]
    assert [p[3] for b in batches for p in b[2]] == list(range(2500))


def test_find_child_asks_for_the_sweeps_run_key(stores):
    dst = Dst(existing=SimpleNamespace(info=SimpleNamespace(run_id="c")))
    assert merge.find_child(dst, "e7", "sw1", "k9").info.run_id == "c"
    assert dst.calls == [("search_runs", ["e7"], "tags.`esbatch.sweep` = 'sw1' and tags.`esbatch.run_key` = 'k9'", 5)]
    assert merge.find_child(Dst(), "e7", "sw1", "k9") is None
