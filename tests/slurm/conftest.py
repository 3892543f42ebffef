"""A real single-node SLURM cluster (scripts/slurm/start-slurm.sh) for the launch tests.

Started once per session and stopped at its end (scripts/slurm/stop-slurm.sh), unless it was already
running before the tests: then it is left as it was found. Where it cannot start (not root, no apt) the
tests are skipped, unless ESBATCH_REQUIRE_SLURM=1 (set by .ci/run), which turns that into a failure.
"""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _one_worker() -> None:
    """Under pytest-xdist, fail unless every SLURM test runs on the worker that started the cluster: each worker's
    session would start (and at its end stop) the one cluster under the others. Each test module here is in the
    xdist group "slurm" (its pytestmark), which `--dist loadgroup` sends to one worker."""
    run, worker = os.environ.get("PYTEST_XDIST_TESTRUNUID"), os.environ.get("PYTEST_XDIST_WORKER", "")
    if not run:
        return
    claim = Path(tempfile.gettempdir()) / f"esbatch-slurm-tests-{run}"
    mine = claim.with_name(f"{claim.name}.{worker}")
    mine.write_text(worker)
    try:
        os.link(mine, claim)  # atomic: the first worker's name, complete, or nothing
    except FileExistsError:
        owner = claim.read_text()
        if owner != worker:
            pytest.fail(
                f"SLURM tests on xdist workers {owner} and {worker}: they share one cluster, so every module in "
                'tests/slurm needs pytestmark xdist_group("slurm") and the run --dist loadgroup'
            )


def _running() -> bool:
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "is UP" in out


@pytest.fixture(scope="session")
def slurm_cluster():
    require = os.environ.get("ESBATCH_REQUIRE_SLURM") == "1"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        if require:
            pytest.fail("ESBATCH_REQUIRE_SLURM=1 but the test cluster needs root and apt-get")
        pytest.skip("the single-node SLURM test cluster needs root and apt-get")
    _one_worker()
    was_running = _running()
    env = {**os.environ, "SLURM_CI_CPUS": "24"}  # 16 concurrent 1-CPU tasks + the aggregator on 2 real cores
    p = subprocess.run(["bash", str(ROOT / "scripts/slurm/start-slurm.sh")], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        msg = f"start-slurm.sh failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        if require:
            pytest.fail(msg)
        pytest.skip(msg)
    yield True
    if not was_running:  # leave the machine as the tests found it
        subprocess.run(["bash", str(ROOT / "scripts/slurm/stop-slurm.sh")], env=env, capture_output=True, timeout=300)
