"""The collector pauses while modules import and only then (esbatch/importgc.py): probe modules written here record
``gc.isenabled()`` from their own bodies; the test checks it again once their import is over, after one that failed,
beside another thread's import (that thread held inside its module's body until the test lets it go, so "B's import
ends while A's runs" holds by construction), and when the collector was off to begin with."""

from __future__ import annotations

import builtins
import gc
import sys
import threading
import uuid

import pytest

import esbatch
from esbatch import importgc


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """Write probe modules under fresh names; returns write(body) -> module name. Each body starts with
    ``import gc`` and may use ``enabled = gc.isenabled()``."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(body: str = "enabled = gc.isenabled()\n") -> str:
        name = f"probe_{uuid.uuid4().hex}"
        (tmp_path / f"{name}.py").write_text("import gc\n" + body)
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def collector_on():
    assert importgc.installed(), "import esbatch installs the hook (unless ESBATCH_GC_DURING_IMPORTS=1)"
    assert gc.isenabled()
    yield
    gc.enable()


def test_an_import_runs_with_the_collector_paused_and_leaves_it_on(probes):
    name = probes()
    module = __import__(name)  # the import statement's own entry point
    assert module.enabled is False
    assert gc.isenabled()
    inner = probes()
    outer = __import__(probes(f"import {inner}\nenabled = gc.isenabled()\n"))
    assert outer.enabled is False and sys.modules[inner].enabled is False  # nested: still paused after the inner one
    assert gc.isenabled()


def test_a_failed_import_leaves_the_collector_on_and_the_next_one_paused(probes):
    broken = probes("raise RuntimeError('broken module')\n")
    outer = probes(f"import {broken}\n")
    with pytest.raises(RuntimeError, match="broken module"):
        __import__(outer)
    assert gc.isenabled()
    assert __import__(probes()).enabled is False  # the failed import's nesting was unwound


def test_a_collector_turned_off_by_the_caller_stays_off(probes):
    gc.disable()
    assert __import__(probes()).enabled is False
    assert not gc.isenabled()


def test_a_loaded_module_imports_without_touching_the_collector(probes, monkeypatch):
    module = __import__(probes())
    monkeypatch.setattr(gc, "disable", lambda: pytest.fail("paused for a module already loaded"))
    assert __import__(module.__name__) is module
    assert __import__("esbatch", fromlist=["importgc"]) is esbatch


def test_from_a_loaded_package_import_a_submodule_not_loaded_pauses(probes, tmp_path):
    package = probes()
    (tmp_path / package).mkdir()
    (tmp_path / f"{package}.py").rename(tmp_path / package / "__init__.py")
    (tmp_path / package / "sub.py").write_text("import gc\nenabled = gc.isenabled()\n")
    __import__(package)
    assert __import__(package, fromlist=["sub"]).sub.enabled is False
    assert gc.isenabled()


def test_a_relative_import_is_not_taken_for_a_loaded_top_level_module(probes, tmp_path):
    package = probes("def load():\n    from .json import dumps\n    return dumps\n")  # json: loaded, has dumps
    (tmp_path / package).mkdir()
    (tmp_path / f"{package}.py").rename(tmp_path / package / "__init__.py")
    (tmp_path / package / "json.py").write_text("import gc\ndumps = gc.isenabled()\n")
    assert __import__(package).load() is False  # a function's relative import, run after the package's
    assert gc.isenabled()


def test_the_collector_resumes_when_the_last_of_two_threads_imports_ends(probes):
    inside, go = threading.Event(), threading.Event()
    builtins._importgc_test_events = (inside, go)
    try:
        slow = probes(
            "import builtins\ninside, go = builtins._importgc_test_events\ninside.set()\n"
            "assert go.wait(60)\nenabled = gc.isenabled()\n"
        )
        thread = threading.Thread(target=__import__, args=(slow,))
        thread.start()
        assert inside.wait(60)
        quick = __import__(probes())  # starts and ends while the other thread's import runs
        assert quick.enabled is False
        assert not gc.isenabled(), "the collector resumed while another thread was importing"
        go.set()
        thread.join(60)
        assert sys.modules[slow].enabled is False
        assert gc.isenabled()
    finally:
        go.set()
        del builtins._importgc_test_events


def test_esbatch_gc_during_imports_1_leaves_imports_alone(monkeypatch):
    monkeypatch.setattr(builtins, "__import__", importgc._original_import)
    monkeypatch.setenv("ESBATCH_GC_DURING_IMPORTS", "1")
    importgc.install()
    assert not importgc.installed()
    monkeypatch.setenv("ESBATCH_GC_DURING_IMPORTS", "0")
    importgc.install()
    assert importgc.installed()
