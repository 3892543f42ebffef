"""The vLLM low-rank hook's term for a fused output (q/k/v, gate/up) at r > 1, two ways, side by side in one process
(esbatch/backends/vllm_lowrank.py, ``_Groups.lowrank``):

    per part         each part's product added to its strided column slice of the fused output
    block-diagonal   one baddbmm_ into the whole output, part k's factors on its own columns, zeros elsewhere
                     (what the hook does since 868f9e6)

on SmolLM2's shapes (hidden 576; q/k/v 576 + 192 + 192, gate/up 2 x 1536), for a decode step (N members x 4 rows)
and a prefill step (23 members x 172 rows, as in a 4096-token step of 43-token prompts). No vLLM needed: the
hook's arithmetic is plain torch. Prints the median of --repeats alternated timings of each and their ratio.

    .venv/bin/python benchmarks/vllm_lowrank_hooks.py [--rank 4] [--members 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from esbatch.backends.vllm_lowrank import _Groups  # noqa: E402

HIDDEN = 576
FUSED = {"qkv": [576, 192, 192], "gate_up": [1536, 1536]}


def per_call_ms(fn, calls: int = 30) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--members", type=int, default=32, help="U: members on the engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    u, r = args.members, args.rank
    print(f"# fused-output hook term, r={r}, U={u}, {args.threads} threads: ms per call (median of {args.repeats})")
    for step, (g, rows) in {"decode": (u, 4), "prefill": (23, 172)}.items():
        groups = _Groups.of(torch.arange(g).repeat_interleave(rows), "cpu")
        for name, widths in FUSED.items():
            total, p = sum(widths), len(widths)
            x, y = torch.randn(g * rows, HIDDEN), torch.randn(g * rows, total)
            bt = torch.randn(u + 1, p * r, HIDDEN)
            ats = [torch.randn(u + 1, r, w) for w in widths]
            starts = [sum(widths[:k]) for k in range(p)]
            parts = [(starts[k], widths[k], ats[k], k) for k in range(p)]
            cat = torch.zeros(u + 1, p * r, total)
            for k in range(p):
                cat[:, k * r : (k + 1) * r, starts[k] : starts[k] + widths[k]] = ats[k]
            a, b = [], []
            for _ in range(args.repeats):
                a.append(per_call_ms(partial(groups.lowrank, y, x, bt, parts, r)))
                b.append(per_call_ms(partial(groups.lowrank, y, x, bt, [(0, total, cat, 0)], p * r)))
            ma, mb = sorted(a)[len(a) // 2], sorted(b)[len(b) // 2]
            print(
                f"{step:8s} T={g * rows:5d} {name:8s} per part {ma:8.3f}  block-diagonal {mb:8.3f}  "
                f"per part / block-diagonal {ma / mb:5.2f}"
            )


if __name__ == "__main__":
    main()
