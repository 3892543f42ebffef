"""Eval generation throughput on SmolLM2 (CPU): all n samples of each prompt in one batched generate call
(as `esbatch eval` does) vs one sample per call, for the same prompts, measured side by side.

    python benchmarks/eval_throughput.py [--prompts 4] [--n 8] [--tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from esbatch.backends.base import SamplingParams
    from esbatch.backends.hf import HFGenerator
    from esbatch.models import load_model_and_tokenizer
    from esbatch.tasks import TASKS

    model, tok = load_model_and_tokenizer("smollm2-135m-instruct", dtype="float32")
    gen = HFGenerator(model, tok, batch_size=args.prompts * args.n)
    task = TASKS.get("arithmetic")(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=["+"])
    exs = task.eval_examples(args.prompts, 0)
    prompts = [gen.chat_prompt(task.messages(e, [], None)) for e in exs]
    s = SamplingParams(0.6, 1.0, args.tokens, n=args.n, entropy=True)
    one = SamplingParams(0.6, 1.0, args.tokens, n=1, entropy=True)

    t0 = time.perf_counter()
    batched = gen.generate(prompts, s, seed=0)
    tb = time.perf_counter() - t0
    t0 = time.perf_counter()
    single = [g for p in prompts for i in range(args.n) for g in gen.generate([p], one, seed=i)]
    ts = time.perf_counter() - t0
    nb, ns = sum(g.n_tokens for g in batched), sum(g.n_tokens for g in single)
    print(f"{args.prompts} prompts x n={args.n}, <= {args.tokens} new tokens, fp32, {args.threads} threads")
    print(
        f"batched (n per call, {args.prompts * args.n} sequences/call): {nb} tokens in {tb:.1f} s = {nb / tb:.1f} tok/s"
    )
    print(f"one sample per call:                          {ns} tokens in {ts:.1f} s = {ns / ts:.1f} tok/s")
    print(f"speed-up (tokens/s ratio): {(nb / tb) / (ns / ts):.2f}x")


if __name__ == "__main__":
    main()
