"""What a checkpoint-free ES run (checkpoint.center: final | none) pays on resume: the time to replay one logged
update, next to the time to generate that update's rollouts, on the same model and machine.

Replay is the normal code path (esbatch/es/trainer.py:replay, as resume and `esbatch center` call it) on the
HF backend with the model loaded as runs load it (esbatch/models.py); its records are built as es_step logs
them (draw_population, normalize, direction_weights, UpdateSpec) from made-up rewards, so the noise generator in
use (esbatch/perturb/noise.py) is what is timed. Generation is backend.evaluate_population on one update's
population and mini-batch (perturb, generate, restore per member), as es_step calls it.

    python benchmarks/replay.py                                  # SmolLM2-135M, N=8, B=16, 28 new tokens, fp32
    python benchmarks/replay.py --n 4 --batch 4 --updates 1      # a quick look
    python benchmarks/replay.py --model tiny                     # a 2-layer random model (tests/toy.py)

Prints one JSON line: seconds per replayed update, seconds of generation (and of perturb/restore) per update,
and replay / generation. Resuming a run of T updates with no center file costs T x replay_s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(args: argparse.Namespace, model_dir: str | None):
    import torch

    from esbatch.backends.hf import HFBackend
    from esbatch.config import load_config
    from esbatch.es.config import backend_setup

    torch.set_num_threads(args.threads)
    overrides = [
        f"model.dtype={args.dtype}",
        f"es.population_size={args.n}",
        f"es.batch_size={args.batch}",
        f"generation.max_new_tokens={args.tokens}",
        "generation.temperature=0.7",
        "task.heldout_size=0",
        "model.device=cpu",
        "tracking.drift=false",
    ]
    if model_dir:  # the tiny model's character tokenizer: keep prompts within its 256 positions
        overrides += [f"model.name={model_dir}", "task.few_shot=0"]
    cfg = load_config("quickstart", overrides)
    t0 = time.perf_counter()
    backend = HFBackend.for_es(backend_setup(cfg))  # as a run loads it (alias, GGUF cache, dtype, fp32 master)
    return cfg, backend, time.perf_counter() - t0


def records(cfg, updates: int) -> list[dict]:
    """Log records of ``updates`` updates, as es_step writes them (rewards made up: replay never reads them)."""
    import numpy as np

    from esbatch.es.core import direction_weights, draw_population, normalize
    from esbatch.perturb.update import UpdateSpec

    es, rng, out = cfg.es, np.random.default_rng(0), []
    for t in range(updates):
        members = draw_population(cfg.run.seed, t, es.population_size, es.estimator, es.generation_seeds)
        z = normalize(rng.random(len(members)).tolist(), es.normalization, es.eps_num)
        seeds, weights = direction_weights(members, z)
        spec = UpdateSpec(seeds, weights, es.alpha, es.population_size)
        out.append(
            {"t": t, "seeds": [m.seed for m in members], "signs": [m.sign for m in members], "sigma": es.sigma}
            | spec.to_dict()
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--n", type=int, default=8, help="population size N (directions per update)")
    ap.add_argument("--batch", type=int, default=16, help="prompts per update B")
    ap.add_argument("--tokens", type=int, default=28, help="new tokens per response")
    ap.add_argument("--updates", type=int, default=2, help="updates replayed (the mean per update is printed)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from esbatch.backends import PerturbedMember, SamplingParams
    from esbatch.es.core import draw_population
    from esbatch.es.replay import replay
    from esbatch.train.problems import load_problems
    from esbatch.train.schedule import batch_indices

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = None
        if args.model == "tiny":
            sys.path.insert(0, str(ROOT / "tests"))
            from toy import make_tiny_model

            model_dir = str(make_tiny_model(Path(tmp) / "tiny"))
        cfg, backend, load_s = build(args, model_dir)

        recs = records(cfg, args.updates)
        t0 = time.perf_counter()
        replay(backend, recs)
        replay_s = (time.perf_counter() - t0) / args.updates

        probs = load_problems(cfg, backend)
        _, idx = batch_indices(cfg.run.seed, 0, len(probs.train), cfg.es.batch_size)
        gen = cfg.generation
        members = draw_population(cfg.run.seed, 0, cfg.es.population_size, cfg.es.estimator, cfg.es.generation_seeds)
        pop = backend.evaluate_population(
            [PerturbedMember(m.seed, m.sign * cfg.es.sigma, m.gen_seed) for m in members],
            [probs.train_prompts[i] for i in idx],
            SamplingParams(gen.temperature, gen.top_p, gen.max_new_tokens),
        )
        tokens = sum(g.n_tokens for gens in pop.generations for g in gens)
        params = backend.num_parameters()
        backend.close()
    print(
        json.dumps(
            {
                "model": cfg.model.name if args.model == "smollm2" else "tiny (tests/toy.py)",
                "parameters": params,
                "dtype": args.dtype,
                "n": args.n,
                "batch": args.batch,
                "new_tokens": args.tokens,
                "threads": args.threads,
                "load_s": round(load_s, 3),
                "replay_s_per_update": round(replay_s, 4),
                "generation_s_per_update": round(pop.generation_s, 4),
                "perturb_restore_s_per_update": round(pop.perturb_restore_s, 4),
                "tokens_generated": tokens,
                "replay_over_generation": round(replay_s / pop.generation_s, 4) if pop.generation_s else None,
            }
        )
    )


if __name__ == "__main__":
    main()
