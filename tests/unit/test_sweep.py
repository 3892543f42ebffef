"""Sweep files, launcher profiles, run ids, sbatch rendering and scheduler-state parsing (no SLURM needed)."""

import itertools
from pathlib import Path

import pytest
import yaml

from esbatch.config import ConfigError
from esbatch.config.launcher import load_profile, parse_time
from esbatch.launch import slurm
from esbatch.launch.state import combine
from esbatch.launch.sweep import load_sweep, run_key

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "popsize_a100.sbatch"


def write(tmp: Path, data: dict, name: str = "s.yaml") -> Path:
    p = tmp / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def base(tmp: Path, **extra) -> dict:
    return {"name": "t", "base": "quickstart", "output_dir": str(tmp / "out"), **extra}


def test_grid_zip_seeds_expand_in_order(tmp_path):
    sw = load_sweep(
        str(
            write(
                tmp_path,
                base(
                    tmp_path,
                    grid={"es.population_size": [4, 8]},
                    zip=[{"es.sigma": [0.01, 0.001], "es.alpha": [0.005, 0.0005]}],
                    seeds=[0, 1],
                ),
            )
        )
    )
    assert len(sw.runs) == 2 * 2 * 2
    got = [(r.config.es.population_size, r.config.es.sigma, r.config.es.alpha, r.config.run.seed) for r in sw.runs]
    assert got[:4] == [(4, 0.01, 0.005, 0), (4, 0.01, 0.005, 1), (4, 0.001, 0.0005, 0), (4, 0.001, 0.0005, 1)]
    assert {g[:3] for g in got} == {(n, s, a) for n in (4, 8) for s, a in ((0.01, 0.005), (0.001, 0.0005))}
    # small floats survive (YAML 1.1 would read "5e-05" as a string)
    assert isinstance(sw.runs[2].config.es.alpha, float)
    assert sw.runs[0].label == "population_size=4 sigma=0.01 alpha=0.005 seed=0"
    # every run trains into its own folder named by its key, and logs to the sweep's store
    r = sw.runs[0]
    assert Path(r.config.run.output_dir) == sw.dir / "runs" and r.config.run.name == r.key
    assert r.config.tracking.uri == f"sqlite:///{sw.dir / 'mlflow.db'}" and r.config.tracking.experiment == "t"
    assert len({r.key for r in sw.runs}) == 8


def test_wandb_style_values_and_inline_config(tmp_path):
    sw = load_sweep(
        str(write(tmp_path, base(tmp_path, config={"es": {"updates": 3}}, grid={"es.sigma": {"values": [0.1, 0.2]}})))
    )
    assert [r.config.es.sigma for r in sw.runs] == [0.1, 0.2]
    assert all(r.config.es.updates == 3 for r in sw.runs)


def test_run_key_ignores_bookkeeping_but_not_science(tmp_path):
    sw = load_sweep(str(write(tmp_path, base(tmp_path))))
    cfg = sw.runs[0].config
    k = run_key(cfg)
    cfg.run.output_dir, cfg.run.name, cfg.es.updates, cfg.tracking.uri, cfg.run.threads = "x", "y", 999, "http://a", 7
    assert run_key(cfg) == k  # where it is written, how long it trains, how it is logged: same run
    cfg.es.sigma *= 2
    assert run_key(cfg) != k
    # and the same sweep loaded twice (from another directory) gives the same ids
    again = load_sweep(str(write(tmp_path, base(tmp_path))))
    assert [r.key for r in again.runs] == [r.key for r in sw.runs]


def test_errors_name_every_bad_key_before_anything_runs(tmp_path):
    bad = base(
        tmp_path,
        grid={"es.populaton_size": [4], "es.sigma": 0.1},
        zip=[{"es.sigma": [0.1, 0.2], "es.alpha": [0.1]}],
        launcher="a10",
        launcher_overides={},
    )
    with pytest.raises(ConfigError) as e:
        load_sweep(str(write(tmp_path, bad)))
    msg = str(e.value)
    assert "launcher_overides: unknown sweep key. Did you mean 'launcher_overrides'?" in msg
    assert "grid.es.populaton_size: 'es.populaton_size' is not a config key. Did you mean 'es.population_size'?" in msg
    assert "grid.es.sigma: expected a non-empty list of values" in msg
    assert "zip[0]: every key needs the same number of values" in msg
    assert "no launcher profile 'a10'. Did you mean 'a100'?" in msg and "local" in msg


def test_bad_values_are_reported_once_or_per_run(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_sweep(
            str(write(tmp_path, base(tmp_path, config={"es": {"sigma": -1}}, grid={"es.population_size": [4, 5]})))
        )
    lines = e.value.errors
    assert sum("es.sigma" in ln for ln in lines) == 1 and lines[0].startswith("every run: es.sigma")
    with pytest.raises(ConfigError) as e:
        load_sweep(
            str(
                write(
                    tmp_path,
                    base(tmp_path, config={"es": {"estimator": "antithetic"}}, grid={"es.population_size": [4, 5]}),
                )
            )
        )
    (line,) = [ln for ln in e.value.errors if "even N" in ln]
    assert line.startswith("run 1 (population_size=5): es.population_size: antithetic pairs need an even N")


def test_launcher_overrides_and_profile_checks(tmp_path):
    sw = load_sweep(
        str(write(tmp_path, base(tmp_path, launcher="a100", launcher_overrides={"time": "2:00:00", "partition": "p"})))
    )
    assert sw.profile.cluster == "slurm" and sw.profile.time_minutes() == 120 and sw.profile.partition == "p"
    assert sw.profile.container.runtime == "apptainer"
    # slurm tasks get torch threads = cpus_per_task (not part of the run id)
    assert sw.runs[0].config.run.threads == 8
    # --launcher moves the same sweep elsewhere with one word
    assert load_sweep(str(tmp_path / "s.yaml"), launcher="local").profile.cluster == "local"
    with pytest.raises(ConfigError) as e:
        load_profile("a100", {"tme": "1:00:00", "mem": "lots", "container": {"runtime": "podman"}})
    msg = str(e.value)
    assert "launcher_overrides.tme: unknown key. Did you mean 'time'?" in msg
    assert "launcher_overrides.container.runtime: 'podman' is not a valid choice" in msg and "apptainer" in msg
    with pytest.raises(ConfigError, match="mem: 'lots' is not a SLURM memory size"):
        load_profile("a100", {"mem": "lots"})
    with pytest.raises(ConfigError, match="container.image: runtime docker needs an image"):
        load_profile("local", {"container": {"runtime": "docker"}})


@pytest.mark.parametrize(
    "s,minutes", [("90", 90), ("30:00", 30), ("0:30", 1), ("1:30:00", 90), ("2-00", 2880), ("1-12:30:00", 2190)]
)
def test_parse_time(s, minutes):
    assert parse_time(s) == minutes


@pytest.mark.parametrize("s", ["", "1h", "1:2:3:4", "-5"])
def test_parse_time_rejects(s):
    with pytest.raises(ValueError):
        parse_time(s)


def test_shipped_sweeps_validate_and_match_the_paper():
    pop = load_sweep("popsize")
    pts = {(r.config.model.name, r.config.es.population_size) for r in pop.runs}
    assert pts == {
        (m, n)
        for m in ("qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen2.5-3b-instruct")
        for n in (8, 16, 32, 64)
    }
    assert all(r.config.es.updates == 300 and r.config.task.name == "gsm8k" for r in pop.runs)
    assert pop.profile.gpus_per_node == 1 and pop.launcher == "a100"
    table = next(a for a in pop.analyses if a.kind == "scaling")
    assert (table.reference, table.at, table.smoothing, table.tolerance) == (64, 300, 0.99, 0.01)
    assert {r.config.es.normalization for r in load_sweep("normalization").runs} == {"zscore", "none"}
    assert len(load_sweep("sigma").runs) == 4
    assert {r.config.es.estimator for r in load_sweep("estimator").runs} == {"one_point", "antithetic"}
    quick = load_sweep(None)  # the embedded default
    assert quick.name == "quickstart" and quick.profile.cluster == "local" and len(quick.runs) >= 2


def test_golden_sbatch_for_the_a100_popsize_sweep():
    """The exact script one `esbatch sweep sweeps/popsize.yaml` submits (paths normalized)."""
    sw = load_sweep("popsize")
    text = slurm.render_sbatch(sw.profile, Path("/SWEEP"), "esbatch-popsize", len(sw.runs))
    assert text == GOLDEN.read_text(), f"regenerate {GOLDEN} if this change is intended:\n{text}"
    assert "#SBATCH --array=0-11%12" in text and "#SBATCH --signal=USR2@300" in text
    assert "apptainer exec --nv --bind /SWEEP" in text and text.count("srun") == 1


def test_submitit_is_the_pinned_version_whose_private_renderer_we_call():
    """render_sbatch calls submitit's private _make_sbatch_string: fail loudly when submitit changes under it."""
    import inspect

    import submitit
    from submitit.slurm.slurm import _make_sbatch_string

    assert submitit.__version__ == slurm.SUBMITIT_VERSION, "re-check render_sbatch and the golden script, then re-pin"
    params = inspect.signature(_make_sbatch_string).parameters
    assert {"command", "folder", "map_count", "array_parallelism", "signal_delay_s", "setup"} <= set(params)
    pin = next(x for x in (ROOT / "pyproject.toml").read_text().splitlines() if x.strip().startswith('"submitit'))
    assert f"submitit=={slurm.SUBMITIT_VERSION}" in pin


def test_array_chunks_respect_max_array_size():
    keys = [f"k{i}" for i in range(2500)]
    parts = slurm.chunks(keys, 1001)
    assert [len(p) for p in parts] == [1001, 1001, 498] and sum(parts, []) == keys


def test_docker_and_bare_python_commands():
    prof = load_profile("local", {"container": {"runtime": "docker", "image": "esbatch:latest", "env": {"A": "1"}}})
    cmd = slurm.python_command(prof, Path("/S"))
    assert cmd.startswith("docker run --rm --network host -v /S:/S -e A=1") and cmd.endswith("esbatch:latest python")
    assert "--gpus" not in cmd  # no GPUs requested
    import sys

    assert slurm.python_command(load_profile("local"), Path("/S")) == sys.executable


def test_sacct_array_states_are_parsed_in_one_call(monkeypatch):
    calls = []

    class Out:
        stdout = "7_0|COMPLETED\n7_1|RUNNING\n7_[2-4%2]|PENDING\n9_0|FAILED\n9_[1,3]|PENDING\n11|TIMEOUT\n"

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return Out()

    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    st = slurm.scheduler_states([{"kind": "slurm", "job_id": "7"}, {"kind": "slurm", "job_id": "9"}])
    assert len(calls) == 1 and calls[0][-1] == "7,9"
    assert st.pop(("11", 0)) == "TIMEOUT"  # a plain job (one-run submission)
    assert st == {
        ("7", 0): "COMPLETED",
        ("7", 1): "RUNNING",
        ("7", 2): "PENDING",
        ("7", 3): "PENDING",
        ("7", 4): "PENDING",
        ("9", 0): "FAILED",
        ("9", 1): "PENDING",
        ("9", 3): "PENDING",
    }


@pytest.mark.parametrize(
    "disk,sched,want",
    [
        ("finished", "FAILED", "finished"),
        ("pending", "PENDING", "queued"),
        ("killed", "REQUEUED", "queued"),
        ("running", "RUNNING", "running"),
        ("running", None, "interrupted"),  # the folder says running, no job owns it
        ("running", "CANCELLED by 0", "cancelled"),
        ("running", "TIMEOUT", "timeout"),
        ("pending", "FAILED", "failed"),
        ("killed", None, "killed"),
        ("pending", None, "pending"),
    ],
)
def test_combine_disk_and_scheduler_state(disk, sched, want):
    assert combine(disk, sched) == want


def test_run_key_survives_new_config_fields_with_defaults(tmp_path):
    import dataclasses

    from esbatch.config import Config, TrainConfig

    sw = load_sweep(str(write(tmp_path, base(tmp_path))))
    cfg = sw.runs[0].config
    key = run_key(cfg)
    # a later version adds run.new_knob with a default: existing runs keep their ids
    fields = [(f.name, f.type, f) for f in dataclasses.fields(type(cfg.run))]
    Extended = dataclasses.make_dataclass("RunConfig", [*fields, ("new_knob", int, dataclasses.field(default=3))])
    later = [
        (f.name, f.type, dataclasses.field(default_factory=Extended) if f.name == "run" else f)
        for f in dataclasses.fields(Config)
    ]
    LaterConfig = dataclasses.make_dataclass(
        "Config", later, bases=(TrainConfig,), namespace={"algorithm_sections": Config.algorithm_sections}
    )
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)}
    ext = LaterConfig(**{**values, "run": Extended(**dataclasses.asdict(cfg.run))})
    assert run_key(ext) == key
    ext.run.new_knob = 4
    assert run_key(ext) != key


SIGMA = {  # each way a sweep file varies es.sigma
    "grid": {"grid": {"es.sigma": [0.01, 0.02]}},
    "zip[0]": {"zip": [{"es.sigma": [0.01, 0.02], "es.alpha": [0.1, 0.2]}]},
    "methods.A": {"methods": {"A": {"es": {"sigma": 0.03}}, "B": {"es": {"alpha": 0.3}}}},
}
SEED = {  # and run.seed, which `seeds` varies too
    "grid": {"grid": {"run.seed": [3, 4]}},
    "zip[0]": {"zip": [{"run.seed": [3, 4]}]},
    "methods.A": {"methods": {"A": {"run": {"seed": 5}}, "B": {}}},
}
PAIRS = [(a, b, SIGMA) for a, b in itertools.combinations(SIGMA, 2)] + [("seeds", b, SEED) for b in SEED]


@pytest.mark.parametrize("first, second, axes", PAIRS, ids=[f"{a}+{b}" for a, b, _ in PAIRS])
def test_a_key_varied_by_two_axes_is_refused_naming_both(tmp_path, first, second, axes):
    one = {"seeds": [0, 1]} if first == "seeds" else axes[first]
    data = base(tmp_path, **one, **axes[second])
    with pytest.raises(ConfigError) as e:
        load_sweep(str(write(tmp_path, data)))
    key = "run.seed" if axes is SEED else "es.sigma"
    msg = next(m for m in e.value.errors if "one axis per key" in m)
    assert msg.startswith(f"{key}: varied by ") and first in msg and second in msg, msg


def test_different_keys_on_different_axes_and_methods_alone_are_fine(tmp_path):
    data = base(
        tmp_path,
        grid={"es.population_size": [4, 8]},
        zip=[{"es.sigma": [0.01, 0.02]}],
        seeds=[0],
        methods={"A": {"es": {"alpha": 0.1}}, "B": {"es": {"alpha": 0.2}}},
    )
    assert len(load_sweep(str(write(tmp_path, data))).runs) == 2 * 2 * 2
