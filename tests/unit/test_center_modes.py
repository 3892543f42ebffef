"""checkpoint.center: every | final | none on the tiny model: a run stopped mid-way and resumed ends with the same
center bits as an uninterrupted one in every mode (final and none replay the log from theta_0), and the readers
of a run's final weights (esbatch eval --checkpoint, analyze drift) give what they give for mode every.

The reference is an uninterrupted run with checkpoint.center: every; every other run differs from it only in the
checkpoint mode and in being stopped, so the same seeds must land on the same fp32 center, bit for bit."""

import pytest
import torch
from safetensors.torch import load_file

from esbatch.config import ConfigError, config_from_dict
from esbatch.train.rundir import RunDir

UPDATES = 5


def _cfg(model_dir, out, mode, restore="exact", **extra):
    from toy import toy_config

    d = toy_config(model_dir, heldout=0, eval={"every": 0}, es_updates=UPDATES)
    d["run"] = {**d["run"], "output_dir": str(out)}
    d["model"]["dtype"] = "bfloat16"  # the export is in the compute dtype, the center in fp32
    d["es"] = {**d["es"], "restore": restore}
    d["checkpoint"] = {"center": mode, "every": 2, "snapshots": [UPDATES]}
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
    train(cfg, path, resume=True, progress=False)
    return rd


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    """The uninterrupted reference: mode every, its fp32 center after update 5."""
    from esbatch.train import train

    out = tmp_path_factory.mktemp("straight")
    train(_cfg(tiny_model_dir, out, "every"), out / "every", progress=False)
    rd = RunDir(out / "every")
    state, t = rd.load_center()
    assert t == UPDATES and all(v.dtype == torch.float32 for v in state.values())
    return rd, state


@pytest.mark.parametrize("mode", ["every", "final", "none"])
def test_a_stopped_run_resumes_to_the_uninterrupted_center_in_every_mode(
    tmp_path, tiny_model_dir, monkeypatch, straight, mode
):
    ref_rd, ref = straight
    cfg = _cfg(tiny_model_dir, tmp_path, mode)
    rd = _train_stopped_then_resumed(monkeypatch, cfg, tmp_path / mode)
    # the snapshot is the live center the resumed run held after update 5 (written in every mode)
    got = load_file(str(rd.snapshot(UPDATES)))
    assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    assert [r["rewards"] for r in rd.updates()] == [r["rewards"] for r in ref_rd.updates()]
    files = sorted(p.name for p in rd.path.iterdir() if p.name.startswith((".", "center", "final")))
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
    rd = _train_stopped_then_resumed(monkeypatch, _cfg(tiny_model_dir, tmp_path, "none", "inplace"), tmp_path / "b")
    got = load_file(str(rd.snapshot(UPDATES)))
    assert all(torch.equal(got[n], ref[n]) for n in ref) and not rd.center.exists()


def test_eval_and_drift_of_runs_without_a_center_file(tmp_path, tiny_model_dir, straight):
    """mode none: eval --checkpoint and drift rebuild the center from the log (no file left behind); mode final:
    eval reads final_model/. Both equal what the every run's center.safetensors gives."""
    from test_eval_runner import cfg_dict

    from esbatch.analyze.drift import analyze_run, resolve_run
    from esbatch.config.eval import eval_config_from_dict
    from esbatch.eval.runner import evaluate
    from esbatch.train import train

    ref_rd, _ = straight
    for mode in ("none", "final"):
        train(_cfg(tiny_model_dir, tmp_path, mode, checkpoint={"center": mode}), tmp_path / mode, progress=False)

    def ev(run, name):
        d = cfg_dict(tmp_path, tiny_model_dir, name=name, checkpoint=str(run))
        d["tasks"][0]["limit"] = 3
        return evaluate(eval_config_from_dict(d), progress=False)

    ref = ev(ref_rd.path, "every")
    none, final = ev(tmp_path / "none", "none"), ev(tmp_path / "final", "final")
    assert "rebuilt from its log, update 5" in none["source"] and "final model of" in final["source"]
    assert none["tasks"] == ref["tasks"] and final["tasks"] == ref["tasks"]

    a, b = analyze_run(resolve_run(ref_rd.path)), analyze_run(resolve_run(tmp_path / "none"))
    assert b.t == a.t == UPDATES and a.n_nonzero > 0
    assert (b.sq_delta, b.sq_theta0, b.n_nonzero, b.max_abs, b.below) == (a.sq_delta, a.sq_theta0, a.n_nonzero, a.max_abs, a.below)
    assert sorted(p.name for p in (tmp_path / "none").iterdir() if p.name.startswith(".")) == []


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
