"""CPU time of two or more commands, run alternately: the side-by-side A/B behind a set-up choice that changes what
every process costs (issue 40: the venvs' interpreter, a package left out), where one run of a whole phase says
little on a host whose speed drifts.

    python benchmarks/cpu_ab.py --pairs 3 \\
        --cmd ".venv/bin/python -m esbatch train cfg.yaml --no-progress" \\
        --cmd "/tmp/other-venv/bin/python -m esbatch train cfg.yaml --no-progress"

Each command runs through `sh -c`, output discarded, --pairs times, the commands taking turns. Its CPU time is user +
system of the command and every descendant it waited for (a vLLM engine's EngineCore and worker included; a
process it left running is not). A command that exits non-zero stops the benchmark. Prints each run, then each
command's mean with its min-max and the ratio of each mean to the first command's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def cpu_of(cmd: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of ``cmd``."""
    t0 = time.perf_counter()
    p = subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.exit(f"cpu_ab: exit {p.returncode} from: {cmd}")
    return ru.ru_utime + ru.ru_stime, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cmd", action="append", required=True, help="a shell command (give two or more)")
    ap.add_argument("--pairs", type=int, default=3, help="runs of each command, taking turns")
    args = ap.parse_args(argv)
    if len(args.cmd) < 2 or args.pairs < 1:
        ap.error("give at least two --cmd and --pairs >= 1")
    runs: list[list[float]] = [[] for _ in args.cmd]
    for r in range(args.pairs):
        for i, cmd in enumerate(args.cmd):
            cpu, wall = cpu_of(cmd)
            runs[i].append(cpu)
            print(f"round {r + 1} cmd {chr(65 + i)}: {cpu:7.2f} CPU-s  {wall:7.2f} s wall", flush=True)
    base = sum(runs[0]) / len(runs[0])
    print("\ncmd  mean CPU-s  (min-max)        ratio to A")
    for i, (cmd, xs) in enumerate(zip(args.cmd, runs)):
        mean = sum(xs) / len(xs)
        print(f"{chr(65 + i)}    {mean:9.2f}  ({min(xs):.2f}-{max(xs):.2f})  {mean / base:10.3f}   {cmd}")


if __name__ == "__main__":
    main()
