"""Name -> object registries with "did you mean" errors (in the style of lm-evaluation-harness).

Entries may be registered lazily as "module:attr" strings so optional heavy dependencies
(vLLM, DeepSpeed) are imported only when the entry is chosen.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def did_you_mean(name: str, options: list[str] | tuple[str, ...]) -> str:
    """Return " Did you mean 'x'?" for the closest option, or "" when nothing is close."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


class UnknownNameError(KeyError):
    """Raised for a name that is not registered; the message lists what is."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Generic[T]):
    """A named collection of factories. ``get`` resolves lazy "module:attr" entries on first use."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Any] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, obj: Any = None, *, help: str = "") -> Any:
        """Register ``obj`` (or a "module:attr" string) under ``name``; usable as a decorator."""

        def _add(o: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = o
            doc = help or (getattr(o, "__doc__", None) or "").strip().splitlines()[:1]
            self._help[name] = doc if isinstance(doc, str) else (doc[0] if doc else "")
            return o

        return _add if obj is None else _add(obj)

    def get(self, name: str) -> T:
        if name not in self._entries and ":" in name:  # a user's own "package.module:Class"
            module, _, attr = name.partition(":")
            try:
                return getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise UnknownNameError(f"{self.kind} '{name}': cannot import it ({e})") from None
        if name not in self._entries:
            names = sorted(self._entries)
            raise UnknownNameError(
                f"unknown {self.kind} '{name}'.{did_you_mean(name, names)} Available: {', '.join(names)}"
            )
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def help(self, name: str) -> str:
        return self._help.get(name, "")

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str) and name not in self._entries and ":" in name:
            try:
                self.get(name)
            except UnknownNameError:
                return False
            return True
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
