"""The image's pins install together, checked on every run against the package registry: a resolver asked for
torch, vLLM and DeepSpeed at the pins the CUDA image installs (read by scripts/build-image.sh from the Dockerfile's
ARGs) together with esbatch itself (its pyproject.toml requirements, transformers and mlflow among them), for the
image's Python and platform (3.12, manylinux_2_28 x86_64), must find one set of versions. A conflict fails the test
with the resolver's explanation; only a registry that cannot be reached skips it. Nothing is installed.

The resolver is uv's (`uv pip compile`): the one scripts/uv_pip.py put into this venv, else uv on PATH, else that
script's UV_VERSION fetched from the registry into a temporary folder:
it reads a wheel's metadata with HTTP range requests, where pip downloads every wheel whole when the registry
serves no separate metadata (~3 GB, 3 minutes here), and it resolves for another Python version while still
building the metadata of sdist-only dependencies (DeepSpeed; cellpylib under reasoning-gym), which pip refuses
with --python-version. DeepSpeed's metadata is built with DS_BUILD_OPS=0 DS_ACCELERATOR=cuda, as in the image.
~20 s with a cold cache here."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build-image.sh"
NETWORK = ("error sending request", "Failed to fetch", "dns error", "Connection refused", "timed out")

pytestmark = pytest.mark.slow


def _pins() -> dict[str, str]:
    out = subprocess.run([str(SCRIPT), "cuda", "pins"], capture_output=True, text=True, timeout=60, check=True)
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def _index() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _unreachable() -> str | None:
    url = f"{_index()}/torch/"
    try:
        with urllib.request.urlopen(url, timeout=15) as r:  # noqa: S310 - the registry's index page
            r.read(1024)
    except (urllib.error.URLError, OSError) as e:
        return f"the package registry cannot be reached ({url}: {e}); the pins were not resolved"
    return None


def _uv_version() -> str:
    """scripts/uv_pip.py's pin: the uv that set up this project's venvs."""
    spec = importlib.util.spec_from_file_location("uv_pip", ROOT / "scripts" / "uv_pip.py")
    uv_pip = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(uv_pip)
    return uv_pip.UV_VERSION


def _uv(tmp: Path, env: dict[str, str]) -> str:
    if (venv := Path(sys.executable).with_name("uv")).is_file():  # scripts/uv_pip.py installed it
        return str(venv)
    if found := shutil.which("uv"):
        return found
    version = _uv_version()
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp / "uv")]
    r = subprocess.run([*cmd, f"uv=={version}"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"installing the resolver uv=={version} failed:\n{r.stderr[-2000:]}"
    return str(tmp / "uv" / "bin" / "uv")


def _resolve(tmp: Path, lines: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """`uv pip compile` of ``lines`` for the image's Python and platform: (the process, {name: version})."""
    pins = _pins()
    if why := _unreachable():
        pytest.skip(why)
    # this host's own pip settings (a local wheel folder, extra indexes, constraints) stay out: the registry answers
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_")) or k in ("PIP_INDEX_URL", "PIP_CERT")
    }
    env.update(PIP_CONFIG_FILE=os.devnull, DS_BUILD_OPS="0", DS_ACCELERATOR="cuda")
    if os.environ.get("PIP_CERT"):  # a TLS-inspecting proxy's CA bundle: uv reads it from SSL_CERT_FILE
        env["SSL_CERT_FILE"] = os.environ["PIP_CERT"]
    uv = _uv(tmp, env)
    reqs, out = tmp / "requirements.in", tmp / "resolved.txt"
    reqs.write_text("".join(f"{line}\n" for line in lines))
    cmd = [uv, "pip", "compile", "--no-config", "--quiet", "--index-url", _index(), str(reqs), "-o", str(out)]
    cmd += ["--python-version", pins["PYTHON_VERSION"], "--python-platform", "x86_64-manylinux_2_28"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 and "No solution found" not in r.stderr and any(s in r.stderr for s in NETWORK):
        pytest.skip(f"the registry stopped answering during the resolve: {r.stderr.strip()[-600:]}")
    got = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", out.read_text(), re.M)) if out.exists() else {}
    return r, {k.lower().replace("_", "-"): v for k, v in got.items()}


def test_the_cuda_image_pins_and_esbatch_resolve_together(tmp_path):
    pins = _pins()
    wanted = [f"torch=={pins['TORCH_VERSION']}", f"vllm=={pins['VLLM_VERSION']}"]
    wanted += [f"deepspeed=={pins['DEEPSPEED_VERSION']}", str(ROOT)]  # ROOT: esbatch and its requirements
    r, got = _resolve(tmp_path, wanted)
    assert r.returncode == 0, f"the image's pins do not install together:\n{r.stderr[-4000:]}"
    for name, key in (("torch", "TORCH_VERSION"), ("vllm", "VLLM_VERSION"), ("deepspeed", "DEEPSPEED_VERSION")):
        assert got.get(name) == pins[key], (name, got.get(name), pins[key])
    assert "transformers" in got and "mlflow" in got, sorted(got)
    # torch's CUDA runtime comes with it from the registry, for the CUDA release of the Dockerfile's base
    assert got.get("cuda-toolkit", "").startswith(pins["CUDA"] + "."), got.get("cuda-toolkit")


def test_a_conflict_fails_the_check(tmp_path):
    """The check can fail: vLLM pins torch exactly, so any other torch beside the vLLM pin has no solution."""
    pins = _pins()
    r, _ = _resolve(tmp_path, [f"torch!={pins['TORCH_VERSION']}", f"vllm=={pins['VLLM_VERSION']}"])
    assert r.returncode != 0 and "No solution found" in r.stderr, r.stderr[-2000:]
    assert "torch" in r.stderr
