"""The images, built for real, with no container registry (docs/containers.md).

CPU: scripts/build-image.sh builds the Dockerfile with podman on a base it makes itself (debootstrap, Debian
bookworm, ACCELERATOR=cpu); esbatch runs inside it: `esbatch --version` and a one-update quickstart.

CUDA: `build-image.sh cuda` builds the CUDA image's root file system (debootstrapped Ubuntu noble, the
Dockerfile's pins) and a .sif from it; checked without a GPU in a chroot: esbatch --version, the stack's versions
and torch's CUDA, `esbatch validate` of every built-in file, a one-update ES run and a one-step GRPO run on the
CPU (CUDA torch runs on the CPU where no GPU is), then the SIF's descriptors and partition, and esbatch run from
the unpacked partition.

Opt-in, and never in CI, which builds no image: the CUDA build downloads ~4 GB and takes ~30 minutes the first
time (a rebuild reinstalls only esbatch), the CPU one ~10 minutes. Set ESBATCH_IMAGE_TEST=1 to run them; they skip
with the reason where podman (CPU) or root, debootstrap, squashfs-tools and siftool (CUDA) are missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import esbatch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build-image.sh"


OPT_IN = "builds an image (GBs, minutes; CI builds none): set ESBATCH_IMAGE_TEST=1 to run it"


def _why_not() -> str | None:
    if os.environ.get("ESBATCH_IMAGE_TEST") != "1":
        return OPT_IN
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman debootstrap)"
    if os.geteuid() != 0:
        return "scripts/build-image.sh needs root (rootful podman; debootstrap)"
    if shutil.which("debootstrap") is None and _podman("image", "exists", _base()).returncode != 0:
        return "debootstrap is not installed and there is no base image yet (apt-get install debootstrap)"
    r = _podman("info")
    if r.returncode != 0:
        return f"`podman info` failed: {r.stderr.strip()[-500:]}"
    return None


def _base() -> str:
    return os.environ.get("ESBATCH_BASE_IMAGE", "localhost/debian-base:bookworm")


def _podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120)


_REASON = _why_not()
cpu_image = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
pytestmark = pytest.mark.slow


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def image():
    """Build (or find cached) the CPU image; skip when podman cannot start a container on this machine."""
    r = _script("build", timeout=3600)
    if r.returncode != 0 and "podman run with the defaults was refused" in r.stderr and " and with " in r.stderr:
        pytest.skip(f"podman cannot run containers here: {r.stderr.strip()[-800:]}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return os.environ.get("ESBATCH_IMAGE", "localhost/esbatch:cpu")


@cpu_image
def test_esbatch_version_in_the_image(image):
    r = _script("run", "esbatch", "--version", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"esbatch {esbatch.__version__}"


@cpu_image
def test_the_image_holds_the_cpu_stack(image):
    """The CPU torch (not PyPI's CUDA build), DeepSpeed, no vLLM, and the image's unprivileged user."""
    code = (
        "import importlib.util, os, deepspeed, torch; "
        "print('STACK', os.getuid(), torch.__version__, deepspeed.__version__, importlib.util.find_spec('vllm'))"
    )
    r = _script("run", "python", "-c", code, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [s for s in r.stdout.splitlines() if s.startswith("STACK ")]  # DeepSpeed logs to stdout too
    _, uid, torch_version, _, vllm = line.split()
    assert (uid, vllm) == ("10001", "None"), line
    assert torch_version.endswith("+cpu"), line


@cpu_image
def test_one_update_quickstart_in_the_image(image, tmp_path):
    """The built-in quickstart (SmolLM2-135M from the image, ES, 2-digit addition), cut to one small update."""
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)  # the image's user (uid 10001) writes here
    small = ["es.updates=1", "es.population_size=2", "es.batch_size=4", "task.heldout_size=8"]
    sets = [a for s in small for a in ("--set", s)]
    r = _script(
        "run",
        *("-e", "OMP_NUM_THREADS=1", "-v", f"{runs}:/home/esbatch/esbatch-runs", "--"),
        *("esbatch", "train", "quickstart", "--no-progress", *sets),
        timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done: 1 updates" in r.stdout, r.stdout
    run = runs / "quickstart-run"
    updates = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert len(updates) == 1, updates
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals, "no held-out evaluation was logged"
    assert (run / "center.safetensors").is_file()


# ---- the CUDA image: root file system and .sif, checked in a chroot without a GPU ------------------------------


def _why_not_cuda() -> str | None:
    if os.environ.get("ESBATCH_IMAGE_TEST") != "1":
        return OPT_IN
    if os.geteuid() != 0:
        return "build-image.sh cuda needs root (debootstrap, chroot, mounts)"
    missing = [t for t in ("debootstrap", "mksquashfs", "unsquashfs", "siftool", "chroot") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install debootstrap squashfs-tools siftool)"
    return None


_CUDA_REASON = _why_not_cuda()
cuda_image = pytest.mark.skipif(_CUDA_REASON is not None, reason=_CUDA_REASON or "")
CUDA_WORK = Path(os.environ.get("ESBATCH_CUDA_WORK", "/var/tmp/esbatch-image/cuda"))


def _pins() -> dict[str, str]:
    r = _script("cuda", "pins", timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines())


def _in_image(*cmd: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """CMD in the CUDA tree (chroot, the image's environment), on the CPU: OMP_NUM_THREADS=1, no GPU."""
    return _script("cuda", "exec", "env", "OMP_NUM_THREADS=1", "CUDA_VISIBLE_DEVICES=", *cmd, timeout=timeout)


@pytest.fixture(scope="module")
def cuda_root() -> Path:
    """Build the CUDA tree where there is none (`build-image.sh cuda rootfs` brings an existing one up to date:
    run it after changing esbatch). Returns the overlay's upper layer, where what `cuda exec` commands write lands
    (the tree itself stays as built)."""
    if not (CUDA_WORK / "rootfs" / "opt" / "venv" / "bin" / "esbatch").exists():
        r = _script("cuda", "rootfs", timeout=5400)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    shutil.rmtree(CUDA_WORK / "upper", ignore_errors=True)
    (CUDA_WORK / "upper").mkdir()
    return CUDA_WORK / "upper"


@cuda_image
def test_cuda_image_esbatch_version(cuda_root):
    r = _in_image("esbatch", "--version", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"esbatch {esbatch.__version__}"


@cuda_image
def test_cuda_image_holds_the_pinned_stack_for_the_base_cuda(cuda_root):
    code = (
        "import deepspeed, mlflow, torch, transformers, vllm, json; print('STACK ' + json.dumps({"
        "'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpu': torch.cuda.is_available(), "
        "'vllm': vllm.__version__, 'deepspeed': deepspeed.__version__, 'transformers': transformers.__version__, "
        "'mlflow': mlflow.__version__}))"
    )
    r = _in_image("python", "-c", code, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (line,) = [s for s in r.stdout.splitlines() if s.startswith("STACK ")]
    got, pins = json.loads(line[6:]), _pins()
    assert (got["torch"].split("+")[0], got["vllm"], got["deepspeed"]) == (
        pins["TORCH_VERSION"],
        pins["VLLM_VERSION"],
        pins["DEEPSPEED_VERSION"],
    ), got
    assert got["torch"].endswith("+cu" + pins["CUDA"].replace(".", "")), got  # PyPI's CUDA build (+cu130)
    assert got["cuda"] == pins["CUDA"] and got["gpu"] is False, got  # no GPU here


@cuda_image
def test_cuda_image_validates_every_builtin_file(cuda_root):
    builtin = Path(esbatch.__file__).parent / "builtin"
    for kind in ("configs", "sweeps", "launchers", "evals"):
        names = sorted(p.stem for p in (builtin / kind).glob("*.yaml"))
        assert names, kind
        flag = kind.rstrip("s")
        r = _in_image("esbatch", "validate", "--kind", flag, *names, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert r.stdout.count("ok: ") == len(names), r.stdout


@cuda_image
def test_cuda_image_one_es_update_on_the_cpu(cuda_root):
    out = cuda_root / "tmp" / "esbatch-check-es"
    shutil.rmtree(out, ignore_errors=True)
    small = ["es.updates=1", "es.population_size=2", "es.batch_size=4", "task.heldout_size=8"]
    small.append("run.output_dir=/tmp/esbatch-check-es")
    sets = [a for s in small for a in ("--set", s)]
    r = _in_image("esbatch", "train", "quickstart", "--no-progress", *sets, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done: 1 updates" in r.stdout, r.stdout
    run = out / "quickstart-run"
    assert len((run / "log.jsonl").read_text().splitlines()) == 1
    assert (run / "center.safetensors").is_file()


@cuda_image
def test_cuda_image_one_grpo_step_on_the_cpu(cuda_root):
    """One GRPO step of the image's SmolLM2 on its arithmetic task, one rank, HF generation, on the CPU."""
    out = cuda_root / "tmp" / "esbatch-check-grpo"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = {
        "algorithm": "grpo",
        "run": {"name": "g", "seed": 1, "output_dir": "/tmp/esbatch-check-grpo", "threads": 1},
        "model": {"name": "smollm2-135m-instruct", "dtype": "float32"},
        "task": {"name": "arithmetic", "heldout_size": 2},
        "generation": {"max_new_tokens": 8, "batch_size": 4},
        "grpo": {"group_size": 2, "batch_size": 2, "updates": 1},
        "eval": {"every": 0},
        "tracking": {"experiment": "image-check"},
    }
    (out / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    r = _in_image("sh", "-c", "cd /tmp/esbatch-check-grpo && esbatch train grpo.yaml --no-progress", timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "done: 1 GRPO steps" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    log = [json.loads(x) for x in (out / "g" / "log.jsonl").read_text().splitlines()]
    assert [x["t"] for x in log] == [0]


@cuda_image
def test_cuda_sif_descriptors_partition_and_esbatch_from_it(cuda_root, tmp_path):
    """The .sif (made where there is none: `build-image.sh cuda sif` remakes it) as Apptainer would read it."""
    sif = CUDA_WORK / "esbatch.sif"
    if not sif.exists():
        r = _script("cuda", "sif", timeout=7200)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    listing = subprocess.run(["siftool", "list", str(sif)], capture_output=True, text=True, timeout=60).stdout
    # what an Apptainer-built SIF lists: the definition, the JSON metadata, the primary system squashfs partition
    rows = [ln.split("|") for ln in listing.splitlines() if ln[:1].isdigit()]
    kinds = [row[-1].strip() for row in rows]
    assert kinds == ["Def.FILE", "JSON.Generic", "FS (Squashfs/*System/amd64)"], listing
    info = subprocess.run(["siftool", "info", "3", str(sif)], capture_output=True, text=True, timeout=60).stdout
    assert "Partition Type:   *System" in info and "Filesystem Type:  Squashfs" in info, info  # *: primary
    head = subprocess.run(["siftool", "header", str(sif)], capture_output=True, text=True, timeout=60).stdout
    assert "Primary Architecture: amd64" in head, head
    start = int(rows[2][3].split("-")[0])
    ls = subprocess.run(
        ["unsquashfs", "-o", str(start), "-l", str(sif)], capture_output=True, text=True, timeout=600
    ).stdout.splitlines()
    have = {ln.removeprefix("squashfs-root") for ln in ls}
    for path in (
        "/proc",  # the mount points apptainer mounts on, empty
        "/sys",
        "/dev",
        "/bin",
        "/usr/bin/sh",
        "/.singularity.d/actions/exec",
        "/.singularity.d/actions/run",
        "/.singularity.d/actions/shell",
        "/.singularity.d/actions/test",
        "/.singularity.d/env/90-environment.sh",
        "/.singularity.d/labels.json",
        "/.singularity.d/runscript",
        "/opt/venv/bin/python",
        "/opt/venv/bin/esbatch",
    ):
        assert path in have, path
    # the partition, unpacked, runs esbatch (the files the partition holds, not the tree it was made from)
    dest = tmp_path / "unpacked"
    u = subprocess.run(
        ["unsquashfs", "-o", str(start), "-d", str(dest), "-processors", "1", "-no-progress", str(sif)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert u.returncode == 0, u.stderr[-2000:]
    run = subprocess.run(
        ["chroot", str(dest), "/.singularity.d/actions/exec", "esbatch", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == f"esbatch {esbatch.__version__}"
