"""A sweep's threshold phase (paper Figure 4): the planned thr- evals (order, checkpoints, the tau-0 anchor shared
with the evaluate phase, dependencies on the training), the thresholded checkpoint a task writes or reuses, the
validation of the section, and the threshold_curve kind's checks. The local end-to-end run is
tests/integration/test_sweep_threshold_run.py."""

import io
import json
import os

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from toy import toy_config

from esbatch.analyze.threshold import S_TAU, ensure_thresholded, tau_dir, thresholded_intact
from esbatch.launch.evals import RUN_PREFIX, THRESHOLD_PREFIX, is_eval_key
from esbatch.launch.submit import evals_to_submit, run_states, write_plan
from esbatch.launch.sweep import load_sweep
from esbatch.schema import ConfigError

SUITE = {
    "name": "suite",
    "sampling": {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "batch_size": 8},
    "ks": [1, 2],
    "tasks": [{"name": "toy:DigitTask", "label": "Digits", "params": {"size": 16}, "limit": 3}],
}
TWO_TASKS = {**SUITE, "tasks": [*SUITE["tasks"], {"name": "toy:DigitTask", "label": "Other", "limit": 2}]}
METHODS = {"ES": {"algorithm": "es"}, "GRPO": {"algorithm": "grpo"}}


def write_sweep(tmp_path, model_dir, threshold, evaluate=None, methods=METHODS, **extra):
    base = toy_config(model_dir, es_updates=2, grpo={"group_size": 4, "batch_size": 2, "updates": 2})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(SUITE))
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(TWO_TASKS))
    sweep = {"name": "thr", "base": "base.yaml", "output_dir": str(tmp_path / "out"), "threshold": threshold}
    if methods:
        sweep["methods"] = methods
    if evaluate:
        sweep["evaluate"] = evaluate
    p = tmp_path / "sweep.yaml"
    p.write_text(yaml.safe_dump({**sweep, **extra}))
    return p


def test_every_run_gets_an_anchor_and_one_eval_per_tau_after_its_training(tmp_path, tiny_model_dir):
    # YAML 1.1 reads 1e-5 as a string: accepted, and the taus are planned in increasing order
    path = write_sweep(tmp_path, tiny_model_dir, {"tau": ["1e-5", 1.0e-6], "config": "suite.yaml"})
    sw = load_sweep(str(path))
    runs = {r.point["method"]: r.key for r in sw.runs}
    got = [(e.label, e.source, e.tau, e.config["checkpoint"]) for e in sw.evals]
    run_dir = {m: sw.dir / "runs" / k for m, k in runs.items()}
    assert got == [
        ("method=ES (tau=0)", runs["ES"], 0.0, str(run_dir["ES"])),
        ("method=ES (tau=1e-06)", runs["ES"], 1e-6, str(run_dir["ES"] / "thresholded" / "tau-1e-06")),
        ("method=ES (tau=1e-05)", runs["ES"], 1e-5, str(run_dir["ES"] / "thresholded" / "tau-1e-05")),
        ("method=GRPO (tau=0)", runs["GRPO"], 0.0, str(run_dir["GRPO"])),
        ("method=GRPO (tau=1e-06)", runs["GRPO"], 1e-6, str(run_dir["GRPO"] / "thresholded" / "tau-1e-06")),
        ("method=GRPO (tau=1e-05)", runs["GRPO"], 1e-5, str(run_dir["GRPO"] / "thresholded" / "tau-1e-05")),
    ]
    assert all(e.key.startswith(THRESHOLD_PREFIX) and is_eval_key(e.key) for e in sw.evals)
    assert len({e.key for e in sw.evals}) == 6
    assert all(
        e.config["tasks"] == SUITE["tasks"] and e.config["model"]["name"] == str(tiny_model_dir) for e in sw.evals
    )
    assert sw.threshold == {"task": "Digits", "tau": [1e-6, 1e-5], "base_dtype": None, "as_dtype": None}

    # sweep.json records each point's tau; every eval waits for its own run's training (submitted now)
    sd = write_plan(sw)
    meta = json.loads(sd.meta_path.read_text())
    assert [e["tau"] for e in meta["evals"]] == [0.0, 1e-6, 1e-5] * 2 and meta["threshold"]["task"] == "Digits"
    states = {s.key: s for s in run_states(sd)}
    keys, after = evals_to_submit(sw, states, [r.key for r in sw.runs], io.StringIO())
    assert keys == [e.key for e in sw.evals] and after == {e.key: e.source for e in sw.evals}
    # the plan is stable: the same sweep plans the same keys
    assert [e.key for e in load_sweep(str(path)).evals] == keys


def test_the_anchor_is_the_evaluate_phases_eval_when_the_configs_match(tmp_path, tiny_model_dir):
    thr = {"tau": [1.0e-4], "config": "suite.yaml", "methods": ["ES"]}
    sw = load_sweep(str(write_sweep(tmp_path, tiny_model_dir, thr, evaluate={"config": "suite.yaml"})))
    es_key = next(r.key for r in sw.runs if r.point["method"] == "ES")
    ev = {e.label: e for e in sw.evals}
    assert sorted(ev) == [
        "base " + str(tiny_model_dir),
        "method=ES (eval)",
        "method=ES (tau=0.0001)",
        "method=GRPO (eval)",
    ]
    assert ev["method=ES (eval)"].key.startswith(RUN_PREFIX) and ev["method=ES (eval)"].tau == 0.0  # reused, marked
    assert ev["method=GRPO (eval)"].tau is None  # not selected by methods: an ordinary eval
    assert ev["method=ES (tau=0.0001)"].source == es_key and not ev["base " + str(tiny_model_dir)].tau

    # the evaluate tables see the ev-/base- evals only; the curve sees the anchor and the tau evals
    from esbatch.aggregate.evals import default_eval_analyses, load_evals

    es = load_evals(write_plan(sw))
    assert sorted(e.label for e in es.entries) == sorted(k for k in ev if "tau=" not in k)
    assert [(p.key, p.tau, p.s_tau) for p in es.threshold] == [
        (ev["method=ES (eval)"].key, 0.0, 0.0),
        (ev["method=ES (tau=0.0001)"].key, 1e-4, None),  # its checkpoint is not written yet
    ]
    assert es.threshold[1].why == "no readable s_tau.json (its checkpoint was not written yet)"
    assert "threshold_curve" in [a.kind for a in default_eval_analyses(es)]

    # another protocol (more samples): its own anchor, the evaluate eval left as it is
    thr["set"] = {"sampling": {"n": 4}}
    sw2 = load_sweep(str(write_sweep(tmp_path, tiny_model_dir, thr, evaluate={"config": "suite.yaml"})))
    anchors = [e for e in sw2.evals if e.tau == 0.0]
    assert [(a.label, a.key[:4], a.config["sampling"]["n"]) for a in anchors] == [("method=ES (tau=0)", "thr-", 4)]


def test_slurm_puts_each_tau_in_an_array_aligned_with_the_training_array(tmp_path, tiny_model_dir, monkeypatch):
    from esbatch.config.launcher import LauncherProfile
    from esbatch.launch import slurm

    calls = []

    def fake_array(profile, sd, job_name, keys, dependency=None):
        calls.append((job_name, list(keys), dependency))
        return {"kind": "slurm", "job_id": str(99 + len(calls)), "array": len(keys) > 1, "keys": list(keys)}

    monkeypatch.setattr(slurm, "_array", fake_array)
    sw = load_sweep(str(write_sweep(tmp_path, tiny_model_dir, {"tau": [1.0e-6, 1.0e-5], "config": "suite.yaml"})))
    sd = write_plan(sw)
    train = [r.key for r in sw.runs]
    keys, after = evals_to_submit(sw, {s.key: s for s in run_states(sd)}, train, io.StringIO())
    profile = LauncherProfile(cluster="slurm", max_array_size=10, aggregate_job=False)
    slurm.submit(profile, sd, "thr", train + keys, after)
    per_tau = [[e.key for e in sw.evals if e.tau == t] for t in (0.0, 1e-6, 1e-5)]  # run order within each
    assert calls == [
        ("esbatch-thr", train, None),
        *(("esbatch-thr-eval", ks, "aftercorr:100") for ks in per_tau),
    ]


@pytest.mark.parametrize(
    "threshold, evaluate, want",
    [
        ({"tau": [], "config": "suite.yaml"}, None, "threshold.tau: got []"),
        ({"tau": [1.0e-5, -1], "config": "suite.yaml"}, None, "threshold.tau: -1 is not a finite number > 0"),
        ({"tau": ["small"], "config": "suite.yaml"}, None, "threshold.tau: 'small' is not a finite number > 0"),
        ({"tau": [1.0e-5, 1.0000001e-5], "config": "suite.yaml"}, None, "same threshold (folder tau-1e-05)"),
        ({"config": "suite.yaml"}, None, "threshold.tau: missing; expected a non-empty list"),
        (
            {"tau": [1.0e-5], "config": "eval-esay"},
            None,
            "threshold.config: eval-esay: no such file, and no eval config 'eval-esay'. Did you mean 'eval-easy'?",
        ),
        ({"tau": [1.0e-5], "config": "suite.yaml", "task": "Digit"}, None, "threshold.task: 'Digit' is not a task"),
        ({"tau": [1.0e-5], "config": "two.yaml"}, None, "threshold.task: two.yaml has 2 tasks"),
        ({"tau": [1.0e-5], "config": "suite.yaml", "methods": ["EZ"]}, None, "'EZ' not a method of this sweep"),
        ({"tau": [1.0e-5], "config": "suite.yaml", "base_dtype": "fp8"}, None, "threshold.base_dtype: 'fp8'"),
        ({"tau": [1.0e-5], "config": "suite.yaml", "tua": 1}, None, "threshold.tua"),
    ],
)
def test_a_bad_threshold_section_is_refused_before_anything_is_planned(
    tmp_path, tiny_model_dir, threshold, evaluate, want
):
    path = write_sweep(tmp_path, tiny_model_dir, threshold, evaluate)
    with pytest.raises(ConfigError) as e:
        load_sweep(str(path))
    assert want in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_the_error_lists_what_is_valid(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError) as e:
        load_sweep(str(write_sweep(tmp_path, tiny_model_dir, {"tau": [1.0e-5], "config": "two.yaml", "task": "X"})))
    assert "Its labels: Digits, Other" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_sweep(
            str(write_sweep(tmp_path, tiny_model_dir, {"tau": [1.0e-5], "config": "suite.yaml", "methods": ["EZ"]}))
        )
    assert "Valid: the sweep's methods: ES, GRPO" in str(e.value)
    with pytest.raises(ConfigError) as e:  # no methods axis: nothing to filter by
        path = write_sweep(
            tmp_path, tiny_model_dir, {"tau": [1.0e-5], "config": "suite.yaml", "methods": ["ES"]}, methods=None
        )
        load_sweep(str(path))
    assert "the sweep has no `methods:` axis" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_sweep(str(write_sweep(tmp_path, tiny_model_dir, {"tau": [1.0e-5], "config": "nope"})))
    assert "Available (evals/ here or built in): " in str(e.value) and "eval-easy" in str(e.value)
    # the target task defaults to evaluate.train_task when the threshold config has it
    ok = write_sweep(
        tmp_path, tiny_model_dir, {"tau": [1.0e-5], "config": "two.yaml"}, {"config": "two.yaml", "train_task": "Other"}
    )
    assert load_sweep(str(ok)).threshold["task"] == "Other"


# ----------------------------------------------------------------------------- the checkpoint a task writes


def fake_run(tmp_path, model_dir, t=2):
    """A run folder whose center is the base model plus hand-placed updates: 3 of size 1e-6, 2 of 1e-4, 1 of
    1e-2 in the first matrix (counts of |delta| <= tau are then known exactly)."""
    base = load_file(str(model_dir / "model.safetensors"))
    name = next(n for n, v in base.items() if v.dim() == 2)
    center = {n: v.to(torch.float32).clone() for n, v in base.items()}
    flat = center[name].view(-1)
    for i, d in enumerate([1e-6, 1e-6, -1e-6, 1e-4, -1e-4, 1e-2]):
        flat[i] += d
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(toy_config(model_dir, es_updates=t)))
    (run / "run.json").write_text(json.dumps({"status": "finished", "done": t}))
    save_file(center, str(run / "center.safetensors"), metadata={"t": str(t)})
    return run, name, base, center


def test_a_task_reuses_an_intact_thresholded_checkpoint_and_rewrites_a_damaged_or_stale_one(tmp_path, tiny_model_dir):
    run, name, base, center = fake_run(tmp_path, tiny_model_dir)
    nonzero = int(((center[name] - base[name].float()) != 0).sum())
    assert nonzero == 6  # the fp32 additions all moved their coordinates

    folder, written = ensure_thresholded(run, 1e-5)
    assert written and folder == tau_dir(run, 1e-5)
    s = json.loads((folder / S_TAU).read_text())
    assert (s["zeroed"], s["nonzero"], s["s_tau"]) == (3, 6, 0.5)
    got = load_file(str(folder / "center.safetensors"))[name].view(-1)
    want = center[name].view(-1).clone()
    want[:3] = base[name].view(-1)[:3].float()  # the three 1e-6 updates undone, the others kept bit for bit
    assert torch.equal(got, want)

    stamp = os.stat(folder / "center.safetensors").st_mtime_ns
    assert ensure_thresholded(run, 1e-5) == (folder, False)  # a re-run: reused, not written again
    assert os.stat(folder / "center.safetensors").st_mtime_ns == stamp

    raw = (folder / "center.safetensors").read_bytes()
    (folder / "center.safetensors").write_bytes(raw[:-4])  # torn: shorter than its header promises
    assert not thresholded_intact(folder, 1e-5, 2, "float32")
    assert ensure_thresholded(run, 1e-5) == (folder, True)
    assert (folder / "center.safetensors").read_bytes() == raw

    (folder / S_TAU).write_text('{"tau": 1e-05, "s_ta')  # killed while writing s_tau.json
    assert ensure_thresholded(run, 1e-5)[1]

    # the run trained on (a new center, t=3): the old checkpoint is stale and rewritten from the new center
    center[name].view(-1)[3] += 1e-4  # that update grows to 2e-4; still > 1e-5
    save_file(center, str(run / "center.safetensors"), metadata={"t": "3"})
    assert not thresholded_intact(folder, 1e-5, 3, "float32")
    assert ensure_thresholded(run, 1e-5)[1]
    assert json.loads((folder / S_TAU).read_text())["updates"] == 3
    assert load_file(str(folder / "center.safetensors"), device="cpu")[name].view(-1)[3] == center[name].view(-1)[3]
    # another theta_0 rounding is another checkpoint
    assert not thresholded_intact(folder, 1e-5, 3, "bfloat16")


# ----------------------------------------------------------------------------- the aggregate kind's checks


def test_threshold_curve_needs_a_threshold_phase_and_a_known_task(tmp_path):
    from esbatch.aggregate.evals import EvalSet, ThresholdPoint
    from esbatch.aggregate.report import write_report
    from esbatch.config.aggregate import parse_specs

    (a,) = parse_specs([{"kind": "threshold_curve", "task": "Digits"}])
    with pytest.raises(ConfigError) as e:
        write_report([], [a], tmp_path / "r", evals=None)
    assert "kind 'threshold_curve' reads the evals of thresholded checkpoints; add a `threshold:` section" in str(
        e.value
    )
    with pytest.raises(ConfigError):  # evals, but none of a threshold phase
        write_report([], [a], tmp_path / "r", evals=EvalSet([], [], None))
    pt = ThresholdPoint("thr-1", "r1", "method=ES", {"method": "ES"}, 0.0, True, {}, 0.0)
    (b,) = parse_specs([{"kind": "threshold_curve", "task": "Digts", "select": {"methd": "ES"}}])
    with pytest.raises(ConfigError) as e:
        write_report([], [b], tmp_path / "r", evals=EvalSet([], [], None, [pt], "Digits", ["Digits"]))
    assert "task: 'Digts' is not a task of the threshold evals. Did you mean 'Digits'?" in str(e.value)
    assert "select.methd: unknown parameter 'methd'" in str(e.value)
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError) as e:
        parse_specs([{"kind": "threshold_curve", "y": "entropy"}])
    assert "aggregate[0].y" in str(e.value)


def test_the_shipped_cpu_sweep_thresholds_es_and_grpo_on_the_training_task():
    sw = load_sweep("threshold-cpu")
    assert {r.point["method"]: r.config.algorithm for r in sw.runs} == {"ES": "es", "GRPO": "grpo"}
    assert all(r.config.model.name == "smollm2-135m-instruct" and r.config.model.dtype == "float32" for r in sw.runs)
    es = next(r.config for r in sw.runs if r.config.algorithm == "es")
    assert (es.es.population_size, es.es.batch_size, es.es.updates) == (32, 4, 8)
    assert sw.threshold == {"task": "Add2", "tau": [1e-6, 1e-5, 1e-4, 1e-3], "base_dtype": None, "as_dtype": None}
    assert [e.tau for e in sw.evals] == [0.0, 1e-6, 1e-5, 1e-4, 1e-3] * 2
    e = sw.evals[0].config
    assert (
        [t["label"] for t in e["tasks"]] == ["Add2"] and e["sampling"]["n"] == 4 and e["sampling"]["temperature"] == 0.6
    )
    assert [(a.kind, a.name, a.y) for a in sw.analyses] == [("threshold_curve", "figure4", "pass@1")]


def test_the_rq2_sweeps_reuse_rq1s_runs_and_tabulate_table4_and_figure4():
    """rq2-easy / rq2-hard: their runs are rq1's ES and GRPO runs (the same keys, so finished folders are reused),
    ES is thresholded on the training task (Easy) or MATH-500 (Hard) over a grid holding the paper's 1.5e-3, and
    Table 4's reference is the GRPO run (Easy) or the released GRPO checkpoint (Hard)."""
    easy, rq1 = load_sweep("rq2-easy"), load_sweep("rq1-easy")
    keys = {r.key for r in rq1.runs if r.point["method"] in ("ES", "GRPO")}
    assert {r.key for r in easy.runs} == keys and len(keys) == 6
    assert easy.threshold["task"] == "GSM8K" and 1.5e-3 in easy.threshold["tau"]
    assert {e.point["method"] for e in easy.evals} == {"ES"} and len(easy.evals) == 3 * 5  # 3 models x (4 taus + 0)
    (drift,) = [a for a in easy.analyses if a.kind == "drift"]
    assert drift.reference == "GRPO"
    hard = load_sweep("rq2-hard")
    assert [r.key for r in hard.runs] == [r.key for r in load_sweep("rq1-hard").runs if r.point["method"] == "ES"]
    assert hard.threshold["task"] == "MATH-500"
    (drift,) = [a for a in hard.analyses if a.kind == "drift"]
    assert drift.reference.startswith("hf://zz1358m/SofT-GRPO-master/")


def test_set_reaches_the_evaluation_and_threshold_phases_of_a_sweep():
    """--set evaluate.* / threshold.* shrink a sweep's phases from the command line; every other key is the runs'."""
    plain = load_sweep("rq1-cpu")
    small = load_sweep("rq1-cpu", overrides=["evaluate.set.sampling.n=2", "evaluate.set.ks=[1, 2]", "es.sigma=0.02"])
    assert {e.config["sampling"]["n"] for e in small.evals} == {2} != {e.config["sampling"]["n"] for e in plain.evals}
    assert {tuple(e.config["ks"]) for e in small.evals} == {(1, 2)}
    assert all(r.config.es.sigma == 0.02 for r in small.runs if r.config.algorithm == "es")
    assert {e.key for e in small.evals}.isdisjoint(e.key for e in plain.evals)  # other evals, other folders
    fig4 = load_sweep("threshold-cpu", overrides=["threshold.tau=[1.0e-4]"])
    assert fig4.threshold["tau"] == [1e-4] and len(fig4.evals) == 2 * 2  # ES, GRPO: tau 0 and 1e-4
    with pytest.raises(ConfigError, match="has no `threshold:` section"):
        load_sweep("rq1-cpu", overrides=["threshold.tau=[1.0e-4]"])


def test_rq1_quick_plans_the_four_methods_their_evals_and_every_rq1_table():
    sw = load_sweep("rq1-quick")
    assert sorted(r.point["method"] for r in sw.runs) == sorted(["ES", "GRPO", "ES->GRPO", "GRPO->ES"])
    assert len(sw.evals) == 5 and {e.config["sampling"]["n"] for e in sw.evals} == {4}  # 4 trained + base
    kinds = {a.kind for a in sw.analyses}
    assert kinds == {"eval_table", "eval_wins", "pareto", "passk", "curves"}
