"""`status`, `sweep` and `aggregate` say the same about run folders that are not as planned (damaged, gone after
their local task started, from an earlier grid) while MLflow says FINISHED for each: moved from
tests/unit/test_faults_sweep_state.py (issue 40: it opens an MLflow store and aggregates, seconds), on the same
folders (its ``sweep_with_table`` fixture)."""

import io

from toy import LauncherDouble
from unit.test_faults_sweep_state import sweep_with_table  # noqa: F401, F811 - the fixture

from esbatch.launch import submit
from esbatch.launch.submit import run_states, submit_sweep


def test_status_sweep_and_aggregate_say_the_same_about_folders_not_as_planned(sweep_with_table, monkeypatch, capsys):  # noqa: F811
    """Damaged folders (each with its reason), a folder gone after its local task started (missing, never
    finished, whatever MLflow holds), and folders no longer in the grid: the same lines from `status`, `sweep`
    and `aggregate`."""
    from mlflow.tracking import MlflowClient

    from esbatch.aggregate.collect import collect
    from esbatch.cli import main
    from esbatch.launch.submit import folder_notes

    sw, sd, keys = sweep_with_table
    gone = keys["new"]
    with sd.locked() as m:  # the run "new" started under a local launcher whose task is gone (pid 1: not ours)
        m["submissions"].append({"kind": "local", "job_id": "local-1", "keys": [gone], "pids": {gone: 2**22 + 1}})
    (sd.runs / "0123abcd").mkdir(parents=True)  # a run of an earlier grid
    meta = sd.read()
    client = MlflowClient(meta["tracking_uri"])
    exp = client.get_experiment_by_name(meta["experiment"]) or client.get_experiment(
        client.create_experiment(meta["experiment"])
    )
    for name in ("new", "damaged", "folder-is-a-file", "log-without-config"):  # MLflow says FINISHED for each
        run = client.create_run(exp.experiment_id, tags={"esbatch.sweep": meta["name"], "esbatch.run_key": keys[name]})
        client.set_terminated(run.info.run_id, "FINISHED")

    states = run_states(sd)
    by_key = {s.key: s.state for s in states}
    assert by_key[gone] == "missing"
    notes = folder_notes(sd, states)
    assert len(notes) == 5 and sum(n.startswith("damaged, not resubmitted: ") for n in notes) == 3
    assert f"missing: {sd.run_dir(gone).path} is gone" in notes[3]
    assert "not in the grid any more" in notes[4] and "0123abcd" in notes[4]
    assert "not a folder" in notes[0] + notes[1] + notes[2] and "but no config.yaml" in " ".join(notes)

    assert main(["status", str(sd.path)]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in notes), out

    results = {r.key: r.status for r in collect(sd, states=states)}
    for name in ("damaged", "folder-is-a-file", "log-without-config"):
        assert results[keys[name]] == "damaged", name  # never MLflow's "finished"
    assert results[gone] == "missing"
    assert {k: v for k, v in results.items() if v == "finished"} == {keys["finished"]: "finished"} | {
        keys["finished-old-job-failed"]: "finished"
    }

    launcher = LauncherDouble()
    monkeypatch.setattr(submit, "launcher_for", lambda profile: launcher)
    out = io.StringIO()
    assert submit_sweep(sw, out=out) == 0
    assert all(n in out.getvalue() for n in notes), out.getvalue()
    assert gone in launcher.submitted[0]  # trained again
