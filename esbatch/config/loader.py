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


#: The most nodes a YAML document may expand to once its aliases (``*name``) are resolved: a config, a sweep grid
#: or a launcher profile is a few hundred; a "billion laughs" alias bomb is refused before it is expanded.
MAX_YAML_NODES = 100_000


class _Refused(Exception):
    """A hostile or ambiguous YAML document, refused before it is built (the message says where)."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the later one silently);
    keys merged in by ``<<: *anchor`` may still be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first:
                raise _Refused(
                    f"key {key!r} is given twice in one mapping, at line {first[key]} and line {line} (YAML would "
                    "silently keep the later value); keep one of them"
                )
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def _expanded_sizes(root: yaml.Node) -> dict[int, int]:
    """id(node) -> how many nodes it expands to with every alias resolved; one visit per distinct node (aliases
    share their anchor's node), so a bomb costs its size in the file, not its expansion. A node that contains
    itself (``a: &a [*a]``) counts as MAX_YAML_NODES + 1."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if done:
            open_.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in children), MAX_YAML_NODES + 1)
            continue
        if id(node) in open_:  # reached again while its own children are being counted: a cycle
            sizes.update(dict.fromkeys(open_, MAX_YAML_NODES + 1))  # it and all it is inside: infinite
            open_.clear()
            continue
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _bomb_path(root: yaml.Node, sizes: dict[int, int]) -> str:
    """The key whose value is too large: from the top, into the first child that is over the bound, while one is."""
    path, node, seen = "", root, set()
    while id(node) not in seen:
        seen.add(id(node))
        step = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if sizes.get(id(v), 0) > MAX_YAML_NODES and id(v) not in seen:
                    step = (f"{path}.{k.value}" if path else str(k.value)) if isinstance(k, yaml.ScalarNode) else path
                    node = v
                    break
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                if sizes.get(id(v), 0) > MAX_YAML_NODES and id(v) not in seen:
                    step, node = f"{path}[{i}]", v
                    break
        if step is None:
            break
        path = step
    return path or "the top level"


def load_yaml(text: str, source: str | None = None) -> Any:
    """One YAML document, as ``yaml.safe_load`` reads it, but refusing (ConfigError naming ``source``) a key given
    twice in one mapping (both lines named), and aliases that expand to more than MAX_YAML_NODES nodes (the key
    named) before building anything from them."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes = _expanded_sizes(node)
        if sizes[id(node)] > MAX_YAML_NODES:
            raise _Refused(
                f"{_bomb_path(node, sizes)}: YAML aliases (*name) expand it to more than {MAX_YAML_NODES:,} values "
                "(an alias bomb, or an anchor that contains itself); write the values out or use fewer aliases"
            )
        return loader.construct_document(node)
    except _Refused as e:
        raise ConfigError([str(e)], source) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"YAML syntax error: {e}"], source) from None
    except RecursionError:
        raise ConfigError(["YAML nested too deeply to read"], source) from None
    finally:
        loader.dispose()


#: Mappings already parsed, by their text (a sweep's plan configs are read again by every status, dry run and
#: submission); each caller gets its own deep copy. Refused texts are not kept: they raise each time.
_PARSED: dict[str, dict[str, Any]] = {}
_PARSED_MAX = 512


def parse_yaml(text: str, source: str | None = None) -> dict[str, Any]:
    data = _PARSED.get(text)
    if data is None:
        data = load_yaml(text, source)
        if data is None:
            raise ConfigError(
                ["the file is empty: expected a mapping of keys (see `esbatch validate --schema`)"], source
            )
        if not isinstance(data, dict):
            raise ConfigError(
                [f"top level: expected a mapping of keys, got {type(data).__name__} {data!r:.60}"], source
            )
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)))  # the oldest
        _PARSED[text] = data
    return copy.deepcopy(data)
