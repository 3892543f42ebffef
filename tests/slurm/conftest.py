"""A real single-node SLURM cluster (scripts/slurm/start-slurm.sh) for the launch tests.

Started once per session. Where it cannot start (not root, no apt) the tests are skipped, unless
ESBATCH_REQUIRE_SLURM=1 (set by .ci/run), which turns that into a failure.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm_cluster():
    require = os.environ.get("ESBATCH_REQUIRE_SLURM") == "1"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        if require:
            pytest.fail("ESBATCH_REQUIRE_SLURM=1 but the test cluster needs root and apt-get")
        pytest.skip("the single-node SLURM test cluster needs root and apt-get")
    env = {**os.environ, "SLURM_CI_CPUS": "24"}  # 16 concurrent 1-CPU tasks + the aggregator on 2 real cores
    p = subprocess.run(["bash", str(ROOT / "scripts/slurm/start-slurm.sh")], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        msg = f"start-slurm.sh failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        if require:
            pytest.fail(msg)
        pytest.skip(msg)
    return True
