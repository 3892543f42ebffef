"""The hostile-program suite (``test_sandbox_programs.py``) run by two evaluators at the same time: one as root
and one as an ordinary user (``nobody``, through ``setpriv``), as on a SLURM cluster.

``nobody`` cannot read /root (mode 700), where the venv and the checkout live, so its evaluator runs the system
python with a copy of ``esbatch/sandbox`` (standard library only) in a world-readable folder, and its home is a
mode-700 folder holding a mode-600 token. Each program's line says what went wrong, if anything: the verdict,
the evaluator itself (it must write the next line), a bystander process of the same user, leftovers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import test_sandbox_programs as programs

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = Path(programs.__file__).resolve()
NOBODY = 65534
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
WHO = ["root", "unprivileged"]
# A safety limit for each suite (they take ~15 s): minutes, so a loaded machine does not cut a suite short.
SUITE_TIMEOUT_S = 900

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox isolates programs with Linux namespaces"),
    # `suites` runs both suites once for the module's 52 cases, but a module fixture is per xdist worker: one group,
    # so one worker runs the module and the suites once (spread over the workers, each of them ran both suites)
    pytest.mark.xdist_group("sandbox_hostile"),
]


@dataclass
class Suite:
    skip: str | None = None
    proc: subprocess.Popen | None = None
    out: Path | None = None
    results: dict = field(default_factory=dict)
    stderr: str = ""


def _home(uid: int, private: bool) -> Path:
    """A home outside every folder the sandbox hides anyway (/tmp, /home...): only hiding $HOME protects it."""
    base = "/var/lib" if os.access("/var/lib", os.W_OK) else None
    home = Path(tempfile.mkdtemp(prefix="esbatch-sbx-home-", dir=base))
    (home / "private").mkdir()
    (home / "private" / "token").write_text(f"token-{uuid.uuid4().hex}\n")
    modes = (0o700, 0o700, 0o600) if private else (0o755, 0o755, 0o644)  # not private: only the hiding stops it
    for path, mode in zip((home, home / "private", home / "private" / "token"), modes):
        os.chown(path, uid, uid) if os.geteuid() == 0 else None
        path.chmod(mode)
    return home


def _nobody_can(cmd: list[str]) -> bool:
    try:
        return subprocess.run([*AS_NOBODY, *cmd], capture_output=True, timeout=60, cwd="/").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _nobody_python() -> tuple[str | None, str]:
    """A python ``nobody`` can run and that may create a user namespace, or (None, why not)."""
    if not shutil.which("setpriv"):
        return None, "setpriv (util-linux) is not installed"
    with open("/proc/sys/user/max_user_namespaces") as f:
        if int(f.read()) == 0:
            return None, "user namespaces are disabled (/proc/sys/user/max_user_namespaces is 0)"
    candidates = ["/usr/bin/python3", "/usr/local/bin/python3", os.path.realpath(sys.executable)]
    python = next((p for p in candidates if os.path.exists(p) and _nobody_can([p, "-c", "pass"])), None)
    if python is None:
        return None, f"the user nobody can execute none of {candidates}"
    userns = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x10000000))"
    if not _nobody_can([python, "-c", userns]):
        return None, "the kernel refuses the user nobody a user namespace"
    return python, ""


def _stage(python: str) -> Path:
    """A world-readable copy of what the unprivileged evaluator imports."""
    stage = Path(tempfile.mkdtemp(prefix="esbatch-sbx-stage-"))
    no_cache = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "esbatch" / "sandbox", stage / "esbatch" / "sandbox", ignore=no_cache)
    for module in ("__init__.py", "importgc.py"):  # the package's own import
        shutil.copy(REPO / "esbatch" / module, stage / "esbatch" / module)
    shutil.copy(PROGRAMS, stage / PROGRAMS.name)
    for path in [stage, *stage.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return stage


def _start(who: str, secret: str, cleanup: list[Path]) -> Suite:
    root = os.geteuid() == 0
    env = {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "ESBATCH_SUITE_SECRET": secret}
    if who == "root":
        if not root:
            return Suite(skip="the tests do not run as root: only the unprivileged suite applies")
        home, cmd, cwd = _home(0, private=False), [sys.executable, "-B", str(PROGRAMS)], REPO
        env["PYTHONPATH"] = str(REPO)
    elif root:
        python, why = _nobody_python()
        if python is None:
            return Suite(skip=why)
        cwd = _stage(python)
        home, cmd = _home(NOBODY, private=True), [*AS_NOBODY, python, "-s", "-B", str(cwd / PROGRAMS.name)]
        cleanup.append(cwd)
    else:  # already unprivileged: this user is the one under test
        home, cmd, cwd = _home(os.getuid(), private=True), [sys.executable, "-B", str(PROGRAMS)], REPO
        env["PYTHONPATH"] = str(REPO)
    cleanup.append(home)
    out = Path(tempfile.mkdtemp(prefix=f"esbatch-sbx-{who}-")) / "results.jsonl"
    cleanup.append(out.parent)
    out.touch()
    if who != "root" and root:
        os.chown(out.parent, NOBODY, NOBODY)
        os.chown(out, NOBODY, NOBODY)
    env["HOME"] = str(home)
    proc = subprocess.Popen([*cmd, str(out)], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return Suite(proc=proc, out=out)


def _finish(suite: Suite) -> None:
    if suite.skip:
        return
    try:
        suite.stderr = suite.proc.communicate(timeout=SUITE_TIMEOUT_S)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        suite.proc.kill()
        suite.stderr = suite.proc.communicate()[0].decode(errors="replace") + "\n[suite timed out]"
    for line in suite.out.read_text().splitlines():
        entry = json.loads(line)
        suite.results[entry["name"]] = entry


@pytest.fixture(scope="module")
def suites():
    """Both suites, run concurrently (two evaluators on one machine), once for all the tests below."""
    secret, cleanup = f"env-secret-{uuid.uuid4().hex}", []
    started = {who: _start(who, secret, cleanup) for who in WHO}
    try:
        for suite in started.values():
            _finish(suite)
        yield started
    finally:
        for s in started.values():
            if s.proc and s.proc.poll() is None:
                s.proc.kill()
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", list(programs.CASES))
@pytest.mark.parametrize("who", WHO)
def test_hostile_program(suites, who, name):
    suite = suites[who]
    if suite.skip:
        pytest.skip(suite.skip)
    if name not in suite.results:
        rc, log = suite.proc.returncode, suite.stderr[-3000:]
        pytest.fail(f"no result: the {who} evaluator died (exit {rc}) before or during {name!r}\n{log}")
    entry = suite.results[name]
    assert entry["problems"] == [], json.dumps(entry, indent=1)


@pytest.mark.parametrize("who", WHO)
def test_evaluator_survives_the_suite_isolated(suites, who):
    suite = suites[who]
    if suite.skip:
        pytest.skip(suite.skip)
    assert suite.proc.returncode == 0 and "done" in suite.results, suite.stderr[-3000:]
    header = suite.results["header"]
    report = header["report"]
    assert report["isolated"] is True, report
    assert report["pid_namespace"] and report["network_namespace"] and report["mount_namespace"]
    if who == "root":
        assert header["uid"] == 0 and report["uid_block"], report
    else:
        assert header["uid"] != 0 and report["user"] == "unprivileged user namespace", report
        assert report["tree_limits"].startswith(("accounting", "cgroup")), report
