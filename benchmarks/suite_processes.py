"""Where the test suite's CPU goes, process by process: runs a pytest selection with every Python process it starts
(pytest's workers, `esbatch` commands, sweep tasks, torchrun ranks, vLLM engines, SLURM jobs) recording its own CPU
time and which heavy libraries it imported, then prints them by kind of process and by test (issue 40).

    python benchmarks/suite_processes.py [--python .venv-vllm/bin/python] [--top 25] -- tests/integration -n 3

The record is made at the process's exit (atexit), by a .pth file put into the interpreter's site-packages for
the run and removed after it; it acts only where ESBATCH_PROC_LOG is set. A process that ends by os._exit or by a
signal it does not handle (SIGKILL, a default SIGTERM) leaves no record, nor do non-Python processes (slurmd,
sbatch): the total is a lower bound of the phase's CPU. A process's test is the PYTEST_CURRENT_TEST it inherited.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mlflow", "deepspeed", "vllm")  # the imports that set a process's start-up cost
HOOK = """
import atexit, builtins, json, os, resource, sys, time
if not getattr(builtins, "_esbatch_proc_log", False):  # once: a venv's lib64 -> lib link lists site-packages twice
    builtins._esbatch_proc_log = True

    def _record(folder=os.environ["ESBATCH_PROC_LOG"]):
        ru = resource.getrusage(resource.RUSAGE_SELF)
        rec = {
            "argv": sys.argv[:3],
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
            "cpu": ru.ru_utime + ru.ru_stime,
            "mods": [m for m in HEAVY if m in sys.modules],
        }
        try:  # pids are reused: the time makes the name unique
            with open(os.path.join(folder, f"{os.getpid()}-{time.time_ns()}.json"), "w") as f:
                json.dump(rec, f)
        except OSError:
            pass  # a process that outlived the run (its folder removed): not counted

    atexit.register(_record)
"""


def site_packages(python: str) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip())


def kind(rec: dict) -> str:
    """A process's kind: its program and subcommand, and the heavy libraries it imported."""
    argv = rec["argv"] or ["?"]
    prog = Path(argv[0]).name
    if prog == "__main__.py":  # python -m PACKAGE: esbatch SUBCOMMAND, pytest
        package = Path(argv[0]).parent.name
        prog = f"{package} {argv[1]}" if package == "esbatch" and len(argv) > 1 else package
    elif prog in ("-c", ""):
        prog = "python -c"
    libs = "+".join(rec["mods"]) or "-"
    return f"{prog} [{libs}]"


def report(records: list[dict], wall: float, top: int) -> None:
    total = sum(r["cpu"] for r in records)
    print(f"{len(records)} Python processes recorded, {total:.0f} CPU-s, in {wall:.0f} s of wall time")
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_test: dict[str, list[float]] = defaultdict(list)
    for r in records:
        by_kind[kind(r)].append(r["cpu"])
        by_test[r["test"] or "(no test: pytest itself, its workers)"].append(r["cpu"])
    for title, groups in (("kind of process", by_kind), ("test", by_test)):
        print(f"\n{'procs':>5} {'CPU-s':>7} {'share':>6} {'per proc':>8}  {title}")
        for name, cpus in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]:
            s = sum(cpus)
            print(f"{len(cpus):5d} {s:7.0f} {100 * s / total:5.1f}% {s / len(cpus):8.2f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the venv's interpreter")
    ap.add_argument("--top", type=int, default=25, help="rows per table")
    ap.add_argument("pytest_args", nargs="+", help="after --: what pytest runs")
    a = ap.parse_args()
    pth = site_packages(a.python) / "zz_esbatch_proc_log.pth"
    with tempfile.TemporaryDirectory(prefix="proc-log-") as folder:
        hook = Path(folder) / "hook.py"
        hook.write_text(f"HEAVY = {HEAVY!r}\n{HOOK}")
        pth.write_text(
            "import os; exec(open(os.path.join(os.environ['ESBATCH_PROC_LOG'], 'hook.py')).read(), {}) "
            "if os.environ.get('ESBATCH_PROC_LOG') else None\n"
        )
        try:
            t0 = time.monotonic()
            env = {**os.environ, "ESBATCH_PROC_LOG": folder}
            rc = subprocess.run(
                [a.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *a.pytest_args], env=env
            ).returncode
            wall = time.monotonic() - t0
        finally:
            pth.unlink(missing_ok=True)
        records = [json.loads(p.read_text()) for p in Path(folder).glob("*.json")]
    print(f"\npytest exit {rc}")
    report(records, wall, a.top)


if __name__ == "__main__":
    main()
