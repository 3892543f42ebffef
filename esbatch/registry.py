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

    def __init__(self, kind: str, expect: type | None = None) -> None:
        """``expect``: the class a user's "package.module:Class" entry must subclass (None: anything)."""
        self.kind, self.expect = kind, expect
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
            return self._user(name)
        if name not in self._entries:
            names = sorted(self._entries)
            raise UnknownNameError(
                f"unknown {self.kind} '{name}'.{did_you_mean(name, names)} Available: {', '.join(names)} "
                f'(or your own "package.module:Class")'
            )
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            self._entries[name] = entry
        return entry

    def _user(self, name: str) -> Any:
        """Import a user's entry, saying exactly what went wrong: module missing, broken, or not a class of
        the right kind (e.g. os:system)."""
        module, _, attr = name.partition(":")
        if not module or not attr:
            raise UnknownNameError(f"{self.kind} '{name}': expected package.module:ClassName")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module or module.startswith(f"{e.name}."):
                raise UnknownNameError(
                    f"{self.kind} '{name}': no module named '{module}'; put its folder on PYTHONPATH or install "
                    "its package"
                ) from None
            raise UnknownNameError(
                f"{self.kind} '{name}': importing '{module}' failed: {e} (a missing dependency)"
            ) from None
        except Exception as e:  # noqa: BLE001 - a SyntaxError or any error the user's module raises on import
            raise UnknownNameError(
                f"{self.kind} '{name}': importing '{module}' failed: {type(e).__name__}: {e}"
            ) from None
        if not hasattr(mod, attr):
            public = [a for a in dir(mod) if not a.startswith("_")]
            close = did_you_mean(attr, public)
            raise UnknownNameError(f"{self.kind} '{name}': module '{module}' has no '{attr}'.{close}")
        obj = getattr(mod, attr)
        if self.expect is not None and not (isinstance(obj, type) and issubclass(obj, self.expect)):
            want = f"{self.expect.__module__}.{self.expect.__qualname__}"
            raise UnknownNameError(
                f"{self.kind} '{name}' is {type(obj).__name__} {obj!r:.60}, not a subclass of {want}; a user "
                f"{self.kind} is 'package.module:ClassName' naming such a class"
            )
        return obj

    def problem(self, name: str) -> str | None:
        """Why ``name`` cannot be used (unknown, not importable, wrong kind), or None when it can. Built-in
        entries are not imported (a backend's engine may be installed only where it runs)."""
        if name in self._entries:
            return None
        try:
            self.get(name)
        except UnknownNameError as e:
            return str(e)
        return None

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
