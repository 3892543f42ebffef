"""Changing one key of a resolved config to another valid-looking value of its type: the property tests over
every config key (tests/unit/test_config_fingerprint.py, test_run_keys.py) share it."""

from __future__ import annotations

import dataclasses
from typing import Any


def field_of(cfg: Any, key: str) -> tuple[Any, dataclasses.Field]:
    *path, name = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    return obj, next(f for f in dataclasses.fields(obj) if f.name == name)


def changed(value: Any, f: dataclasses.Field) -> Any:
    """Another valid-looking value of the same type: another choice, the other bool, +1, a longer list..."""
    choices = f.metadata.get("choices")
    if choices:
        return next(c for c in choices if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 0.25
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, list):
        return [*value, value[0] if value else 1]
    if isinstance(value, dict):
        return {**value, "changed": 1}
    assert value is None, (f.name, value)
    return {"int | None": 3, "float | None": 0.5, "list | None": [1, 1]}.get(str(f.type), "changed")
