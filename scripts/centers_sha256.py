"""Train three small runs and print the sha256 of each final center: the refactoring check of issue 28.

A refactor that says "behaviour unchanged" runs this before and after and compares the three lines:
  quickstart-es   the built-in quickstart config (SmolLM2-135M, ES N=8, B=16), es.updates=3, no held-out eval
  tiny-grpo       GRPO on a tiny random-init Llama and the toy digit task (tests/toy.py), 2 updates
  tiny-es-grpo    the pipeline es -> grpo on the same tiny model, 4 updates split 2 + 2

The hash covers every tensor's name, dtype, shape and bytes in name order (not the file's header).
Usage: .venv/bin/python scripts/centers_sha256.py [WORK_DIR]   (takes ~5 min on 2 cores)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from toy import make_tiny_model, toy_config  # noqa: E402


def center_sha256(path: Path) -> str:
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for name, t in sorted(load_file(str(path)).items()):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def train(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "esbatch", "train", *args, "--no-progress"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        sys.exit(f"esbatch train {' '.join(args)} failed:\n{(p.stdout + p.stderr)[-3000:]}")


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="centers-"))
    model = make_tiny_model(work / "tiny")
    runs = work / "runs"
    sets = [
        f"run.output_dir={runs}",
        "run.name=qs",
        "es.updates=3",
        "task.heldout_size=0",
        "eval.every=0",
        "run.threads=1",
    ]
    train(["quickstart", *(a for s in sets for a in ("--set", s))])
    common = dict(
        run={"seed": 3, "threads": 1, "output_dir": str(runs)},
        eval={"every": 0},
        heldout=0,
        gen_batch=16,
        tracking={"experiment": "centers"},
    )
    grpo = toy_config(
        model,
        **{**common, "run": {**common["run"], "name": "grpo"}},
        algorithm="grpo",
        es=None,
        grpo={"group_size": 4, "batch_size": 2, "learning_rate": 1e-3, "updates": 2},
    )
    pipe = toy_config(
        model,
        **{**common, "run": {**common["run"], "name": "pipe"}},
        algorithm="pipeline",
        pipeline={"stages": ["es", "grpo"], "updates": 4},
        grpo={"group_size": 4, "batch_size": 2, "learning_rate": 1e-3},
    )
    for name, cfg in (("grpo", grpo), ("pipe", pipe)):
        (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        train([str(work / f"{name}.yaml")])
    for label, path in (
        ("quickstart-es", runs / "qs"),
        ("tiny-grpo", runs / "grpo"),
        ("tiny-es-grpo", runs / "pipe" / "stage2-grpo"),
    ):
        print(f"{label:14s} {center_sha256(path / 'center.safetensors')}")


if __name__ == "__main__":
    main()
