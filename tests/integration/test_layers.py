"""The import layers of pyproject.toml ([tool.importlinter]) hold, and the check catches a violation."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lint(cwd: Path) -> subprocess.CompletedProcess:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    env = {"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(lint_imports), "--no-cache"], cwd=cwd, capture_output=True, text=True, env=env)


def test_layers_and_no_cycles_hold():
    p = lint(ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "esbatch layers KEPT" in p.stdout and "no import cycles between esbatch's packages KEPT" in p.stdout


def test_an_upward_import_or_a_cycle_is_caught(tmp_path):
    shutil.copytree(ROOT / "esbatch", tmp_path / "esbatch", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "esbatch" / "tasks" / "base.py", "a") as f:
        f.write("\nfrom esbatch.launch.state import SweepDir  # noqa: E402,F401 - planted: tasks -> launch\n")
    with open(tmp_path / "esbatch" / "train" / "rundir.py", "a") as f:
        f.write("\nimport esbatch.train.lifecycle  # noqa: E402,F401 - planted: a cycle inside train\n")
    p = lint(tmp_path)
    assert p.returncode != 0
    assert "esbatch layers BROKEN" in p.stdout and "esbatch.tasks.base -> esbatch.launch.state" in p.stdout
    assert "no import cycles between esbatch's packages BROKEN" in p.stdout
