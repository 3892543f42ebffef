"""Every bad input gets one clear error (what, where, what is valid) and exit code 2 before anything runs:
no traceback, no run folder created, nothing on disk changed. One table, one row per case."""

import json

import pytest
import yaml

from esbatch.cli import main
from esbatch.train.lock import LOCK_FILE

TOY = {"task": {"name": "toy:DigitTask", "heldout_size": 0}, "es": {"updates": 1}}


def write(tmp, name, data):
    p = tmp / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


def run_folder(tmp, model_dir, meta=None, center=None):
    """A run folder as a killed run leaves it (config, run.json, maybe a center), for --resume / eval cases."""
    rd = tmp / "runs" / "r"
    rd.mkdir(parents=True)
    cfg = {**TOY, "model": {"name": str(model_dir)}, "run": {"name": "r", "output_dir": str(tmp / "runs")}}
    (rd / "config.yaml").write_text(yaml.safe_dump(cfg))
    if meta is not None:
        (rd / "run.json").write_text(meta)
    if center is not None:
        (rd / "center.safetensors").write_bytes(center)
    return str(rd)


def sweep(tmp, **fields):
    return write(tmp, "s.yaml", {"name": "s", "base": "quickstart", "output_dir": str(tmp / "out"), **fields})


# (id, build(tmp, model_dir) -> argv, words the message must hold)
CASES = [
    (
        "model-not-found",
        lambda t, m: ["train", write(t, "c.yaml", {**TOY, "model": {"name": "/nonexistent/model"}})],
        ["model.name", "'/nonexistent/model' is not a registered alias", "Aliases: "],
    ),
    (
        "model-alias-typo",
        lambda t, m: ["validate", write(t, "c.yaml", {**TOY, "model": {"name": "smollm2"}})],
        ["model.name", "Did you mean 'smollm2-135m-instruct'?"],
    ),
    (
        "model-folder-without-config",
        lambda t, m: ["train", write(t, "c.yaml", {**TOY, "model": {"name": str(t)}})],
        ["model.name", "holds no config.json"],
    ),
    (
        "output-dir-is-a-file",
        lambda t, m: ["train", write(t, "c.yaml", {**TOY, "model": {"name": str(m)}, "run": {"output_dir": __file__}})],
        ["run.output_dir", "is a file"],
    ),
    ("validate-a-folder", lambda t, m: ["validate", str(t)], ["is a folder, not a YAML file"]),
    ("validate-a-binary-file", lambda t, m: ["validate", write(t, "b.yaml", "\x00\x01ELF")], ["binary file"]),
    ("set-broken-yaml", lambda t, m: ["validate", "quickstart", "--set", "es.sigma=[1"], ["es.sigma=[1", "not valid"]),
    (
        "task-os-system",
        lambda t, m: ["validate", write(t, "c.yaml", {**TOY, "task": {"name": "os:system"}})],
        ["task.name", "not a subclass of esbatch.tasks.base.Task"],
    ),
    (
        "task-module-syntax-error",
        lambda t, m: ["validate", write(t, "c.yaml", {**TOY, "task": {"name": "broken_syntax_mod:T"}})],
        ["task.name", "SyntaxError", "broken_syntax_mod.py, line 1"],
    ),
    (
        "task-module-missing-dependency",
        lambda t, m: ["validate", write(t, "c.yaml", {**TOY, "task": {"name": "missing_dep_mod:T"}})],
        ["task.name", "No module named 'not_installed_anywhere'", "missing dependency"],
    ),
    (
        "sigma-inf",
        lambda t, m: ["validate", write(t, "c.yaml", {**TOY, "es": {"updates": 1, "sigma": float("inf")}})],
        ["es.sigma", "finite"],
    ),
    (
        "alpha-inf",
        lambda t, m: ["validate", write(t, "c.yaml", {**TOY, "es": {"updates": 1, "alpha": float("inf")}})],
        ["es.alpha", "finite"],
    ),
    (
        "epochs-inf",
        lambda t, m: ["validate", write(t, "c.yaml", {**TOY, "es": {"epochs": float("inf")}})],
        ["es.epochs", "finite"],
    ),
    (
        "run-name-escapes",
        lambda t, m: ["train", write(t, "c.yaml", {**TOY, "model": {"name": str(m)}, "run": {"name": "../../x"}})],
        ["run.name", "'../../x'", "folder name"],
    ),
    (
        "run-name-absolute",
        lambda t, m: ["validate", write(t, "c.yaml", {**TOY, "run": {"name": "/tmp/x"}})],
        ["run.name", "folder name"],
    ),
    ("sweep-named-dotdot", lambda t, m: ["sweep", sweep(t), "--name", "..", "--dry-run"], ["name: got '..'"]),
    (
        "sweep-of-a-million-runs",
        lambda t, m: [
            "sweep",
            sweep(t, grid={"run.seed": list(range(100)), "es.sigma": [0.1] * 100, "es.alpha": [0.1] * 100}),
        ],
        ["expands to 1000000 runs (100 x 100 x 100)", "max_runs: 1000"],
    ),
    (
        "profile-value-with-newline",
        lambda t, m: ["validate", write(t, "p.yaml", {"cluster": "slurm", "partition": "gpu\n#SBATCH --mem=1T"})],
        ["partition", "line break"],
    ),
    (
        "corrupt-run-json",
        lambda t, m: ["train", "--resume", run_folder(t, m, meta='{"status": "runn')],
        ["run.json: not valid run metadata", "restore it from a backup"],
    ),
    (
        "eval-of-a-garbage-center",
        lambda t, m: ["eval", "--checkpoint", run_folder(t, m, meta="{}", center=b"garbage")],
        ["center.safetensors: cannot be read", "damaged"],
    ),
    (
        "aggregate-a-corrupt-sweep-json",
        lambda t, m: ["aggregate", write(t, "sweep.json", "{not json") and str(t)],
        ["sweep.json: not a valid sweep record", "mv "],
    ),
]


@pytest.mark.parametrize("build, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_error_with_exit_code_2(tmp_path, tiny_model_dir, capsys, monkeypatch, build, words):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "broken_syntax_mod.py").write_text("def f(:\n")
    (mods / "missing_dep_mod.py").write_text("import not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.chdir(tmp_path)
    argv = build(tmp_path, tiny_model_dir)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and ("\nerror: " in f"\n{err}" or err.startswith("invalid config")), err
    for w in words:
        assert w in err, err
    # nothing written, but the writer lock's empty file (a resume takes the lock before it reads run.json)
    after = {
        p: p.read_bytes()
        for p in tmp_path.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not (p.name == LOCK_FILE and p not in before)
    }
    assert after == {
        p: b for p, b in before.items() if "__pycache__" not in p.parts
    }  # nothing written, nothing changed


def test_1e_minus_3_is_a_float(tmp_path, capsys):
    """YAML 1.1 reads `1e-3` (no dot) as text; users write it that way and mean the number."""
    f = write(tmp_path, "c.yaml", "task: {name: arithmetic}\nes: {updates: 1, sigma: 1e-3, alpha: 5E-4}\n")
    assert main(["validate", f]) == 0, capsys.readouterr().err


def test_the_sweep_run_cap_is_configurable(tmp_path, capsys):
    assert main(["sweep", sweep(tmp_path, grid={"run.seed": list(range(5))}, max_runs=4), "--dry-run"]) == 2
    assert "expands to 5 runs" in capsys.readouterr().err
    assert main(["sweep", sweep(tmp_path, grid={"run.seed": list(range(5))}, max_runs=5), "--dry-run"]) == 0


def test_status_flags_a_run_whose_peak_memory_nears_its_request(tmp_path):
    from esbatch.launch.state import SweepDir
    from esbatch.launch.submit import memory_warnings

    sd = SweepDir(tmp_path / "s")
    runs = [{"key": k, "label": f"run {k}"} for k in ("low", "near", "over")]
    sd.path.mkdir()
    sd.meta_path.write_text(json.dumps({"runs": runs, "mem_request_mb": 1000, "launcher": "slurm-local"}))
    for k, peak in (("low", 899.0), ("near", 901.0), ("over", 1250.0)):
        sd.run_dir(k).path.mkdir(parents=True)
        sd.run_dir(k).meta.write_text(json.dumps({"peak_rss_mb": peak}))
    w = memory_warnings(sd)
    assert len(w) == 2 and w[0].startswith("near") and "within 10% of the 1000 MB" in w[0]
    assert w[1].startswith("over") and "is over the 1000 MB requested" in w[1]
    # a pipeline's driver stays small while its stages (own processes, stage*/run.json) peak: the largest counts
    runs.append({"key": "pipe", "label": "run pipe"})
    sd.meta_path.write_text(json.dumps({"runs": runs, "mem_request_mb": 1000, "launcher": "slurm-local"}))
    for sub, peak in (("", 397.0), ("stage1-es", 800.0), ("stage2-grpo", 1700.0)):
        (sd.run_dir("pipe").path / sub).mkdir(parents=True, exist_ok=True)
        (sd.run_dir("pipe").path / sub / "run.json").write_text(json.dumps({"peak_rss_mb": peak}))
    w = memory_warnings(sd)
    assert len(w) == 3 and w[2].startswith("pipe") and "peak memory 1700 MB is over" in w[2], w


def test_shipped_profiles_request_what_the_quickstart_measurably_needs():
    from esbatch.config.launcher import load_profile, mem_mb

    assert mem_mb(load_profile("slurm-local").mem) >= 1.25 * 3020  # sacct MaxRSS of quickstart tasks: 2.46-3.02 GB


def test_a_hub_id_that_cannot_be_loaded_is_a_clear_error(monkeypatch):
    from esbatch.models import ModelNotFoundError, load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here; offline makes the miss immediate
    with pytest.raises(ModelNotFoundError) as e:
        load_model_and_tokenizer("nobody-xyz/no-such-model")
    msg = str(e.value)
    assert msg.startswith("model.name: cannot load 'nobody-xyz/no-such-model'") and "HF_TOKEN" in msg
    assert "\n" not in msg
