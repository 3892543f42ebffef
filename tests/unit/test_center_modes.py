"""checkpoint.center: every | final | none on the tiny model: a run stopped mid-way and resumed ends with the same
center bits as an uninterrupted one in every mode (final and none replay the log from theta_0), and the readers
of a run's final weights (esbatch eval --checkpoint, analyze drift) give what they give for mode every.

The reference is an uninterrupted run with checkpoint.center: every; every other run differs from it only in the
checkpoint mode and in being stopped, so the same seeds must land on the same fp32 center, bit for bit."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from esbatch.config import ConfigError, config_from_dict
from esbatch.train.lock import LOCK_FILE
from esbatch.train.rundir import RunDir

UPDATES = 5


def _cfg(model_dir, out, mode, restore="exact", **extra):
    from toy import toy_config

    d = toy_config(model_dir, heldout=0, eval={"every": 0}, es_updates=UPDATES)
    d["run"] = {**d["run"], "output_dir": str(out)}
    d["model"]["dtype"] = "bfloat16"  # the export is in the compute dtype, the center in fp32
    d["es"] = {**d["es"], "restore": restore}
    d["checkpoint"] = {"center": mode, "every": 2, "snapshots": [UPDATES]}
    d["tracking"] = {"uri": f"sqlite:///{Path(out).parent / 'mlflow.db'}"}  # one store: its schema is made once
    d.update(extra)
    return config_from_dict(d)


def _stop_after(monkeypatch, last):
    """Stop the run after update ``last`` has been logged, as SIGTERM does (the next stop check raises)."""
    from esbatch.es.trainer import ESTrainer
    from esbatch.train import stop

    step = ESTrainer.step

    def stepping(self, t):
        rec = step(self, t)
        if t == last:
            stop.STOP.set()
        return rec

    monkeypatch.setattr(ESTrainer, "step", stepping)


def _train_stopped_then_resumed(monkeypatch, cfg, path):
    from esbatch.train import stop, train

    with monkeypatch.context() as m:
        _stop_after(m, 2)
        try:
            with pytest.raises(stop.Stopped):
                train(cfg, path, progress=False)
        finally:
            stop.STOP.clear()
    rd = RunDir(path)
    assert len(rd.updates()) == 3 and rd.read_meta()["status"] == "killed"
    stopped = sorted(p.name for p in rd.path.iterdir() if p.name.startswith(("center", "final")))
    train(cfg, path, resume=True, progress=False)
    return rd, stopped


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """The uninterrupted reference (mode every) and, per mode, a run stopped after update 2 and resumed to 5."""
    from esbatch.train import train

    out = tmp_path_factory.mktemp("modes")
    train(_cfg(tiny_model_dir, out, "every"), out / "straight", progress=False)
    made = {"straight": (RunDir(out / "straight"), [])}
    with pytest.MonkeyPatch.context() as mp:
        for mode in ("every", "final", "none"):
            made[mode] = _train_stopped_then_resumed(mp, _cfg(tiny_model_dir, out, mode), out / mode)
    return made


@pytest.mark.parametrize("mode", ["every", "final", "none"])
def test_a_stopped_run_resumes_to_the_uninterrupted_center_in_every_mode(runs, mode):
    ref_rd = runs["straight"][0]
    ref, t = ref_rd.load_center()
    assert t == UPDATES and all(v.dtype == torch.float32 for v in ref.values())
    rd, stopped = runs[mode]
    # stopped after update 2 was logged: only mode every has a center (update 2); the others replay from theta_0
    assert stopped == (["center.safetensors"] if mode == "every" else [])
    # the snapshot is the live center the resumed run held after update 5 (written in every mode)
    got = load_file(str(rd.snapshot(UPDATES)))
    assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    assert [r["rewards"] for r in rd.updates()] == [r["rewards"] for r in ref_rd.updates()]
    named = (p.name for p in rd.path.iterdir() if p.name != LOCK_FILE)
    files = sorted(n for n in named if n.startswith((".", "center", "final")))
    if mode == "every":
        assert files == ["center.safetensors"] and rd.center_t() == UPDATES
    elif mode == "final":
        assert files == ["final_model"] and rd.export_t() == UPDATES
        exported = load_file(str(rd.final_model / "model.safetensors"))
        assert set(exported) == set(ref)
        assert all(v.dtype == torch.bfloat16 and torch.equal(v, ref[n].to(torch.bfloat16)) for n, v in exported.items())
    else:
        assert files == []


def test_inplace_with_no_center_file_replays_its_cycles_from_theta0(tmp_path, tiny_model_dir, monkeypatch):
    """es.restore: inplace carries every perturb/restore round-off: with checkpoint.center: none resume must redo
    all of them from theta_0 to reach the uninterrupted run's bf16 center."""
    from esbatch.train import train

    train(_cfg(tiny_model_dir, tmp_path, "every", "inplace"), tmp_path / "a", progress=False)
    ref, t = RunDir(tmp_path / "a").load_center()
    assert t == UPDATES and all(v.dtype == torch.bfloat16 for v in ref.values())
    rd, _ = _train_stopped_then_resumed(monkeypatch, _cfg(tiny_model_dir, tmp_path, "none", "inplace"), tmp_path / "b")
    got = load_file(str(rd.snapshot(UPDATES)))
    assert all(torch.equal(got[n], ref[n]) for n in ref) and not rd.center.exists()


def test_eval_and_drift_of_runs_without_a_center_file(tmp_path, tiny_model_dir, runs):
    """mode none: eval --checkpoint and drift rebuild the center from the log (no file left behind); mode final:
    eval reads final_model/. Both equal what the uninterrupted run's center.safetensors gives."""
    from test_eval_runner import cfg_dict

    from esbatch.analyze.drift import analyze_run, resolve_run
    from esbatch.config.eval import eval_config_from_dict
    from esbatch.eval.runner import evaluate

    def ev(mode):
        d = cfg_dict(tmp_path, tiny_model_dir, name=mode, checkpoint=str(runs[mode][0].path))
        d["tasks"][0]["limit"] = 3
        return evaluate(eval_config_from_dict(d), progress=False)

    ref, none, final = ev("straight"), ev("none"), ev("final")
    assert "rebuilt from its log, update 5" in none["source"] and "final model of" in final["source"]
    assert none["tasks"] == ref["tasks"] and final["tasks"] == ref["tasks"]

    a, b = analyze_run(resolve_run(runs["straight"][0].path)), analyze_run(resolve_run(runs["none"][0].path))
    assert b.t == a.t == UPDATES and a.n_nonzero > 0
    assert (b.sq_delta, b.sq_theta0, b.n_nonzero, b.max_abs, b.below) == (
        a.sq_delta,
        a.sq_theta0,
        a.n_nonzero,
        a.max_abs,
        a.below,
    )
    assert [p.name for p in runs["none"][0].path.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE] == []


@pytest.mark.parametrize("algorithm", ["grpo", "pipeline"])
@pytest.mark.parametrize("mode", ["final", "none"])
def test_final_and_none_are_refused_where_the_log_cannot_rebuild_the_weights(tiny_model_dir, algorithm, mode):
    from toy import toy_config

    d = toy_config(tiny_model_dir, algorithm=algorithm, checkpoint={"center": mode})
    d["grpo"] = {"updates": 2}
    if algorithm == "pipeline":
        d["pipeline"] = {"stages": ["es", "grpo"], "updates": 4}
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    assert f"checkpoint.center: {mode} needs algorithm: es" in str(e.value)
    assert "checkpoint.center: every" in str(e.value)
    config_from_dict({**d, "checkpoint": {"center": "every"}})  # the default is accepted


# ----------------------------------------------------------------------------- disk estimate (sweep --dry-run)


def _tiny_params(model_dir):
    """By hand from the architecture of tests/toy.py:make_tiny_model (hidden 32, 2 layers, 4 heads / 2 KV heads of
    size 8, MLP 64, tied embeddings): the embedding V x 32, per layer q and o 32 x 32, k and v 32 x 16, gate, up and
    down 32 x 64, two norms of 32; the final norm 32."""
    import json

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    per_layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
    return vocab * 32 + 2 * per_layer + 32


def test_parameter_count_is_read_from_the_headers(tiny_model_dir):
    from esbatch.models import parameter_count

    assert parameter_count(str(tiny_model_dir)) == _tiny_params(tiny_model_dir)
    assert parameter_count("Org/never-downloaded-model") is None  # nothing is fetched


def test_run_disk_matches_a_hand_computation(tiny_model_dir):
    from toy import toy_config

    from esbatch.launch.disk import run_disk

    p = _tiny_params(tiny_model_dir)

    def disk(**sections):
        d = toy_config(tiny_model_dir, es_updates=3, **sections)
        d["model"]["dtype"] = "bfloat16"
        return run_disk(config_from_dict(d), p)

    every = disk(checkpoint={"center": "every", "snapshots": [2]})  # one past the budget is refused (test_config)
    assert every.items == [("center.safetensors (fp32)", 4 * p), (f"snapshots/: 1 x {_h(4 * p)} (fp32)", 4 * p)]
    assert (every.total, every.peak) == (8 * p, 12 * p)
    assert disk(checkpoint={"center": "final"}).total == 2 * p
    assert disk(checkpoint={"center": "none"}).items == []
    assert disk(checkpoint={"center": "none"}, tracking={"log_model": True}).total == 2 * p + 2 * p  # + MLflow copy
    inplace = disk(checkpoint={"center": "every"}, es={"population_size": 4, "restore": "inplace", "updates": 3})
    assert inplace.total == 2 * p  # the center in the compute dtype
    grpo = disk(algorithm="grpo", grpo={"updates": 5}, checkpoint={"every": 2})
    # center fp32 at the end + the newest DeepSpeed checkpoint (bf16 weights, fp32 master, m and v); the next one
    # is written beside it before the older goes
    assert (grpo.total, grpo.peak) == (4 * p + p * (2 + 4 + 8), 4 * p + 2 * p * (2 + 4 + 8))
    fp32 = config_from_dict(
        {**toy_config(tiny_model_dir, algorithm="grpo", grpo={"updates": 5}), "checkpoint": {"every": 2}}
    )
    assert run_disk(fp32, p).total == 4 * p + p * (4 + 8)  # fp32 weights are their own master copy


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (999_949, "999.9 kB"), (10**6, "1.0 MB"), (3.2e15, "3200.0 TB")],
)
def test_sizes_change_unit_at_exactly_1000(n, text):
    assert _h(n) == text


def _h(n):
    from esbatch.launch.disk import human

    return human(n)


def test_sweep_dry_run_prints_the_disk_per_run_and_in_total(tmp_path, tiny_model_dir, capsys):
    import yaml
    from toy import toy_config

    from esbatch.cli import main

    p = _tiny_params(tiny_model_dir)
    base = toy_config(tiny_model_dir, es_updates=3)
    base["model"]["dtype"] = "bfloat16"
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {
        "name": "disk",
        "base": str(tmp_path / "base.yaml"),
        "output_dir": str(tmp_path / "out"),
        "grid": {"checkpoint.center": ["every", "final", "none"]},
        "launcher": "local",
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(tmp_path / "s.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{p:,} parameters (from its files' headers)" in out
    assert f"{_h(4 * p)}, {_h(8 * p)} while a checkpoint is written: center.safetensors (fp32) {_h(4 * p)}" in out
    assert f"{_h(2 * p)}: final_model/ (bfloat16) {_h(2 * p)}" in out
    assert "0 B: no weight files (checkpoint.center: none)" in out
    assert f"total: {_h(6 * p)} for 3 run(s); up to {_h(10 * p)}" in out
