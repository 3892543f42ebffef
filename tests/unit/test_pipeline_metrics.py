"""A pipeline run (ES->GRPO, GRPO->ES) reported like every other run, from hand-written run folders (no training).

Its stages log in ``<run>/stage<k>-<algorithm>/``; the pipeline folder keeps only run.json. ``folder_history``
joins the stages into one curve on the pipeline's update axis (stage k's step s at the earlier stages' budgets
+ s; at a stage boundary the earlier stage's point is kept), the pipeline's run.json keeps its newest stage's
``last_reward`` / ``last_heldout`` for `esbatch status`, and results/README.md does not list a finished pipeline
as needing attention.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from esbatch.aggregate.collect import folder_history
from esbatch.config import config_from_dict
from esbatch.launch.state import disk_state
from esbatch.pipeline import stage_scores
from esbatch.train.rundir import RunDir

ENTROPY = "eval/GPQA/entropy"
HELDOUT = "heldout/accuracy"


def pipeline_plan(updates: int = 5, split: list[int] | None = None, **extra: Any) -> Any:
    split = split or [3, 2]
    return config_from_dict(
        {
            "algorithm": "pipeline",
            "pipeline": {"stages": ["es", "grpo"], "updates": updates, "split": split},
            "es": {"batch_size": 4},
            "grpo": {"batch_size": 4},
            **extra,
        }
    )


def run_folder(path: Path, meta: dict[str, Any] | None) -> RunDir:
    """A run folder with a config.yaml and, unless ``meta`` is None, a run.json holding ``meta``."""
    rd = RunDir(path)
    rd.path.mkdir(parents=True)
    rd.config.write_text("x: 1\n")
    if meta is not None:
        rd.write_meta(**meta)
    return rd


def stage(
    pipe: RunDir, k: int, algo: str, rewards: list[float], evals: list[dict[str, Any]], meta: dict[str, Any] | None
) -> RunDir:
    """Stage k of ``pipe`` as its trainer leaves it: one update record per reward, the held-out evals, run.json."""
    st = run_folder(pipe.stage(k, algo).path, meta)
    for t, r in enumerate(rewards):
        st.append_update({"t": t, "metrics": {"reward/mean": r}})
    for e in evals:
        st.append_eval(e)
    return st


def finished_pipeline(pipe: RunDir) -> None:
    """ES for 3 updates then GRPO for 2, each evaluated at its step 0 and at its end."""
    stage(
        pipe,
        1,
        "es",
        [0.1, 0.2, 0.3],
        [{"t": 0, HELDOUT: 0.2, ENTROPY: 1.0}, {"t": 3, HELDOUT: 0.4, ENTROPY: 0.8}],
        {"status": "finished", "total_updates": 3, "done": 3, "last_reward": 0.3, "last_heldout": 0.4},
    )
    stage(  # its step-0 eval scores the ES stage's final weights again (another sample: 0.41, not 0.4)
        pipe,
        2,
        "grpo",
        [0.5, 0.6],
        [{"t": 0, HELDOUT: 0.41, ENTROPY: 0.79}, {"t": 2, HELDOUT: 0.6, ENTROPY: 0.5}],
        {"status": "finished", "total_updates": 2, "done": 2, "last_reward": 0.6, "last_heldout": 0.6},
    )


# ----------------------------------------------------------------------------- the joined curve


def test_stages_join_into_one_curve_and_the_earlier_stage_keeps_the_boundary(tmp_path):
    pipe = run_folder(tmp_path / "p", {"status": "finished", "total_updates": 5, "done": 5})
    finished_pipeline(pipe)
    hist = folder_history(pipe)
    # updates at t + 1: ES's t = 0..2 at 1..3, GRPO's t = 0..1 at 3 + 1..2
    assert hist["reward/mean"] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.5), (5, 0.6)]
    # evals at t: the boundary step 3 holds the ES stage's final eval, not GRPO's step-0 eval of the same weights
    assert hist[HELDOUT] == [(0, 0.2), (3, 0.4), (5, 0.6)]
    assert hist[ENTROPY] == [(0, 1.0), (3, 0.8), (5, 0.5)]


def test_a_boundary_only_the_later_stage_evaluated_keeps_its_point(tmp_path):
    pipe = run_folder(tmp_path / "p", {"status": "finished", "total_updates": 4, "done": 4})
    stage(pipe, 1, "es", [0.1, 0.2], [{"t": 0, HELDOUT: 0.2}], {"status": "finished", "total_updates": 2})
    stage(pipe, 2, "grpo", [0.5, 0.6], [{"t": 0, HELDOUT: 0.3}], {"status": "finished", "total_updates": 2})
    assert folder_history(pipe)[HELDOUT] == [(0, 0.2), (2, 0.3)]


def test_metrics_of_the_pipeline_folder_itself_are_kept(tmp_path):
    pipe = run_folder(tmp_path / "p", {"status": "finished", "total_updates": 5, "done": 5})
    finished_pipeline(pipe)
    pipe.append_eval({"t": 5, HELDOUT: 0.99, "final/score": 0.7})  # a step the stages hold keeps the stage's
    hist = folder_history(pipe)
    assert hist["final/score"] == [(5, 0.7)]
    assert hist[HELDOUT][-1] == (5, 0.6)


def test_a_stage_stopped_half_way_ends_the_curve_there(tmp_path):
    pipe = run_folder(tmp_path / "p", {"status": "killed", "total_updates": 6, "done": 2})
    stage(pipe, 1, "es", [0.1, 0.2], [{"t": 0, HELDOUT: 0.2}], {"status": "killed", "total_updates": 4, "done": 2})
    hist = folder_history(pipe)
    assert hist["reward/mean"] == [(1, 0.1), (2, 0.2)]
    assert hist[HELDOUT] == [(0, 0.2)]


def test_the_next_stage_starts_at_the_earlier_ones_budget_not_at_what_they_logged(tmp_path):
    """A stage whose log holds fewer updates than its budget (lines moved to log.discarded.jsonl) still takes
    its whole budget on the pipeline's axis, as the pipeline's own count does; a stage without a recorded budget
    counts the updates it logged."""
    pipe = run_folder(tmp_path / "p", {"status": "running", "total_updates": 6})
    stage(pipe, 1, "es", [0.1, 0.2], [], {"status": "finished", "total_updates": 4})
    stage(pipe, 2, "grpo", [0.5], [{"t": 0, HELDOUT: 0.3}], {"status": "running"})
    assert folder_history(pipe)["reward/mean"] == [(1, 0.1), (2, 0.2), (5, 0.5)]
    assert folder_history(pipe)[HELDOUT] == [(4, 0.3)]
    assert [st.stage_budget() for st in pipe.stages()] == [4, 1]
    (pipe.path / "stage1-es" / "run.json").write_text(json.dumps({"status": "finished"}))
    assert folder_history(pipe)["reward/mean"] == [(1, 0.1), (2, 0.2), (3, 0.5)]


def test_stages_are_ordered_by_their_number_not_their_name(tmp_path):
    pipe = run_folder(tmp_path / "p", {"status": "running"})
    for k in (10, 2, 1):
        run_folder(pipe.stage(k, "es").path, {})
    (pipe.path / "stage3-es.yaml").write_text("x: 1\n")  # the stage's config next to the folders: not a stage
    assert [st.path.name for st in pipe.stages()] == ["stage1-es", "stage2-es", "stage10-es"]


def test_a_pipeline_without_stages_yet(tmp_path):
    pipe = run_folder(tmp_path / "p", {"status": "running", "total_updates": 5, "done": 0})
    assert pipe.stages() == [] and folder_history(pipe) == {}
    assert disk_state(pipe, pipeline_plan()) == ("running", 0, 5, None, None)


def test_an_ordinary_run_is_read_as_before(tmp_path):
    rd = stage(RunDir(tmp_path), 1, "es", [0.1, 0.2], [{"t": 2, HELDOUT: 0.5}], {"status": "finished"})
    assert folder_history(rd) == {"reward/mean": [(1, 0.1), (2, 0.2)], HELDOUT: [(2, 0.5)]}


# ----------------------------------------------------------------------------- `esbatch status`


def test_the_pipeline_keeps_its_newest_stages_scores(tmp_path):
    pipe = run_folder(tmp_path / "p", {})
    finished_pipeline(pipe)
    assert stage_scores(pipe.stage(2, "grpo")) == {"last_reward": 0.6, "last_heldout": 0.6}
    st = run_folder(tmp_path / "fresh", {"status": "running", "last_reward": None})
    assert stage_scores(st) == {}  # nothing logged yet: the pipeline keeps the previous stage's scores
    assert stage_scores(RunDir(tmp_path / "none")) == {}


def test_status_reads_a_pipelines_reward_and_heldout(tmp_path):
    pipe = run_folder(tmp_path / "p", {"status": "finished", "total_updates": 5, "done": 5, "last_reward": 0.6})
    finished_pipeline(pipe)
    pipe.write_meta(last_heldout=0.6)
    assert disk_state(pipe, pipeline_plan()) == ("finished", 5, 5, 0.6, 0.6)


@pytest.mark.parametrize(
    "stage2, want",
    [
        ({"status": "finished", "total_updates": 2, "last_reward": 0.6, "last_heldout": 0.55}, (0.6, 0.55)),
        ({"status": "finished", "total_updates": 2, "last_reward": 0.6}, (0.6, 0.4)),  # no held-out: stage 1's
        ({"status": "running", "total_updates": 2}, (0.3, 0.4)),  # nothing logged yet: stage 1's
        ("damaged", (0.3, 0.4)),
    ],
)
def test_a_pipeline_from_before_run_json_kept_scores_reads_its_stages(tmp_path, stage2, want):
    pipe = run_folder(tmp_path / "p", {"status": "running", "total_updates": 5, "done": 3})
    stage(pipe, 1, "es", [0.1, 0.2, 0.3], [], {"status": "finished", "last_reward": 0.3, "last_heldout": 0.4})
    st = run_folder(pipe.stage(2, "grpo").path, None)
    if stage2 == "damaged":
        st.meta.write_text("{not json")
    else:
        st.write_meta(**stage2)
    assert disk_state(pipe, pipeline_plan())[3:] == want


# ----------------------------------------------------------------------------- a sweep: status, curves, README


def sweep_with_a_pipeline(tmp_path: Path, aggregate: list[dict[str, Any]]) -> Any:
    """A sweep of an ES run (logged to MLflow, like logged_sweep in test_aggregate.py) and an ES->GRPO pipeline
    whose stages are on disk, finished: its task runs the real Pipeline.run, which trains nothing."""
    from esbatch.launch.state import SweepDir
    from esbatch.tracking import MLflowTracker

    sd = SweepDir(tmp_path / "sweep")
    uri = f"sqlite:///{sd.path / 'mlflow.db'}"
    where = {"run": {"output_dir": str(sd.runs)}, "tracking": {"uri": uri, "experiment": "t"}}
    plans = {
        "es": config_from_dict({"es": {"updates": 5, "batch_size": 4}, **where}),
        "es-grpo": pipeline_plan(**where),
    }
    sd.plan.mkdir(parents=True)
    for key, plan in plans.items():
        plan.run.name = key
        sd.plan_path(key).write_text(plan.to_yaml())
    with sd.locked() as m:
        m.update(name="t", tracking="online", tracking_uri=uri, experiment="t", aggregate=aggregate)
        m["runs"] = [{"key": k, "label": k, "index": i, "point": {"method": k}} for i, k in enumerate(plans)]
    es = run_folder(sd.run_dir("es").path, {"status": "finished", "total_updates": 5, "done": 5, "last_reward": 0.5})
    tr = MLflowTracker(uri, "t", sd.path / "mlartifacts")
    tr.start("es", {"es.updates": 5}, {"esbatch.sweep": "t", "esbatch.run_key": "es"})
    for t in range(5):
        es.append_update({"t": t, "metrics": {"reward/mean": 0.1 * t}})
        tr.log_metrics({"reward/mean": 0.1 * t}, step=t + 1)
    for t in (0, 5):
        tr.log_metrics({ENTROPY: 1.0 - 0.1 * t}, step=t)
    tr.end("FINISHED")
    pipe = RunDir(sd.run_dir("es-grpo").path)
    finished_pipeline(pipe)
    pipe.stage(2, "grpo").center.write_bytes(b"the GRPO stage's weights")
    return sd


def test_a_finished_pipeline_reads_like_every_other_run_in_a_sweep(tmp_path):
    from esbatch.aggregate.collect import aggregate, collect
    from esbatch.launch.submit import run_states
    from esbatch.launch.task import run_task

    fig2a = {"kind": "curves", "name": "fig2a", "metric": ENTROPY, "hue": "method", "smoothing": 0.0}
    sd = sweep_with_a_pipeline(tmp_path, [fig2a])
    summary = run_task(sd.path, "es-grpo")  # both stages finished: skipped, their scores kept in run.json
    assert [s["name"] for s in summary["stages"]] == ["stage1-es", "stage2-grpo"]
    meta = sd.run_dir("es-grpo").read_meta()
    assert (meta["status"], meta["done"], meta["last_reward"], meta["last_heldout"]) == ("finished", 5, 0.6, 0.6)
    states = {s.key: s for s in run_states(sd)}
    assert (states["es-grpo"].state, states["es-grpo"].last_reward, states["es-grpo"].heldout) == (
        "finished",
        0.6,
        0.6,
    )
    runs = {r.key: r for r in collect(sd)}  # the pipeline's MLflow run has no metrics: its folder's curve
    assert runs["es-grpo"].history["reward/mean"] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.5), (5, 0.6)]
    assert runs["es-grpo"].history[ENTROPY] == [(0, 1.0), (3, 0.8), (5, 0.5)]
    assert runs["es"].history[ENTROPY] == [(0, 1.0), (5, 0.5)]  # the ES run: from MLflow, as before
    out = aggregate(sd.path)
    readme = (out / "README.md").read_text()
    assert "None: all 2 runs finished their budget with every analysed metric logged." in readme
    with (out / "fig2a.csv").open(newline="") as f:
        lines = {(r["method"], int(r["step"])) for r in csv.DictReader(f)}
    assert lines == {("es", 0), ("es", 5), ("es-grpo", 0), ("es-grpo", 3), ("es-grpo", 5)}
