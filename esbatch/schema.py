"""One schema mechanism for every YAML file esbatch reads: dataclasses whose fields carry help text and checks.

A schema is a dataclass declared with ``setting(...)`` fields. ``build(cls, data, path, errors)`` checks a plain
mapping against it and collects *every* problem as one line naming the YAML path of the key, why it is
wrong, and what is valid (choices, "did you mean" for misspelt keys). The same mechanism serves run configs,
sweep files, launcher profiles, eval configs and aggregate analyses; ``describe`` lists every key with its
type, default and help (``esbatch validate --schema`` and docs/config-reference.md).

What a field may declare:
- its type annotation: bool, int, float, str, dict, list, ``list[Schema]``, a nested schema, ``X | None``, Any;
- ``choices`` and the bounds ``gt``/``ge``/``lt``/``le``;
- ``check``: a function value -> value that raises ``Invalid(reason)``; it replaces the type check, and its
  ``expects`` attribute (set with ``@expects("...")``) is appended to the error line.
A schema may define ``validate(self, path, errors)`` for checks across its fields (run only when its own
fields were valid), ``variants``/``tag`` to pick a subclass by a key (``kind: scaling``), and ``shorthand``
to accept a bare string as ``{shorthand: value}`` in lists.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any, ClassVar

from esbatch.registry import did_you_mean

REQUIRED: Any = dataclasses.MISSING


class ConfigError(ValueError):
    """One or more invalid entries; ``errors`` holds one line per problem, ``source`` names the file."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        head = f"invalid config {source}" if source else "invalid config"
        super().__init__(head + ":\n" + "\n".join(f"  - {e}" for e in errors))


class Invalid(ValueError):
    """Raised by a field's ``check`` function: the message says why the value is wrong."""


def expects(text: str) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Attach the description of valid values to a ``check`` function (used in its error lines)."""

    def deco(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        fn.expects = text  # type: ignore[attr-defined]
        return fn

    return deco


_FOLDER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=,+-]{0,119}$")


@expects(
    "a folder name: letters, digits and - _ . = , +, not starting with . or - (no / : it stays in its output folder)"
)
def folder_name(v: Any) -> str:
    """Run and sweep names become folders under their output_dir: one path component, nothing that escapes."""
    if not isinstance(v, str) or not _FOLDER_NAME.match(v):
        raise Invalid(f"got {v!r}")
    return v


@expects("a folder path: no part of it that exists may be a file")
def output_folder(v: Any) -> str | None:
    """An output folder, created when a run starts: refused here where a file stands at it or above it (it could
    never be made, and the run would fail after its model loaded). None (a default elsewhere) passes."""
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise Invalid(f"got {v!r}")
    for p in [Path(v).expanduser(), *Path(v).expanduser().parents]:
        if p.exists():
            if not p.is_dir():
                raise Invalid(f"got {v!r}: {p} is a file")
            break
    return v


def stage_spans(v: Any) -> list:
    """run.data_before: [[updates, batch_size], ...] with positive integers (updates may be 0)."""
    ok = isinstance(v, list) and all(
        isinstance(x, list)
        and len(x) == 2
        and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
        and x[0] >= 0
        and x[1] >= 1
        for x in v
    )
    if not ok:
        raise Invalid(f"expected [[updates, batch_size], ...] with updates >= 0 and batch_size >= 1; got {v!r}")
    return v


def setting(default: Any = REQUIRED, help: str = "", **checks: Any) -> Any:
    """A schema field: default, help text, and constraints (choices, gt, ge, lt, le, check)."""
    meta = {"help": help, **checks}
    if default is REQUIRED:
        return field(metadata=meta)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


class Schema:
    """Optional base for schemas: the hooks ``build`` looks for, with their defaults."""

    unknown_key: ClassVar[str] = "unknown key"  # the words of the unknown-key error
    variants: ClassVar[dict[str, type]] = {}  # tag value -> subclass (e.g. analysis kinds)
    tag: ClassVar[str] = ""  # the key that picks a variant
    tag_noun: ClassVar[str] = "kind"
    shorthand: ClassVar[str] = ""  # a bare string in a list means {shorthand: value}
    validate_always: ClassVar[bool] = False  # run validate() on the valid fields even when others were wrong

    def validate(self, path: str, errors: list[str]) -> None:
        """Checks across fields; append one line per problem."""


# ----------------------------------------------------------------------------- building


def build(cls: type, data: Any, path: str, errors: list[str]) -> Any:
    """Check ``data`` against schema ``cls``; returns an instance (defaults where a value was wrong)."""
    if getattr(cls, "variants", None) and cls.tag and cls not in cls.variants.values():
        return _build_variant(cls, data, path, errors)
    if isinstance(data, str) and getattr(cls, "shorthand", ""):
        data = {cls.shorthand: data}
    if not isinstance(data, dict):
        where = path or "top level"
        errors.append(f"{where}: expected a mapping of {_name(cls)} fields, got {_describe_value(data)}")
        return None
    hints, fields = _hints(cls), _input_fields(cls)
    n_before = len(errors)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        p = f"{path}.{key}" if path else str(key)
        if getattr(cls, "tag", "") and key == cls.tag:
            continue
        if key not in fields:
            of = f" of {path}" if path and getattr(cls, "unknown_key", "unknown key") == "unknown key" else ""
            errors.append(
                f"{p}: {getattr(cls, 'unknown_key', 'unknown key')}.{did_you_mean(str(key), list(fields))} "
                f"Valid keys{of}: {', '.join(fields)}"
            )
            continue
        kwargs[key] = _field_value(value, hints[key], dict(fields[key].metadata), p, errors)
    for key, f in fields.items():
        if key not in data and _required(f):
            p = f"{path}.{key}" if path else key
            exp = getattr(f.metadata.get("check"), "expects", None)
            errors.append(f"{p}: missing; expected {exp}" if exp else f"{p}: missing (required)")
    if len(errors) > n_before:
        obj = _defaults(cls, kwargs)
        if obj is not None and getattr(cls, "validate_always", False):
            obj.validate(path, errors)
        return obj
    try:
        obj = cls(**{k: v for k, v in kwargs.items() if v is not None or _optional(hints[k])})
    except TypeError as e:  # pragma: no cover - a schema bug, not a user error
        errors.append(f"{path or 'top level'}: {e}")
        return None
    if hasattr(obj, "validate"):
        obj.validate(path, errors)
    return obj


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s resolved annotations, read-only. Cached: ``typing.get_type_hints`` compiles every string annotation
    again on each call: 47% of ``build``'s time in the sweep state-matrix tests (cProfile), where a status, a dry
    run and a submission each build every run's config."""
    return typing.get_type_hints(cls)


@functools.cache
def _input_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields a config file may set (``init`` and not ``internal``), by name; read-only."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")}


def _build_variant(cls: type, data: Any, path: str, errors: list[str]) -> Any:
    kinds = sorted(cls.variants)
    if not isinstance(data, dict):
        errors.append(f"{path}: expected a mapping with a `{cls.tag}` ({', '.join(kinds)}), got {data!r}")
        return None
    kind = data.get(cls.tag)
    if kind not in cls.variants:
        why = "missing" if kind is None else f"unknown {cls.tag_noun} {kind!r}.{did_you_mean(str(kind), kinds)}"
        errors.append(f"{path}.{cls.tag}: {why} Valid {cls.tag}s: {', '.join(kinds)}")
        return None
    return build(cls.variants[kind], data, path, errors)


def _defaults(cls: type, kwargs: dict[str, Any]) -> Any:
    """An instance from what was valid, for callers that keep going after errors (None if impossible)."""
    try:
        return cls(**{k: v for k, v in kwargs.items() if v is not None})
    except TypeError:
        return None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]


def _optional(tp: Any) -> bool:
    return tp is Any or type(None) in typing.get_args(tp)


def _field_value(value: Any, tp: Any, meta: dict[str, Any], path: str, errors: list[str]) -> Any:
    check = meta.get("check")
    if check is not None:
        try:
            return check(value)
        except Invalid as e:
            exp = getattr(check, "expects", None)
            errors.append(f"{path}: {e}; expected {exp}" if exp else f"{path}: {e}")
            return None
    value = coerce(value, tp, path, errors)
    _check_bounds(value, meta, path, errors)
    return value


def coerce(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    """Check ``value`` against annotation ``tp``; returns the (possibly converted) value."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return coerce(value, [a for a in args if a is not type(None)][0], path, errors)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, errors)
    if origin is list and value is not None and isinstance(value, list):
        (item,) = typing.get_args(tp) or (Any,)
        items = [coerce(v, item, f"{path}[{i}]", errors) for i, v in enumerate(value)]
        return [v for v in items if v is not None] if dataclasses.is_dataclass(item) else items
    ok = _scalar(value, tp, origin)
    if ok is not _NO:
        return ok
    want = _want(tp, origin)
    errors.append(
        f"{path}: must be set (expected {want}, got null)" if value is None else _type_error(path, want, value)
    )
    return None


_NO = object()


def _scalar(value: Any, tp: Any, origin: Any) -> Any:
    """The value if it fits ``tp`` (with the conversions users expect), else ``_NO``."""
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string; users write it that way
            try:
                return float(value.strip()) if value.strip() and not value.strip().startswith("0x") else _NO
            except ValueError:
                return _NO
        return _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    if tp is dict or origin is dict:
        return value if isinstance(value, dict) else _NO
    if tp is list or origin is list:
        return value if isinstance(value, list) else _NO
    raise TypeError(f"unsupported schema type {tp}")  # pragma: no cover - a schema bug, not a user error


def _want(tp: Any, origin: Any) -> str:
    if tp is dict or origin is dict:
        return "mapping"
    if tp is list or origin is list:
        return "list"
    return _name(tp)


def _type_error(path: str, want: str, value: Any) -> str:
    return f"{path}: expected {want}, got {type(value).__name__} {value!r}"


def _check_bounds(value: Any, meta: dict[str, Any], path: str, errors: list[str]) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices and value not in choices:
        errors.append(
            f"{path}: {value!r} is not a valid choice.{did_you_mean(str(value), choices)} Valid: {', '.join(choices)}"
        )
    if isinstance(value, float) and not math.isfinite(value) and not meta.get("allow_inf"):
        errors.append(f"{path}: must be a finite number (got {value!r})")
        return
    for key, ok, word in (
        ("gt", lambda v, b: v > b, ">"),
        ("ge", lambda v, b: v >= b, ">="),
        ("lt", lambda v, b: v < b, "<"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if key in meta and isinstance(value, (int, float)) and not ok(value, meta[key]):
            errors.append(f"{path}: must be {word} {meta[key]} (got {value!r})")


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _describe_value(v: Any) -> str:
    return "nothing (the document is empty)" if v is None else f"{type(v).__name__} {_short_repr(v)}"


def _short_repr(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


# ----------------------------------------------------------------------------- describing


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every field, nested schemas flattened to dotted keys."""
    rows = []
    hints = _hints(cls)
    for f in _input_fields(cls).values():
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and not getattr(tp, "variants", None):
            rows.extend(describe(tp, key))
            continue
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if item is not None and dataclasses.is_dataclass(item) and not getattr(item, "variants", None):
            rows.append((key, "list", _default(f), f.metadata.get("help", "")))
            rows.extend(describe(item, f"{key}[]"))
            continue
        help_ = f.metadata.get("help", "")
        if "choices" in f.metadata:
            help_ += f" Choices: {', '.join(f.metadata['choices'])}."
        rows.append((key, type_label(tp), _default(f), help_))
    return rows


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "(required)"


def type_label(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("esbatch.config.", "")


# ----------------------------------------------------------------------------- dict helpers


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"es": {"sigma": 1}} -> {"es.sigma": 1}; used for MLflow params and run keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, section by section (a task's ``params`` mapping is merged one level only)."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "params":
            out[k] = deep_merge(out[k], v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out
