"""The container recipes: Dockerfile and apptainer.def pin the same versions on the same base (hadolint on the
Dockerfile runs a tool: tests/integration/test_containers_hadolint.py; the CPU image is built and run by
tests/integration/test_image_build.py, opt-in; the CUDA image on a cluster)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
APPTAINER_DEF = ROOT / "apptainer.def"
VERSION = re.compile(r"\d+(\.\d+)+(\.?post\d+)?")
# a CUDA base named down to the patch release and the OS release, e.g. nvidia/cuda:13.0.3-devel-ubuntu24.04
CUDA_BASE = re.compile(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+")
PIN = re.compile(r"([A-Za-z0-9_.-]+)==\$\{?(\w+_VERSION)\}?")


def _instructions(text: str) -> list[tuple[str, str]]:
    """Dockerfile -> [(INSTRUCTION, arguments)], continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _dockerfile() -> dict:
    ins = _instructions(DOCKERFILE.read_text())
    first_from = next(i for i, (w, _) in enumerate(ins) if w == "FROM")
    args = dict(a.split("=", 1) for w, a in ins[:first_from] if w == "ARG")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ins[first_from][1].split()[0])
    env: dict[str, str] = {}
    for w, a in ins:
        if w == "ENV":
            env.update(kv.split("=", 1) for kv in shlex.split(a))
    return {"instructions": ins, "args": args, "base": base, "env": env}


def _apptainer() -> dict:
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for line in APPTAINER_DEF.read_text().splitlines():
        if line.startswith("%"):
            current = line[1:].split()[0]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
        elif ":" in line and not line.lstrip().startswith("#"):
            k, _, v = line.partition(":")
            header[k.strip()] = v.strip()
    pins = {}
    for line in sections.get("post", []):
        m = re.fullmatch(r"\s*(\w+_VERSION)=(\S+)\s*", line)
        if m:
            pins[m.group(1)] = m.group(2)
    env: dict[str, str] = {}
    for line in sections.get("environment", []):
        m = re.fullmatch(r"\s*export (\w+)=(\S+)\s*", line)
        if m:
            env.setdefault(m.group(1), m.group(2))  # the first export; later ones are fallbacks
    labels = dict(line.strip().split(None, 1) for line in sections.get("labels", []) if line.strip())
    return {"header": header, "sections": sections, "pins": pins, "env": env, "labels": labels}


def _pip_requirements(shell: str) -> list[str]:
    """The requirement arguments of every `pip install` in a shell text (options and local paths left out)."""
    reqs = []
    for cmd in re.split(r"&&|\n|;", shell.replace("\\\n", " ")):
        words = shlex.split(cmd, comments=True)
        if "pip" not in words or "install" not in words[words.index("pip") :]:
            continue
        rest = words[words.index("install", words.index("pip")) + 1 :]
        skip = False
        for w in rest:
            if skip:
                skip = False
            elif w in ("-c", "--constraint", "-r", "--requirement"):
                skip = True
            elif not w.startswith(("-", "/", ".")):
                reqs.append(w)
    return reqs


def test_both_recipes_exist():
    assert DOCKERFILE.is_file() and APPTAINER_DEF.is_file()


def test_pinned_versions_are_identical_in_dockerfile_and_apptainer_def():
    d, a = _dockerfile(), _apptainer()
    docker_pins = {k: v for k, v in d["args"].items() if k.endswith("_VERSION")}
    assert {"PYTHON_VERSION", "TORCH_VERSION", "VLLM_VERSION", "DEEPSPEED_VERSION"} <= docker_pins.keys()
    assert docker_pins == a["pins"], f"Dockerfile ARGs {docker_pins} != apptainer.def %post {a['pins']}"
    for name, v in docker_pins.items():
        assert VERSION.fullmatch(v), f"{name}={v} is not an exact version"
    # the labels that record the versions agree too
    for pkg in ("torch", "vllm", "deepspeed"):
        assert a["labels"][f"esbatch.{pkg}"] == docker_pins[f"{pkg.upper()}_VERSION"]


def test_same_cuda_base_image_named_by_exact_tag():
    d, a = _dockerfile(), _apptainer()
    assert a["header"]["Bootstrap"] == "docker"
    assert d["base"] == a["header"]["From"], (d["base"], a["header"]["From"])
    assert CUDA_BASE.fullmatch(d["base"]), f"base image {d['base']} is not pinned to a CUDA release"


def test_every_pip_install_is_pinned_through_the_version_args():
    """hadolint accepts `pip install -c FILE torch`, so check the pins here: each requirement is NAME==${X_VERSION}."""
    d, a = _dockerfile(), _apptainer()
    docker_run = "\n".join(arg for w, arg in d["instructions"] if w == "RUN")
    post = "\n".join(a["sections"]["post"])
    found = {}
    for where, shell in (("Dockerfile", docker_run), ("apptainer.def", post)):
        reqs = _pip_requirements(shell)
        assert reqs, f"{where}: no pip install found"
        for r in reqs:
            assert PIN.fullmatch(r), f"{where}: `pip install {r}` is not pinned as NAME==${{X_VERSION}}"
        found[where] = {PIN.fullmatch(r).groups() for r in reqs}
    assert found["Dockerfile"] == found["apptainer.def"]
    assert {("torch", "TORCH_VERSION"), ("vllm", "VLLM_VERSION"), ("deepspeed", "DEEPSPEED_VERSION")} <= found[
        "Dockerfile"
    ]


def test_same_cache_and_scratch_environment():
    d, a = _dockerfile(), _apptainer()
    docker_env = {k: v.replace("${PATH}", "$PATH") for k, v in d["env"].items()}
    assert docker_env == a["env"]
    assert docker_env["HF_HOME"] == "/hf-cache"
    assert docker_env["ESBATCH_CACHE"].startswith("/scratch/")


def test_entry_points_run_esbatch_as_a_non_root_user():
    ins = _dockerfile()["instructions"]
    healthcheck = next(a for w, a in ins if w == "HEALTHCHECK")
    assert healthcheck.endswith('CMD ["esbatch", "--version"]')
    user = [a for w, a in ins if w == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0")
    assert [a for w, a in ins if w == "CMD"][-1].startswith('["esbatch"')
    assert not any(w == "ENTRYPOINT" for w, _ in ins)  # the docker launcher runs `IMAGE python ...`
    sections = _apptainer()["sections"]
    assert 'exec esbatch "$@"' in "\n".join(sections["runscript"])
    test = "\n".join(sections["test"])
    assert "esbatch --version" in test and "import deepspeed, torch, vllm" in test
