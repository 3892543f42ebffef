"""A process forked while other threads are inside an import, or hold esbatch/importgc.py's lock, starts with the
collector on and imports without waiting on them (importgc's at-fork reset). Both situations hold by construction:
one thread waits inside its probe module's body, another holds the lock, until the parent lets them go after the
child has answered. A fresh interpreter runs it, so the fork is of a process with no other threads."""

from __future__ import annotations

import subprocess
import sys

from toy import ROOT

SCRIPT = r"""
import gc, os, signal, sys, threading
import esbatch
from esbatch import importgc

folder = sys.argv[1]
sys.path.insert(0, folder)
inside, go, held = threading.Event(), threading.Event(), threading.Event()
import builtins
builtins._probe_events = (inside, go)
with open(os.path.join(folder, "slow_probe.py"), "w") as f:
    f.write("import builtins\ninside, go = builtins._probe_events\ninside.set()\nassert go.wait(120)\n")
with open(os.path.join(folder, "child_probe.py"), "w") as f:
    f.write("import gc\nenabled = gc.isenabled()\n")

def hold_lock():
    with importgc._lock:
        held.set()
        go.wait(120)

importer = threading.Thread(target=__import__, args=("slow_probe",))
importer.start()
assert inside.wait(120)
holder = threading.Thread(target=hold_lock)
holder.start()
assert held.wait(120)
assert not gc.isenabled(), "the other thread's import has paused the collector"

pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a child stuck on the lock it inherited fails instead of hanging the test
    on_at_start = gc.isenabled()
    import child_probe
    ok = on_at_start and child_probe.enabled is False and gc.isenabled()
    print(f"child: on at start {on_at_start}, paused in its import {child_probe.enabled is False}, "
          f"on after {gc.isenabled()}", flush=True)
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
go.set()
importer.join(120)
holder.join(120)
print(f"parent: child exit {os.waitstatus_to_exitcode(status)}, collector on after {gc.isenabled()}", flush=True)
sys.exit(0 if os.waitstatus_to_exitcode(status) == 0 and gc.isenabled() else 1)
"""


def test_a_child_forked_during_another_threads_import_starts_with_the_collector_on(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "child: on at start True, paused in its import True, on after True" in proc.stdout
    assert "collector on after True" in proc.stdout
