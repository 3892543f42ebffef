"""Score the final centers of ES runs (and the base model) greedily on a larger held-out set.

The in-training held-out set has 64 problems (one problem = 1.6 points); this draws a fresh, larger set
with another seed, drops every problem that any run trained on or saw as a demonstration, and scores the
base model and each run's final center on it with the same prompts.

    python benchmarks/demo_heldout.py benchmarks/results/demo_scan/scan-* --n 256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    from esbatch.backends import BACKENDS
    from esbatch.config import load_config
    from esbatch.es.config import backend_setup
    from esbatch.tasks import TASKS
    from esbatch.train.problems import Problems, evaluate_heldout
    from esbatch.train.rundir import RunDir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = [RunDir(d) for d in args.run_dirs if (Path(d) / "center.safetensors").exists()]
    cfg = load_config(str(runs[0].config), ["tracking.drift=false"])
    backend = BACKENDS.get(cfg.backend.name).for_es(backend_setup(cfg))
    task = TASKS.get(cfg.task.name)(cfg.task.data_path, **cfg.task.params)
    train = task.splits(cfg.task.train_size, cfg.task.heldout_size, cfg.task.few_shot, cfg.run.seed)
    seen = set()
    for rd in runs:  # every problem any run trained on, was scored on, or saw as a demonstration
        c = load_config(str(rd.config))
        sp = task.splits(c.task.train_size, c.task.heldout_size, c.task.few_shot, c.run.seed)
        seen |= {e.question for split in sp.values() for e in split}
    pool = task.splits(1, args.n + 300, 0, args.seed)["heldout"]
    heldout = [e for e in pool if e.question not in seen][: args.n]
    # same prompts as in training: the runs' own few-shot demonstrations
    prompts = [backend.chat_prompt(task.messages(e, train["demo"], cfg.task.system_prompt)) for e in heldout]
    probs = Problems(task, [], heldout, [], prompts)
    base = backend.center_state_dict()
    rows = [("base model", None, evaluate_heldout(cfg, backend, probs))]
    for rd in runs:
        state, t = rd.load_center()
        backend.load_center(state)
        rows.append((rd.path.name, t, evaluate_heldout(cfg, backend, probs)))
    backend.load_center(base)
    n = len(probs.heldout)
    print(f"greedy accuracy on {n} fresh held-out problems (none seen in training), +- binomial standard error")
    for name, t, s in rows:
        acc = s["heldout/accuracy"]
        se = (acc * (1 - acc) / n) ** 0.5
        tag = "" if t is None else f" after {t} updates"
        print(f"  {name + tag:52s} {acc:.3f} +- {se:.3f}  ({round(acc * n)}/{n})  reward {s['heldout/reward']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps([{"run": r, "t": t, **s} for r, t, s in rows], indent=2))


if __name__ == "__main__":
    main()
