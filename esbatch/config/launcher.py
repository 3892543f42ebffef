"""Launcher profiles: *where* a sweep runs (cluster resources, container), kept apart from *what* runs.

A profile is a YAML file found by name (``launchers/a100.yaml`` in the current folder, else the built-in
profiles in esbatch/builtin/launchers/); a sweep names one with ``launcher: a100`` and may override fields
with ``launcher_overrides:``. Moving a sweep to another cluster is one word (or ``esbatch sweep FILE
--launcher NAME``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from esbatch.config.loader import available, find, read_yaml
from esbatch.schema import ConfigError, Schema, build, deep_merge, setting


@dataclass
class ContainerConfig:
    runtime: str = setting("none", "Run each task inside a container.", choices=("none", "apptainer", "docker"))
    image: str | None = setting(None, "Apptainer .sif path / docker://... URI, or a docker image name.")
    binds: list = setting(
        [], "Host paths made visible in the container, 'src[:dst]' (the sweep folder is always bound)."
    )
    env: dict = setting({}, "Environment variables set inside the container (e.g. HF_HOME).")
    gpus: bool = setting(True, "Expose GPUs (apptainer --nv, docker --gpus all) when the profile asks for GPUs.")
    options: list = setting([], "Extra arguments for `apptainer exec` / `docker run`.")


@dataclass
class LauncherProfile(Schema):
    cluster: str = setting(
        "local", "local: subprocesses on this machine; slurm: one sbatch array job.", choices=("local", "slurm")
    )
    partition: str | None = setting(None, "SLURM partition (-p).")
    account: str | None = setting(None, "SLURM account (-A).")
    qos: str | None = setting(None, "SLURM quality of service (--qos).")
    nodes: int = setting(1, "Nodes per run (multi-node GRPO).", ge=1)
    ntasks_per_node: int = setting(1, "Processes per node and run: GRPO ranks (usually one per GPU); ES uses 1.", ge=1)
    gpus_per_node: int = setting(0, "GPUs per node (--gpus-per-node).", ge=0)
    cpus_per_task: int = setting(1, "CPU cores per task (--cpus-per-task); also torch's thread count.", ge=1)
    mem: str | None = setting(None, "Memory per node, e.g. '64G' (--mem). None = the cluster default.")
    time: str = setting("01:00:00", "Time limit per task: 'HH:MM:SS', 'D-HH:MM:SS' or minutes.")
    array_parallelism: int = setting(1, "How many tasks run at once (the %N of --array; local: processes).", ge=1)
    max_array_size: int | None = setting(
        None, "Split arrays above this size (None = ask `scontrol show config`).", ge=1
    )
    signal_delay_s: int = setting(
        120, "Seconds before the time limit that the checkpoint signal (USR2) arrives.", ge=10
    )
    max_requeues: int = setting(3, "How often a timed-out task is requeued before it is given up.", ge=0)
    tracking: str = setting(
        "direct",
        "direct: tasks log to the sweep's MLflow store; offline: each task writes a store in its run folder "
        "and `esbatch aggregate` merges them (for compute nodes that cannot reach the tracking server).",
        choices=("direct", "offline"),
    )
    aggregate_job: bool = setting(True, "Submit `esbatch aggregate` as a job that starts after the array succeeds.")
    setup: list = setting([], "Shell lines run before each task (e.g. 'module load cuda/12.4').")
    extra_sbatch: dict = setting({}, "Further sbatch options, e.g. {constraint: a100_80g, exclusive: true}.")
    container: ContainerConfig = field(default_factory=ContainerConfig, metadata={"help": "Container for each task."})

    def time_minutes(self) -> int:
        return parse_time(self.time)

    def validate(self, path: str, errors: list[str]) -> None:
        try:
            if self.time_minutes() <= 0:
                errors.append(f"time: must be positive (got {self.time!r})")
        except ValueError:
            errors.append(
                f"time: {self.time!r} is not a SLURM time. Valid forms: '90' (minutes), '1:30:00', '2-00:00:00'"
            )
        if self.mem is not None and not re.fullmatch(r"\d+[KMGT]?", str(self.mem)):
            errors.append(f"mem: {self.mem!r} is not a SLURM memory size. Valid forms: '64G', '16000M', '16000'")
        for where, text in _strings(dataclasses.asdict(self)):
            if "\n" in text or "\r" in text:
                errors.append(
                    f"{where}: {text[:40]!r}... holds a line break; profile values go into one line of the sbatch "
                    "script (write one shell line per `setup` entry)"
                )
        c = self.container
        if c.runtime != "none" and not c.image:
            errors.append(f"container.image: runtime {c.runtime} needs an image (e.g. image: /scratch/esbatch.sif)")
        for i, b in enumerate(c.binds):
            if not isinstance(b, str) or not b:
                errors.append(f"container.binds[{i}]: expected 'src[:dst]', got {b!r}")


def _strings(value: Any, path: str = "") -> list[tuple[str, str]]:
    """(YAML path, text) of every string in a profile, keys included."""
    if isinstance(value, str):
        return [(path, value)]
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            out += _strings(str(k), sub) + _strings(v, sub)
        return out
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _strings(v, f"{path}[{i}]")]
    return []


def mem_mb(mem: str | None) -> int | None:
    """A SLURM memory size ('64G', '16000M', '16000' = MB) in MiB; None when the profile leaves it unset."""
    if mem is None:
        return None
    m = re.fullmatch(r"(\d+)([KMGT]?)", str(mem))
    if not m:
        raise ValueError(f"mem: {mem!r} is not a SLURM memory size")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]
    return int(int(m.group(1)) * scale)


def parse_time(s: str | int) -> int:
    """A SLURM time limit ('90', '30:00', '1:30:00', '2-00', '2-12:00:00') -> minutes, rounded up."""
    if isinstance(s, int):
        return s
    text, days = s.strip(), 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
        parts = [int(x) for x in text.split(":")] + [0, 0]
        h, m, sec = parts[:3]  # days-hours[:minutes[:seconds]]
    else:
        parts = [int(x) for x in text.split(":")]
        if len(parts) > 3:
            raise ValueError(s)
        h, m, sec = ([0, 0] + parts)[-3:] if len(parts) == 3 else (0, parts[0], parts[1] if len(parts) == 2 else 0)
    if min(days, h, m, sec) < 0:
        raise ValueError(s)
    return days * 1440 + h * 60 + m + (1 if sec else 0)


def available_launchers() -> list[str]:
    return available("launcher")


def resolve_launcher(name_or_path: str) -> Path:
    return find(name_or_path, "launcher")


def load_profile(
    name_or_path: str, overrides: dict[str, Any] | None = None, where: str = "launcher"
) -> LauncherProfile:
    """Load and validate a profile plus a sweep's ``launcher_overrides``; every problem is reported at once."""
    path = resolve_launcher(name_or_path)
    data = read_yaml(path)
    errors: list[str] = []
    prof = build(LauncherProfile, data, "", errors)
    if errors:
        raise ConfigError(errors, str(path))
    if overrides:
        prof = build(LauncherProfile, deep_merge(data, overrides), "", errors)
        errors = [f"launcher_overrides.{e}" for e in errors]
    if errors:
        raise ConfigError(errors, f"{where} {path}")
    return prof
