"""Imports without the cyclic garbage collector: each esbatch process starts about half a CPU-second sooner.

Importing torch, transformers and MLflow creates about a million Python objects, and the collector, which runs every
few hundred new objects, traverses all of them in each of its full passes: 8 of them while a toy `esbatch train`
imports, 0.9 of its 5.2 CPU-s (`benchmarks/import_gc.py`). A sweep starts hundreds of processes (tasks, ranks,
evals, the tests' own), so `import esbatch` installs this hook: while an ``import`` statement runs
(``builtins.__import__``, which also serves ``from ... import``, pickle and nested imports, in any thread), the
collector is paused; it resumes when the last one ends. The toy run's collections then take 0.4 s, no full pass
among them (what is left: the imported objects' first scan). Nothing else changes: the collector is on whenever no
import runs, importing a module already loaded does not pause it, and ``gc.collect()`` works as always.

The collector is only resumed if this hook paused it: code that turned it off itself (``gc.disable()`` outside an
import) keeps it off. A module that calls ``gc.disable()`` while it is being imported is not honoured (the import's
end turns the collector back on); no library esbatch loads does that. ``ESBATCH_GC_DURING_IMPORTS=1`` in the
environment leaves imports alone, in this process and the ones it starts (the benchmark's other side). Processes
that import vLLM before esbatch (a vLLM engine's EngineCore and worker) run without the hook.
"""

from __future__ import annotations

import builtins
import gc
import os
import sys
import threading
from typing import Any

_original_import = builtins.__import__
_lock = threading.RLock()  # re-entrant: a signal handler that imports may run while its thread holds it
_importing = 0  # import statements under way, nested ones and other threads' included
_paused = False  # the collector is off because of this hook (and so this hook turns it back on)


def _loaded(name: str, fromlist: Any) -> bool:
    """Whether ``import name`` / ``from name import *fromlist*`` can only return what is already loaded."""
    module = sys.modules.get(name)
    if module is None:
        return False
    if not fromlist:
        return True
    names = getattr(module, "__dict__", {})
    return "*" not in fromlist and all(n in names for n in fromlist)


def _import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    global _importing, _paused
    if level == 0 and _loaded(name, fromlist):  # nothing to load (a function's `import torch`): no pause
        return _original_import(name, globals, locals, fromlist, level)
    with _lock:
        if _importing == 0 and gc.isenabled():
            gc.disable()
            _paused = True
        _importing += 1
    try:
        return _original_import(name, globals, locals, fromlist, level)
    finally:
        with _lock:
            _importing = max(0, _importing - 1)  # an import under way when this process was forked: see below
            if _importing == 0 and _paused:
                _paused = False
                gc.enable()


def _after_fork_in_child() -> None:
    """Only the forking thread lives on in a forked child: the imports other threads had under way never end there,
    and a lock one of them held would never be released. The child starts over: collector on, nothing counted."""
    global _lock, _importing, _paused
    _lock = threading.RLock()
    _importing = 0
    if _paused:
        _paused = False
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


def install() -> None:
    """Pause the collector during imports from now on, in this process (idempotent), unless
    ESBATCH_GC_DURING_IMPORTS=1."""
    if os.environ.get("ESBATCH_GC_DURING_IMPORTS") != "1":
        builtins.__import__ = _import


def installed() -> bool:
    return builtins.__import__ is _import
