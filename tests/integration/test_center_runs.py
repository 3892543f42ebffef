"""Tiny-model runs stopped and resumed in process that must end on an uninterrupted run's center, bit for bit:
checkpoint.center every | final | none, and the readers of a run's final weights (esbatch eval --checkpoint,
analyze drift) for each (moved from tests/unit/test_center_modes.py); es.master host | disk (from
tests/unit/test_offload.py); es.restore: inplace (from tests/unit/test_restore_inplace.py); a run folder from before
es.noise (from tests/unit/test_noise.py). Each trains several
runs and opens an MLflow store: seconds, so not the fast tier's (issue 40).

The reference is an uninterrupted run with checkpoint.center: every; every other run differs from it only in the
checkpoint mode (or the layout of its center) and in being stopped, so the same seeds must land on the same center."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from esbatch.config import config_from_dict
from esbatch.perturb import UpdateSpec
from esbatch.train.lock import LOCK_FILE
from esbatch.train.rundir import RunDir

# one worker builds the module's reference runs (the `runs` fixture) and runs every test that reads them
pytestmark = pytest.mark.xdist_group("center-runs")
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
    from unit.test_eval_runner import cfg_dict

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


@pytest.mark.parametrize("master", ["disk", "host"])
def test_a_run_with_an_offloaded_center_resumes_to_the_device_runs_bits(
    tmp_path, tiny_model_dir, monkeypatch, runs, master
):
    """bf16 compute dtype, stopped after update 2 and resumed to 5: the fp32 center on disk (or in host memory)
    ends where the uninterrupted es.master: device run (the reference above, the same config) ends, bit for bit."""
    from unit.test_offload import _same

    ref_rd = runs["straight"][0]
    ref, t = ref_rd.load_center()
    cfg = _cfg(tiny_model_dir, tmp_path, "every")
    assert cfg.es.master == "device"
    cfg.es.master = master
    rd, _ = _train_stopped_then_resumed(monkeypatch, cfg, tmp_path / master)
    got, t2 = rd.load_center()
    assert t == t2 == UPDATES and _same(got, ref)
    assert [r["rewards"] for r in rd.updates()] == [r["rewards"] for r in ref_rd.updates()]


def test_inplace_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, tiny_model_dir):
    """4 updates in one go vs 3 updates, the checkpoint rolled back to update 2 (so resume must replay update 2
    from the log), resumed to 4: the same bf16 center, bit for bit."""
    import shutil

    from unit.test_restore_inplace import BF16, _backend, _center
    from unit.test_restore_inplace import _cfg as inplace_cfg

    from esbatch.es.replay import rebuild_center, replay
    from esbatch.train import train

    base = inplace_cfg(tiny_model_dir, tmp_path, "inplace")
    straight = config_from_dict({**base, "es": {**base["es"], "updates": 4}, "checkpoint": {"every": 2}})
    train(straight, tmp_path / "a", progress=False)
    a_state, a_t = _center(tmp_path / "a")
    assert a_t == 4 and all(t.dtype == BF16 for t in a_state.values())

    cut = {**base, "es": {**base["es"], "updates": 3}, "checkpoint": {"every": 2, "snapshots": [2]}}
    train(config_from_dict(cut), tmp_path / "b", progress=False)
    rd = RunDir(tmp_path / "b")
    shutil.copyfile(rd.snapshot(2), rd.center)  # as if killed after logging update 2, before its checkpoint
    assert rd.center_t() == 2 and len(rd.updates()) == 3
    resumed = config_from_dict({**cut, "es": {**base["es"], "updates": 4}})
    train(resumed, rd.path, resume=True, progress=False)
    b_state, b_t = _center(rd.path)
    assert b_t == 4 and set(b_state) == set(a_state)
    assert all(torch.equal(a_state[n], b_state[n]) for n in a_state)
    assert RunDir(tmp_path / "a").updates()[3]["rewards"] == rd.updates()[3]["rewards"]

    # `esbatch center --at 4` replays the cycles from theta_0 to the same bits
    rebuilt = rebuild_center(straight, RunDir(tmp_path / "a"), 4)
    assert all(torch.equal(a_state[n], rebuilt[n]) for n in a_state)

    # the cycles matter: replaying updates 2 and 3 without them lands elsewhere
    snap = load_file(rd.snapshot(2))
    b = _backend(tiny_model_dir, "inplace")
    b.load_center(snap)
    for r in rd.updates()[2:4]:
        b.update(UpdateSpec.from_record(r))
    assert any(not torch.equal(a_state[n], p) for n, p in b.params.items())
    b.load_center(snap)
    replay(b, rd.updates()[2:4])
    assert all(torch.equal(a_state[n], p) for n, p in b.params.items())


def test_a_run_folder_from_before_es_noise_resumes_with_the_legacy_generator(tmp_path, tiny_model_dir):
    """A legacy run of 3 updates in one go vs 2 updates in a folder whose config.yaml has no es.noise (as every
    folder written before the key), resumed to 3 through load_run_config: the same center, bit for bit; and
    `esbatch center --at 3` rebuilds it with the recorded generator."""
    import yaml
    from safetensors.torch import load_file
    from toy import toy_config

    from esbatch.config import config_from_dict, load_run_config
    from esbatch.es.replay import rebuild_center
    from esbatch.eval.center import center_at
    from esbatch.train import train
    from esbatch.train.rundir import RunDir

    d = toy_config(tiny_model_dir, heldout=0, eval={"every": 0})
    d["run"] = {**d["run"], "output_dir": str(tmp_path / "runs")}
    d["es"] = {**d["es"], "sigma": 0.01, "alpha": 0.005, "noise": "legacy-cpu"}
    train(config_from_dict({**d, "es": {**d["es"], "updates": 3}}), tmp_path / "a", progress=False)
    a_state, a_t = RunDir(tmp_path / "a").load_center()
    assert a_t == 3

    train(config_from_dict({**d, "es": {**d["es"], "updates": 2}}), tmp_path / "b", progress=False)
    rd = RunDir(tmp_path / "b")
    old = yaml.safe_load(rd.config.read_text())
    assert old["es"].pop("noise") == "legacy-cpu"  # new runs record their generator ...
    rd.config.write_text(yaml.safe_dump(old))  # ... old ones did not
    cfg = load_run_config(rd.path, ["es.updates=3"])
    assert cfg.es.noise == "legacy-cpu"
    train(cfg, rd.path, resume=True, progress=False)
    b_state, b_t = rd.load_center()
    assert b_t == 3 and all(torch.equal(a_state[n], b_state[n]) for n in a_state)

    rebuilt = load_file(center_at(rd.path, 3, tmp_path / "c3.safetensors"))
    assert all(torch.equal(a_state[n], rebuilt[n]) for n in a_state)
    # the check can fail: the same log replayed with the new default generator lands elsewhere
    new = config_from_dict({**d, "es": {**d["es"], "updates": 3, "noise": "philox-gauss"}})
    other = rebuild_center(new, rd, 3)
    assert any(not torch.equal(a_state[n], other[n]) for n in a_state)
