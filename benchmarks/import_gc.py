"""What the cyclic garbage collector costs an esbatch process, with and without esbatch/importgc.py's pause during
imports: a toy `esbatch train` (tests/toy.py's tiny Llama, ES N=4, 2 updates) runs in a fresh process each way,
alternately, and reports its collections per generation, the time they took (gc.callbacks) and the process's CPU
time. Compare whole commands or test files with benchmarks/cpu_ab.py and ESBATCH_GC_DURING_IMPORTS=1 on one side.

    python benchmarks/import_gc.py [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in the measured process: the callback is registered before esbatch (and its hook) is imported.
CHILD = """
import gc, json, resource, sys, time
counts, seconds, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]
def watch(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        counts[info["generation"]] += 1
        seconds[info["generation"]] += time.perf_counter() - started[0]
gc.callbacks.append(watch)
from esbatch.cli import main
code = main(["train", sys.argv[1], "--no-progress"])
ru = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT " + json.dumps({"code": code, "counts": counts, "seconds": seconds, "cpu": ru.ru_utime + ru.ru_stime}))
"""


def run(cfg: Path, hook: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    env.pop("ESBATCH_GC_DURING_IMPORTS", None)
    if not hook:
        env["ESBATCH_GC_DURING_IMPORTS"] = "1"
    out = subprocess.run([sys.executable, "-c", CHILD, str(cfg)], env=env, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.exit(f"import_gc: the toy run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="runs each way, taking turns")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import yaml
    from toy import make_tiny_model, toy_config

    results: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = toy_config(make_tiny_model(Path(tmp) / "model"), es_updates=2)
        for r in range(args.pairs):
            for hook in (False, True):
                cfg["run"]["output_dir"] = str(Path(tmp) / f"runs-{r}-{hook}")
                path = Path(tmp) / "cfg.yaml"
                path.write_text(yaml.safe_dump(cfg))
                res = run(path, hook)
                results[hook].append(res)
                print(
                    f"round {r + 1} {'paused' if hook else 'on    '}: collections {res['counts']}, "
                    f"{sum(res['seconds']):.2f} s in them, process CPU {res['cpu']:.2f} s",
                    flush=True,
                )
    print("\ncollector during imports  collections (gen 0/1/2)  s in collections  process CPU-s (mean)")
    for hook in (False, True):
        rs = results[hook]
        counts = [sum(r["counts"][g] for r in rs) / len(rs) for g in range(3)]
        gc_s = sum(sum(r["seconds"]) for r in rs) / len(rs)
        cpu = sum(r["cpu"] for r in rs) / len(rs)
        label = "paused (esbatch default)" if hook else "on (ESBATCH_GC_DURING_IMPORTS=1)"
        print(f"{label:33s} {'/'.join(f'{c:.0f}' for c in counts):>15s}  {gc_s:16.2f}  {cpu:14.2f}")


if __name__ == "__main__":
    main()
