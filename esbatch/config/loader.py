"""The one YAML loader: files by path or by name, built-in or the user's own, and what kind of file each is.

Four kinds of YAML file: run configs (``esbatch train``), sweep files, launcher profiles and eval configs.
Built-in ones ship inside the package (``esbatch/builtin/<kind folder>/``), so an installed esbatch finds
``esbatch sweep popsize`` from any folder; files in the user's folder (``./sweeps/``, ``./launchers/``,
``./configs/``, ``./evals/``) override built-ins of the same name. Every problem reading a file (missing,
a folder, binary, bad YAML, a list or a number or nothing at the top) is a ``ConfigError`` naming the file.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from esbatch.registry import did_you_mean
from esbatch.schema import ConfigError

BUILTIN_DIR = Path(__file__).resolve().parents[1] / "builtin"

# kind -> (folder name, the words used in messages)
KINDS: dict[str, tuple[str, str]] = {
    "config": ("configs", "run config"),
    "sweep": ("sweeps", "sweep file"),
    "launcher": ("launchers", "launcher profile"),
    "eval": ("evals", "eval config"),
}


def noun(kind: str) -> str:
    return KINDS[kind][1]


def search_dirs(kind: str) -> list[Path]:
    """Where names of this kind are looked up, first match wins: the user's folder, then the built-ins."""
    folder = KINDS[kind][0]
    user = Path.cwd() / folder
    builtin = BUILTIN_DIR / folder
    return [user, builtin] if user.resolve() != builtin.resolve() else [builtin]


def available(kind: str) -> list[str]:
    names: set[str] = set()
    for d in search_dirs(kind):
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def builtin_names(kind: str) -> list[str]:
    return sorted(p.stem for p in (BUILTIN_DIR / KINDS[kind][0]).glob("*.yaml"))


def find(name_or_path: str, kind: str) -> Path:
    """A YAML path, or the name of a file of ``kind`` in the user's folder or the built-ins."""
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or p.exists():
        if p.is_file():
            return p
        if p.is_dir():
            raise ConfigError([f"{p}: is a folder, not a YAML file"])
        raise ConfigError([f"{p}: no such file"])
    for d in search_dirs(kind):
        if (d / f"{name_or_path}.yaml").is_file():
            return d / f"{name_or_path}.yaml"
    names = available(kind)
    folder = KINDS[kind][0]
    raise ConfigError(
        [
            f"{name_or_path}: no such file, and no {noun(kind)} '{name_or_path}'.{did_you_mean(name_or_path, names)} "
            f"Available ({folder}/ here or built in): {', '.join(names) or 'none'}"
        ]
    )


def find_all(name_or_path: str) -> list[tuple[Path, str | None]]:
    """A YAML path (kind unknown), or every kind's file of that name: [(path, kind)] (``quickstart`` is both a
    run config and a sweep)."""
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or p.exists():
        return [(find(name_or_path, "config"), None)]
    hits = []
    for kind in KINDS:
        for d in search_dirs(kind):
            if (d / f"{name_or_path}.yaml").is_file():
                hits.append((d / f"{name_or_path}.yaml", kind))
                break
    if hits:
        return hits
    names = sorted({n for k in KINDS for n in available(k)})
    raise ConfigError(
        [
            f"{name_or_path}: no such file, and no config, sweep, launcher or eval of that name."
            f"{did_you_mean(name_or_path, names)} Available: {', '.join(names)}"
        ]
    )


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file; a clear ConfigError for anything else."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(["is a folder, not a YAML file"], str(p))
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(["no such file"], str(p)) from None
    except OSError as e:
        raise ConfigError([f"cannot read it ({e.strerror})"], str(p)) from None
    if b"\x00" in raw[:8192]:
        raise ConfigError(["is a binary file, not YAML"], str(p))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(["is not UTF-8 text, so not a YAML file"], str(p)) from None
    return parse_yaml(text, str(p))


def parse_yaml(text: str, source: str | None = None) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"YAML syntax error: {e}"], source) from None
    if data is None:
        raise ConfigError(["the file is empty: expected a mapping of keys (see `esbatch validate --schema`)"], source)
    if not isinstance(data, dict):
        raise ConfigError([f"top level: expected a mapping of keys, got {type(data).__name__} {data!r:.60}"], source)
    return copy.deepcopy(data)
