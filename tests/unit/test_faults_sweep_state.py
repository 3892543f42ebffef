"""Which runs `esbatch sweep` submits again, table-driven: hand-made run folders (run.json) and hand-picked
scheduler states, through the real disk_state / combine / run_states / submit_sweep with a launcher double.

The rule (esbatch/launch/submit.py): finished, queued, running and damaged runs are left alone; everything else
(never started, interrupted, failed, cancelled, timed out, finished under a budget that has since been raised)
is submitted again and continues from its folder.
"""

import io
import json

import pytest
import yaml
from toy import LauncherDouble

from esbatch.launch import submit
from esbatch.launch.state import combine, disk_state
from esbatch.launch.submit import dry_run, run_states, submit_sweep, write_plan
from esbatch.launch.sweep import load_sweep

BUDGET = 8  # the plan's es.updates

# name: (run.json written into the run folder, or None: no folder / "damaged": not JSON;
#        scheduler state of its newest submission (None: unknown to the scheduler);
#        expected state, expected updates done, submitted again?)
TABLE = {
    "new": (None, None, "pending", 0, True),
    "new-queued": (None, "PENDING", "queued", 0, False),
    "new-ended-before-start": (None, "COMPLETED", "failed", 0, True),
    "new-oom": (None, "OUT_OF_MEMORY", "out_of_memory", 0, True),
    "killed-queued": ({"status": "killed", "done": 3}, "PENDING", "queued", 3, False),
    "killed-requeued": ({"status": "killed", "done": 3}, "REQUEUED", "queued", 3, False),
    "killed-idle": ({"status": "killed", "done": 3}, None, "killed", 3, True),
    "running": ({"status": "running", "done": 2}, "RUNNING", "running", 2, False),
    "running-vanished": ({"status": "running", "done": 2}, None, "interrupted", 2, True),
    "running-cancelled": ({"status": "running", "done": 2}, "CANCELLED by 0", "cancelled", 2, True),
    "running-timeout": ({"status": "running", "done": 5}, "TIMEOUT", "timeout", 5, True),
    "failed": ({"status": "failed", "done": 1}, "FAILED", "failed", 1, True),
    "finished": ({"status": "finished", "done": BUDGET}, "COMPLETED", "finished", BUDGET, False),
    "finished-old-job-failed": ({"status": "finished", "done": BUDGET}, "FAILED", "finished", BUDGET, False),
    "finished-budget-raised": ({"status": "finished", "done": 4, "total_updates": 4}, None, "interrupted", 4, True),
    "finished-budget-raised-done-job": (
        {"status": "finished", "done": 4, "total_updates": 4},
        "COMPLETED",
        "interrupted",
        4,
        True,
    ),
    "finished-budget-raised-queued": ({"status": "finished", "done": 4}, "PENDING", "queued", 4, False),
    "damaged": ("damaged", None, "damaged", 0, False),
    "folder-is-a-file": ("file", None, "damaged", 0, False),
    "log-without-config": ("no-config", None, "damaged", 0, False),
    "task-starting": ("starting", "RUNNING", "queued", 0, False),  # .lock and task.log only: no config yet
}


class SchedulerDouble:
    def __init__(self, states):
        self.states_by_key = states

    def states(self, sd, submissions):
        return dict(self.states_by_key)


@pytest.fixture
def sweep_with_table(tmp_path, monkeypatch):
    return table_sweep(tmp_path, monkeypatch)


def table_sweep(tmp_path, monkeypatch, sched=None, **extra):
    """A sweep with one run per TABLE row (its folder and scheduler state as the row says); ``sched`` takes more
    scheduler states (of evals); ``extra`` goes into the sweep file (an evaluate phase)."""
    sw = load_sweep(str(write_spec(tmp_path, extra)))
    sd = write_plan(sw)
    keys = {name: r.key for name, r in zip(TABLE, sw.runs)}
    sched = dict(sched or {})
    for name, (meta, state, *_rest) in TABLE.items():
        rd = sd.run_dir(keys[name])
        if meta == "file":
            rd.path.parent.mkdir(parents=True, exist_ok=True)
            rd.path.write_text("not a folder")
        elif meta in ("no-config", "starting"):
            rd.path.mkdir(parents=True)
            (rd.path / ".lock").write_text("")
            (rd.path / "task.log").write_text("esbatch task: ...\n")
            if meta == "no-config":
                rd.log.write_text('{"t": 0}\n')
        elif meta is not None:
            rd.path.mkdir(parents=True)
            rd.config.write_text(sd.plan_path(keys[name]).read_text())
            rd.meta.write_text("{not json" if meta == "damaged" else json.dumps({**meta, "last_reward": 0.5}))
        if state is not None:
            sched[keys[name]] = state
    with sd.locked() as m:
        jobs = [*keys.values(), *(k for k in sched if k not in keys.values())]  # the runs, then evals given states
        m["submissions"] = [{"kind": "double", "job_id": "7", "keys": jobs, "time": "now"}]
    monkeypatch.setattr(submit, "_launcher", lambda kind: SchedulerDouble(sched))
    return sw, sd, keys


def test_run_states_table(sweep_with_table):
    _, sd, keys = sweep_with_table
    got = {s.key: s for s in run_states(sd)}
    for name, (_, sched, want, done, _) in TABLE.items():
        s = got[keys[name]]
        assert (s.state, s.done, s.scheduler) == (want, done, sched), name
        assert s.total == BUDGET, name  # the plan's budget, also where the run recorded a smaller one
        if sched is not None:
            assert s.job == f"7_{list(keys).index(name)}", name


def test_submit_sweep_resubmits_exactly_the_unfinished_and_inactive_runs(sweep_with_table, monkeypatch):
    sw, _, keys = sweep_with_table
    launcher = LauncherDouble()
    monkeypatch.setattr(submit, "launcher_for", lambda profile: launcher)
    out = io.StringIO()
    assert submit_sweep(sw, out=out) == 0
    want = [keys[name] for name, row in TABLE.items() if row[4]]
    assert launcher.submitted == [want]
    assert "damaged, not resubmitted" in out.getvalue()


def test_finished_run_reopens_when_its_plan_budget_grows(tmp_path):
    from esbatch.config import config_from_dict
    from esbatch.train.rundir import RunDir

    def plan(updates):
        return config_from_dict({"model": {"name": "nobody/no-model"}, "es": {"updates": updates}})

    rd = RunDir(tmp_path / "r")
    rd.path.mkdir()
    rd.config.write_text("x: 1\n")
    rd.write_meta(status="finished", done=4, total_updates=4, last_reward=0.25, last_heldout=0.5)
    assert disk_state(rd, plan(4)) == ("finished", 4, 4, 0.25, 0.5)
    assert disk_state(rd, plan(6)) == ("interrupted", 4, 6, 0.25, 0.5)
    assert disk_state(rd, plan(3)) == ("finished", 4, 3, 0.25, 0.5)  # a smaller budget does not undo updates
    assert disk_state(RunDir(tmp_path / "none"), plan(6)) == ("pending", 0, 6, None, None)


@pytest.mark.parametrize(
    "disk, sched, want",
    [
        (disk, sched, want)
        for disk in ("pending", "killed", "interrupted", "failed", "running")
        for sched, want in [
            ("PENDING", "queued"),
            ("REQUEUED", "queued"),
            ("CONFIGURING", "queued"),
            ("SUSPENDED", "queued"),
            ("COMPLETING", "queued"),
        ]
    ]
    + [
        ("killed", "RUNNING", "running"),
        ("interrupted", "RUNNING", "running"),
        ("pending", "RUNNING", "queued"),  # a job has started but no trainer has written the folder yet
        ("finished", "PENDING", "finished"),
        ("finished", None, "finished"),
        ("interrupted", None, "interrupted"),
        ("running", "COMPLETED", "interrupted"),
        ("running", "NODE_FAIL", "node_fail"),
        ("pending", "CANCELLED by 12", "cancelled"),
        ("damaged", None, "damaged"),
    ],
)
def test_combine_table(disk, sched, want):
    assert combine(disk, sched) == want
    assert (want in submit.DONE_OR_ACTIVE) == (want in ("finished", "queued", "running", "damaged"))


def _es_plan(**es):
    from esbatch.config import config_from_dict

    return config_from_dict({"model": {"name": "nobody/no-model"}, "es": {"batch_size": 4, **es}})


def _folder(path, meta):
    from esbatch.train.rundir import RunDir

    rd = RunDir(path)
    rd.path.mkdir(parents=True)
    rd.config.write_text("x: 1\n")
    rd.meta.write_text(json.dumps(meta))
    return rd


def test_epoch_budgets_come_from_the_training_set_size_the_run_recorded(tmp_path):
    from esbatch.train.rundir import RunDir

    plan = _es_plan(epochs=2.0)  # 10 problems, B = 4: ceil(10 / 4) = 3 updates per epoch -> 6
    rd = _folder(tmp_path / "a", {"status": "finished", "done": 6, "n_train": 10, "last_reward": 0.5})
    assert disk_state(rd, plan)[:3] == ("finished", 6, 6)
    rd = _folder(tmp_path / "b", {"status": "finished", "done": 3, "n_train": 10, "total_updates": 3})
    assert disk_state(rd, plan)[:3] == ("interrupted", 3, 6)
    rd = _folder(tmp_path / "c", {"status": "killed", "done": 1, "total_updates": 5})  # no n_train: the record
    assert disk_state(rd, plan)[:3] == ("killed", 1, 5)
    assert disk_state(RunDir(tmp_path / "none"), plan) == ("pending", 0, None, None, None)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.yaml").write_text("x: 1\n")
    (tmp_path / "d" / "run.json").write_text("[1, 2]")
    assert disk_state(RunDir(tmp_path / "d"), plan) == ("damaged", 0, None, None, None)


def test_folder_without_status_or_kept_scores_reads_them_from_the_logs(tmp_path):
    from esbatch.train.rundir import RunDir

    rd = RunDir(tmp_path / "old")
    rd.path.mkdir()
    rd.config.write_text("x: 1\n")
    for t, r in enumerate([0.1, 0.2, 0.3]):
        rd.append_update({"t": t, "metrics": {"reward/mean": r}})
    rd.append_eval({"t": 2, "heldout/accuracy": 0.5})
    rd.append_eval({"t": 0, "heldout/accuracy": 0.25})  # written late: the newest t counts, not the last line
    # no run.json at all: status running (an old folder), progress from the log
    assert disk_state(rd, _es_plan(updates=5)) == ("running", 3, 5, 0.3, 0.5)
    rd.write_meta(done=3)
    assert disk_state(rd, _es_plan(updates=5)) == ("running", 3, 5, 0.3, 0.5)
    fresh = _folder(tmp_path / "fresh", {"status": "killed", "done": 0})
    assert disk_state(fresh, _es_plan(updates=5)) == ("killed", 0, 5, None, None)


def test_sweep_folder_layout_and_damaged_sweep_record(tmp_path):
    from esbatch.launch.state import SweepDir, now
    from esbatch.train.rundir import RunFolderError

    sd = SweepDir(tmp_path)
    assert (sd.meta_path, sd.plan, sd.runs, sd.slurm, sd.results) == tuple(
        tmp_path / n for n in ("sweep.json", "plan", "runs", "slurm", "results")
    )
    assert sd.read() == {} and sd.last_submission() == {}
    sd.meta_path.write_text(json.dumps({"name": "t"}))
    assert sd.last_submission() == {}
    for text, why in [
        ("[1]", r"\(expected a JSON object, got list\)"),
        ('{"runs": 3}', r"\(its 'runs' is not a list\)"),
        ("{", r"\(Expecting property name enclosed in double quotes: line 1 column 2 \(char 1\)\)"),
    ]:
        sd.meta_path.write_text(text)
        with pytest.raises(RunFolderError, match=r"not a valid sweep record " + why + r"[\s\S]*cancel them first\)\.$"):
            sd.read()
    import re

    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}", now())


def test_a_runs_path_that_is_not_a_folder_is_named_by_every_reader(sweep_with_table, capsys):
    from esbatch.cli import main

    _, sd, _ = sweep_with_table
    runs = sd.runs
    runs.rename(sd.path / "runs.moved")
    runs.write_text("")
    for argv in (["status", str(sd.path)], ["aggregate", str(sd.path)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{runs}: not a folder" in err and "Traceback" not in err, err


def test_a_failed_aggregation_makes_the_sweep_exit_non_zero(tmp_path, monkeypatch, capsys):
    import esbatch.cli as cli

    spec = {"name": "t", "base": "quickstart", "output_dir": str(tmp_path / "out"), "seeds": [0]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(cli, "submit_sweep", lambda sweep, wait=False, table=None: 0)  # the runs went well

    def broken(sweep_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "aggregate", broken)
    assert cli.main(["sweep", str(tmp_path / "s.yaml"), "--launcher", "local"]) == 1
    err = capsys.readouterr().err
    assert "error: aggregation failed (OSError: [Errno 28] No space left on device)" in err
    assert "retry with: esbatch aggregate" in err
    monkeypatch.setattr(cli, "aggregate", lambda sweep_dir: tmp_path)
    assert cli.main(["sweep", str(tmp_path / "s.yaml"), "--launcher", "local"]) == 0


EVAL_FOLDERS = ["none", "interrupted", "finished", "stale", "damaged-source"]


def write_eval_folder(folder, kind: str, run_done: int) -> None:
    """An eval folder as a killed or finished eval of a run at update ``run_done`` leaves it."""
    if kind == "none":
        return
    folder.mkdir(parents=True)
    updates = run_done if kind != "stale" else run_done + 1 if run_done < BUDGET else run_done - 1
    (folder / "source.json").write_text("{torn" if kind == "damaged-source" else json.dumps({"updates": updates}))
    if kind != "interrupted":
        (folder / "metrics.json").write_text(json.dumps({"mlflow_run_id": "abc"}))


@pytest.mark.parametrize("eval_sched", [None, "PENDING", "RUNNING"])
@pytest.mark.parametrize("eval_folder", EVAL_FOLDERS)
def test_eval_submission_over_every_run_state_and_eval_state(tmp_path, monkeypatch, eval_folder, eval_sched):
    """Every TABLE run state x every eval folder state x the eval's scheduler state, through the real
    run_states and submit_sweep: what is submitted, and after which run, obeys the rules below (safety: nothing
    done or active is submitted, an eval runs on a finished center or after its run's job; liveness: an eval that
    can run is submitted)."""
    spec = {"evaluate": {"config": "eval-quick", "base_models": False}}
    sw0 = load_sweep(str(write_spec(tmp_path, spec)))  # the eval keys, to give them scheduler states
    sched = {e.key: eval_sched for e in sw0.evals} if eval_sched else {}
    sw, sd, keys = table_sweep(tmp_path, monkeypatch, sched=sched, **spec)
    by_run = {e.source: e for e in sw.evals}
    for name, key in keys.items():
        meta = TABLE[name][0]
        done = meta.get("done", 0) if isinstance(meta, dict) else 0
        write_eval_folder(sd.eval_dir(by_run[key].key), eval_folder, done)
    launcher = Recorder()
    monkeypatch.setattr(submit, "launcher_for", lambda profile: launcher)
    assert dry_run(sw, out=io.StringIO()) == 0
    out = io.StringIO()
    assert submit_sweep(sw, out=out) == 0
    assert launcher.described == [len(launcher.keys)]  # the dry run announces what the submission does
    states = {s.key: s.state for s in run_states(sd)}
    submitted, hits = set(launcher.keys), set()
    for name, key in keys.items():
        e = by_run[key]
        run_now, run_state, ev_state = key in submitted, states[key], states[e.key]
        where = (name, eval_folder, eval_sched, ev_state)
        if ev_state in ("finished", "queued", "running", "damaged"):
            hits.add("left alone")
            assert e.key not in submitted, where  # safety: never twice
        elif run_state == "finished":
            hits.add("now")
            assert e.key in submitted and e.key not in launcher.after, where  # liveness, on the final center
        elif run_now or run_state in ("queued", "running"):
            hits.add("after its run")
            assert launcher.after.get(e.key) == key, where  # after its run's training
        else:  # the run can neither be used nor trained now (damaged): the eval waits and says so
            hits.add("waits")
            assert e.key not in submitted and f"eval {e.key} waits: its run {key} is {run_state}" in out.getvalue()
        if eval_folder == "stale" and run_state == "finished" and not eval_sched:
            assert ev_state == "stale" and e.key in submitted, where  # a newer center: evaluated again
    if eval_sched:  # every eval queued or running: left alone whatever its run and folder
        assert hits == {"left alone"}
    elif eval_folder != "finished":  # the table's runs reach every other branch
        assert hits == {"now", "after its run", "waits"}, hits


class Recorder:
    foreground = False

    def __init__(self):
        self.keys, self.after, self.described = [], {}, []

    def describe(self, sd, name, n_tasks):
        self.described.append(n_tasks)
        return f"would run {n_tasks} task(s)"

    def submit(self, sd, name, keys, after=None):
        self.keys += list(keys)
        self.after.update(after or {})
        return [{"job_id": "99", "keys": list(keys)}]


def write_spec(tmp_path, extra):
    spec = {
        "name": "t",
        "base": "quickstart",
        "output_dir": str(tmp_path / "out"),
        "config": {"es": {"updates": BUDGET}},
        "seeds": list(range(len(TABLE))),
        **extra,
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "s.yaml"


# ----------------------------------------------------------------------------- the sweep folder's own readers


def _logged(rd, rewards, evals):
    for t, r in enumerate(rewards):
        rd.append_update({"t": t, "metrics": {"reward/mean": r}})
    for t, h in evals:
        rd.append_eval({"t": t, "heldout/accuracy": h})


@pytest.mark.parametrize(
    ("meta", "rewards", "evals", "want"),
    [
        ({"last_reward": 0.7, "last_heldout": 0.4}, [0.1], [(0, 0.2)], (0.7, 0.4)),  # run.json wins over the logs
        ({"last_reward": 0.7}, [0.1], [(0, 0.2)], (0.7, None)),  # kept, with no held-out yet: not the logs'
        ({"last_reward": None}, [0.1], [(0, 0.2)], (None, None)),  # kept as unknown (nothing logged yet)
        ({}, [0.1, 0.2, 0.3], [(1, 0.25), (2, 0.5), (0, 0.1)], (0.3, 0.5)),  # the last update, the newest t
        ({}, [0.1, 0.2], [], (0.2, None)),
        ({}, [], [(0, 0.25)], (None, 0.25)),  # no log.jsonl at all
    ],
)
def test_kept_scores_read_run_json_first_else_the_logs(tmp_path, meta, rewards, evals, want):
    from esbatch.launch.state import kept_scores

    rd = _folder(tmp_path / "r", meta)
    _logged(rd, rewards, evals)
    assert kept_scores(rd, meta) == want


@pytest.mark.parametrize(
    ("stage2", "want"),
    [
        ({"last_reward": 0.6, "last_heldout": 0.55}, (0.6, 0.55)),
        ({"last_reward": 0.6, "last_heldout": None}, (0.6, 0.4)),  # each score from the newest stage that has it
        ({"last_reward": None}, (0.3, 0.4)),
        ("damaged", (0.3, 0.4)),  # passed over, and the older stages still read
    ],
)
def test_kept_scores_of_a_pipeline_come_from_its_newest_stage_with_each(tmp_path, stage2, want):
    from esbatch.launch.state import kept_scores
    from esbatch.train.rundir import RunDir

    pipe = _folder(tmp_path / "p", {"status": "running"})
    _folder(pipe.stage(1, "es").path, {"last_reward": 0.2, "last_heldout": 0.1})
    _folder(pipe.stage(2, "grpo").path, {"last_reward": 0.3, "last_heldout": 0.4})
    st = RunDir(pipe.stage(3, "grpo").path)
    _folder(st.path, {})
    if stage2 == "damaged":
        st.meta.write_text("{not json")
    else:
        st.meta.write_text(json.dumps(stage2))
    _logged(pipe, [0.9], [(0, 0.9)])  # a pipeline's own logs are not its scores
    assert kept_scores(pipe, {"status": "running"}) == want


def test_folder_problem_names_what_a_folder_holds_without_its_config(tmp_path):
    from esbatch.launch.state import folder_problem
    from esbatch.train.rundir import RunDir

    rd = RunDir(tmp_path / "r")
    assert folder_problem(rd) is None  # not there yet
    rd.path.mkdir()
    for name in (".lock", "task.log"):  # what a task writes before config.yaml: still starting
        (rd.path / name).write_text("")
    assert folder_problem(rd) is None
    for name in ("e.txt", "b.txt", "d.txt", "a.txt", "c.txt"):
        (rd.path / name).write_text("")
    assert folder_problem(rd) == (
        f"{rd.path}: holds a.txt, b.txt, c.txt, d.txt but no config.yaml: restore it from a backup, or move the "
        "folder aside to train the run again"
    )
    other = tmp_path / "f"
    other.write_text("")
    assert folder_problem(RunDir(other)) == (
        f"{other}: not a folder. Move it aside; the next `esbatch sweep` trains the run again"
    )


def test_folder_problem_is_resumes_verdict_except_for_a_pipeline(tmp_path):
    from esbatch.launch.state import folder_problem

    rd = _folder(tmp_path / "r", {"status": "running"})
    _logged(rd, [0.1, 0.2], [])
    assert folder_problem(rd) is None
    rd.log.write_text(json.dumps({"t": 1, "metrics": {}}) + "\n")  # update 0 gone
    assert folder_problem(rd) == f"{rd.log}: line 1 is update 1, expected 0: lines are missing or out of order. " + (
        "Restore the file from a backup; resume will not guess which updates were applied."
    )
    rd.meta.write_text(json.dumps({"algorithm": "pipeline"}))  # its stages are checked as they resume
    assert folder_problem(rd) is None


def test_unplanned_lists_run_folders_the_plan_no_longer_holds_sorted(tmp_path):
    from esbatch.launch.state import SweepDir

    sd = SweepDir(tmp_path / "s")
    assert sd.unplanned() == []  # no runs folder yet
    for key in ("zeta", "alpha", "kept", "mid"):
        (sd.runs / key).mkdir(parents=True)
    (sd.runs / "a-file").write_text("")  # not a folder: not a run
    assert sd.unplanned() == ["alpha", "kept", "mid", "zeta"]  # before any sweep.json: none is planned
    with sd.locked() as m:
        m["runs"] = [{"key": "kept"}, {"key": "gone"}]
    assert sd.unplanned() == ["alpha", "mid", "zeta"]


def test_an_eval_writes_under_evals_and_its_task_log_there(tmp_path):
    from esbatch.launch.evals import RUN_PREFIX
    from esbatch.launch.state import SweepDir

    sd = SweepDir(tmp_path / "s")
    key = f"{RUN_PREFIX}x"
    assert sd.eval_dir(key) == tmp_path / "s" / "evals" / key
    assert sd.task_log(key) == tmp_path / "s" / "evals" / key / "task.log"
    assert sd.task_log("run1") == tmp_path / "s" / "runs" / "run1" / "task.log"


def test_kept_scores_of_a_pipeline_read_an_old_stages_logs_and_say_none_when_no_stage_has_one(tmp_path):
    from esbatch.launch.state import kept_scores

    pipe = _folder(tmp_path / "p", {})
    old = _folder(pipe.stage(1, "es").path, {})  # a stage from before run.json kept scores: its logs
    _logged(old, [0.1, 0.7], [])
    assert kept_scores(pipe, {}) == (0.7, None)  # no stage has a held-out score: unknown, not an error
    _logged(old, [], [(1, 0.8)])
    assert kept_scores(pipe, {}) == (0.7, 0.8)


def test_a_sweep_record_is_checked_for_the_keys_every_submission_writes_once_it_exists(tmp_path):
    from esbatch.launch.state import SWEEP_RECORD_KEYS, SweepDir
    from esbatch.train.rundir import RunFolderError

    sd = SweepDir(tmp_path / "s")
    assert sd.read(require=SWEEP_RECORD_KEYS) == {}  # before the first submission: nothing to check
    sd.path.mkdir()
    sd.meta_path.write_text(json.dumps({"name": "t", "runs": []}))
    assert sd.read() == {"name": "t", "runs": []}
    with pytest.raises(RunFolderError) as e:
        sd.read(require=SWEEP_RECORD_KEYS)
    assert "it lacks 'tracking_uri', 'experiment', which every submission writes" in str(e.value)
