"""Generation throughput per (model size class, backend, device kind): the rates `esbatch sweep`'s cost plan turns
tokens into device-hours with (esbatch/launch/cost.py).

Each figure says where it comes from. ``measured`` ones were measured by this project (docs/benchmarks.md names the
run); every other built-in figure is ASSUMED, NOT MEASURED: a rough order of magnitude for one device generating
rollouts in bfloat16 (HF ``generate`` at batches of ~32-64 prompts; vLLM with its continuous batching), kept so a
plan can say something before a GPU node has been measured. Replace them with measurements: run
``python scripts/gpu_check.py | tee gpu-check.txt`` on a node and give that file to `esbatch sweep --throughput
gpu-check.txt` (or ``ESBATCH_THROUGHPUT=gpu-check.txt``): its "same rollouts, fixed weights: ... (N tok/s)" figure of
each backend (benchmarks/backends.py, N=8 x B=32, 128 new tokens) replaces the table's entry for that GPU, backend
and the checked model's size class. A YAML/JSON list of ``{size, backend, device, tokens_per_s, source}`` works too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# (class, largest parameter count in it): a model is in the first class whose bound it does not exceed
SIZE_CLASSES = (("0.1B", 300e6), ("0.5B", 1.0e9), ("1.5B", 2.5e9), ("3B", 5.0e9), ("7B", 10.0e9))
DEVICES = ("h200", "h100", "a100")  # GPU kinds recognised in a profile (partition, constraint, name) or a GPU name
ASSUMED = "assumed, not measured"
CPU_SOURCE = (
    "measured: docs/benchmarks.md 'HF vs vLLM backend on CPU' (701d89c), benchmarks/backends.py --n 8 --batch 16 "
    "--tokens 64, SmolLM2 fp32 on 2 cores"
)


@dataclass(frozen=True)
class Rate:
    """Generated tokens per second of one device for one (size class, backend, device kind), and its source."""

    size: str
    backend: str
    device: str
    tokens_per_s: float
    source: str

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


def _assumed(device: str, backend: str, figures: tuple[float, ...]) -> list[Rate]:
    return [Rate(size, backend, device, f, ASSUMED) for (size, _), f in zip(SIZE_CLASSES, figures)]


BUILTIN: list[Rate] = [
    Rate("0.1B", "hf", "cpu", 50.3, CPU_SOURCE),
    Rate("0.1B", "vllm", "cpu", 79.8, CPU_SOURCE),
    *_assumed("h100", "hf", (2000, 1800, 1500, 1200, 900)),
    *_assumed("h100", "vllm", (30000, 20000, 12000, 7000, 4000)),
    *_assumed("a100", "hf", (1500, 1300, 1100, 800, 550)),
    *_assumed("a100", "vllm", (20000, 12000, 7000, 4000, 2200)),
]


def size_class(params: int) -> str | None:
    """The size class of a model of ``params`` parameters; None above the largest (no figures there)."""
    return next((name for name, bound in SIZE_CLASSES if params <= bound), None)


def device_kind(profile: Any, launcher: str = "") -> str:
    """What a launcher profile's tasks run on: cpu (gpus_per_node: 0), a GPU kind named by the profile (its name,
    partition, sbatch options: h200, h100, a100), else "gpu" (a GPU of a kind the table does not know)."""
    if not profile.gpus_per_node:
        return "cpu"
    words = [launcher, profile.partition or "", *(f"{k}={v}" for k, v in profile.extra_sbatch.items())]
    text = " ".join(str(w) for w in words).lower()
    return next((d for d in DEVICES if d in text), "gpu")


class Table:
    """The rates in use: the built-in ones, overridden by measured ones (``with_measurements``)."""

    def __init__(self, rates: list[Rate] | None = None) -> None:
        self.rates = {(r.size, r.backend, r.device): r for r in (BUILTIN if rates is None else rates)}

    def get(self, params: int | None, backend: str, device: str) -> Rate | None:
        size = size_class(params) if params else None
        return self.rates.get((size, backend, device)) if size else None

    def with_measurements(self, rates: list[Rate]) -> Table:
        return Table([*self.rates.values(), *rates])


GPU_HEADER = re.compile(r"^## GPU check: GPU: (?P<gpu>.+?) x\d+, (?P<model>\S+), (?P<dtype>\w+)\s*$", re.M)
OVERHEAD_ROW = re.compile(r"^\| ES overhead ratio, (?P<backend>\w+) \(.*?\(\s*(?P<rate>[\d.]+) tok/s\)", re.M)


def gpu_check_rates(text: str, source: str, params_of: Any) -> list[Rate]:
    """The rates in a saved `scripts/gpu_check.py` output: per backend, the pure generation throughput of its
    benchmarks/backends.py row, for the GPU and model its table header names. ``params_of(model)`` counts the
    model's parameters (for its size class); nothing is returned for a check that ran no backends."""
    head = GPU_HEADER.search(text)
    if head is None:
        return []
    gpu = head["gpu"].lower()
    device = next((d for d in DEVICES if d in gpu), gpu)
    size = size_class(params_of(head["model"]) or 0)
    if size is None:
        return []
    what = f"measured: scripts/gpu_check.py in {source} ({head['gpu']}, {head['model']}, {head['dtype']})"
    return [Rate(size, m["backend"], device, float(m["rate"]), what) for m in OVERHEAD_ROW.finditer(text)]


def load_rates(path: str | Path, params_of: Any) -> list[Rate]:
    """Measured rates from ``path``: a saved gpu_check.py output, or a YAML/JSON list of {size, backend, device,
    tokens_per_s, source}. ValueError when it holds neither."""
    text = Path(path).read_text()
    found = gpu_check_rates(text, str(path), params_of)
    if found:
        return found
    try:
        data = yaml.safe_load(text) if not text.lstrip().startswith("[") else json.loads(text)
    except (yaml.YAMLError, ValueError):
        data = None
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise ValueError(
            f"{path}: neither a saved scripts/gpu_check.py output (with its '## GPU check:' table) nor a list of "
            "{size, backend, device, tokens_per_s, source}"
        )
    try:
        return [
            Rate(
                str(d["size"]), str(d["backend"]), str(d["device"]).lower(), float(d["tokens_per_s"]), str(d["source"])
            )
            for d in data
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path}: an entry lacks or mistypes {e} (want size, backend, device, tokens_per_s, source)"
        ) from None
