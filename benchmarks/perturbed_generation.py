"""Does generating with perturbed weights cost more than with the center? Side by side in one process.

Alternates the same B prompts with fixed (center) and perturbed weights for a few rounds and prints ms per
generated token for each: the end-to-end ES overhead ratio (benchmarks/es_overhead.py) compares two
processes minutes apart, and this shows how much of its scatter is generation itself.

    .venv/bin/python benchmarks/perturbed_generation.py --rounds 4 --batch 16 --tokens 28
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=28)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from esbatch.backends import SamplingParams
    from esbatch.backends.hf import HFBackend
    from esbatch.config import load_config
    from esbatch.models import load_model_and_tokenizer
    from esbatch.train.problems import load_problems

    torch.set_num_threads(args.threads)
    cfg = load_config("quickstart", ["model.dtype=float32", "task.heldout_size=0"])
    model, tok = load_model_and_tokenizer(cfg.model.name, dtype="float32")
    backend = HFBackend(model, tok, batch_size=args.batch, track_drift=False)
    prompts = load_problems(cfg, backend).train_prompts[: args.batch]
    s = SamplingParams(cfg.generation.temperature, cfg.generation.top_p, args.tokens)
    backend.perturb(0, cfg.es.sigma)  # the first write into the mapped weights (page faults), and a warm-up
    backend.restore()
    backend.generate(prompts[:2], s, 0)
    ms: dict[str, list[float]] = {"fixed": [], "perturbed": []}
    for i in range(args.rounds):
        for mode in ms:
            if mode == "perturbed":
                backend.perturb(100 + i, cfg.es.sigma)
            t0 = time.perf_counter()
            gens = backend.generate(prompts, s, 7)
            dt = time.perf_counter() - t0
            if mode == "perturbed":
                backend.restore()
            n = sum(g.n_tokens for g in gens)
            ms[mode].append(dt / n * 1e3)
            print(f"  round {i} {mode:9s} {dt:6.2f} s  {n} tokens  {dt / n * 1e3:5.1f} ms/token", flush=True)
    for mode, v in ms.items():
        print(f"{mode:9s} ms/token: mean {statistics.mean(v):.1f}, range {min(v):.1f} - {max(v):.1f}")
    print(f"perturbed / fixed (means): {statistics.mean(ms['perturbed']) / statistics.mean(ms['fixed']):.3f}")


if __name__ == "__main__":
    main()
