"""esbatch works when installed from a wheel, not just in a checkout: the built-in sweeps, launcher profiles,
configs and eval configs ship inside the package and are found by name from any folder, and files in the
user's own sweeps/ and launchers/ folders override them."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

# The wheel and its venv (`installed`) are a module fixture, built once per xdist worker: one group, so one worker
# runs this module and builds it once (spread over the workers, each of them built it).
pytestmark = pytest.mark.xdist_group("installed")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A throwaway venv holding only the esbatch wheel; its dependencies come from this environment's
    site-packages through a path entry (which, unlike a site dir, does not activate the editable checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # build from a copy: setuptools leaves build/ and *.egg-info in the tree it builds
    shutil.copytree(ROOT / "esbatch", src / "esbatch", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp.glob("esbatch-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(
        subprocess.run(
            [venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], check=True
    )
    (site / "zz_esbatch_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return venv, elsewhere, wheel


def esbatch(installed, *args: str) -> subprocess.CompletedProcess:
    venv, cwd, _ = installed
    return subprocess.run(
        [venv / "bin/python", "-m", "esbatch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "OMP_NUM_THREADS": "1"},
    )


def test_the_wheel_carries_every_builtin_file(installed):
    import zipfile

    names = set(zipfile.ZipFile(installed[2]).namelist())
    for folder in ("configs", "evals", "sweeps", "launchers"):
        shipped = {p.name for p in (ROOT / "esbatch" / "builtin" / folder).glob("*.yaml")}
        assert shipped and {f"esbatch/builtin/{folder}/{n}" for n in shipped} <= names, folder
    # the ES noise: its quantile table, and the C kernel built on first use (without it: eager torch, ~100x slower)
    assert {"esbatch/perturb/gauss_table.npy", "esbatch/perturb/noise_cpu.c"} <= names


def test_the_installed_package_runs_outside_the_checkout(installed):
    venv, cwd, _ = installed
    p = (
        esbatch(installed, "-c")
        if False
        else subprocess.run(
            [venv / "bin/python", "-c", "import esbatch; print(esbatch.__file__)"],
            cwd=cwd,
            capture_output=True,
            text=True,
        )
    )
    assert str(venv) in p.stdout and str(ROOT) not in p.stdout, p.stdout + p.stderr
    p = esbatch(installed, "sweep", "popsize", "--dry-run")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "sweep popsize: 12 runs, launcher a100 (slurm)" in p.stdout and "#SBATCH --array=0-11%12" in p.stdout
    p = esbatch(installed, "ls")
    assert p.returncode == 0 and "a100" in p.stdout and "popsize" in p.stdout and "eval-easy" in p.stdout, p.stderr
    p = esbatch(installed, "validate", "popsize", "a100", "eval-easy", "gsm8k-qwen")
    assert p.returncode == 0 and p.stdout.count("ok: ") == 4, p.stdout + p.stderr


def test_the_users_own_sweeps_and_launchers_override_the_builtin_ones(installed):
    _, cwd, _ = installed
    (cwd / "sweeps").mkdir()
    (cwd / "launchers").mkdir()
    mine = yaml.safe_load((ROOT / "esbatch/builtin/sweeps/popsize.yaml").read_text())
    mine["grid"] = {"es.population_size": [8, 16]}
    mine["launcher"] = "mycluster"
    (cwd / "sweeps" / "popsize.yaml").write_text(yaml.safe_dump(mine))
    (cwd / "launchers" / "mycluster.yaml").write_text("cluster: slurm\npartition: mine\ntime: '1:00:00'\n")
    p = esbatch(installed, "sweep", "popsize", "--dry-run")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "sweep popsize: 2 runs, launcher mycluster (slurm)" in p.stdout and "#SBATCH --partition=mine" in p.stdout


def test_the_installed_package_trains(installed, tiny_model_dir):
    _, cwd, _ = installed
    cfg = {
        "run": {"name": "r", "output_dir": str(cwd / "runs"), "threads": 1},
        "model": {"name": str(tiny_model_dir)},
        "task": {"name": "arithmetic", "train_size": 8, "heldout_size": 2},
        "generation": {"max_new_tokens": 4, "batch_size": 8},
        "es": {"population_size": 2, "batch_size": 2, "updates": 1},
    }
    (cwd / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    p = esbatch(installed, "train", "tiny.yaml", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "done: 1 updates" in p.stdout and (cwd / "runs" / "r" / "center.safetensors").exists()
    assert "no C kernel" not in p.stderr and list((cwd / ".cache" / "esbatch").glob("noise-*.so")), p.stderr[-2000:]
