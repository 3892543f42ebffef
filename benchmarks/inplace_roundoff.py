"""How far in-place perturb/restore cycles move weights that exact restore keeps (es.restore: inplace vs exact).

Hand-built weights ~ N(0, 0.02) in a compute dtype; each cycle adds sigma*eps in place and subtracts the same
sigma*eps (esbatch/perturb/inplace.py, the paper's App. G.1 implementation), with a fresh direction per cycle as
the members of an ES population have. Prints the fraction of elements no longer equal to their start, and the
relative L2 distance, after 1, 2, 4, ... cycles. Fast (a few seconds on one core).

    python benchmarks/inplace_roundoff.py [--n 1000000] [--sigma 1e-3] [--cycles 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import torch

from esbatch.perturb import weights_for


def roundoff(
    n: int, sigma: float, cycles: int, dtype: torch.dtype, restore: str = "inplace", seed: int = 0
) -> list[tuple[int, float, float]]:
    """[(cycles done, fraction of elements moved, ||w - w0|| / ||w0||)] at powers of two and at ``cycles``."""
    gen = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(n, generator=gen) * 0.02).to(dtype)
    live = {"w": w0.clone()}
    weights = weights_for(live, restore, track_drift=False)
    out = []
    for k in range(1, cycles + 1):
        weights.perturb(seed=1000 + k, scale=sigma)
        weights.restore()
        if k & (k - 1) == 0 or k == cycles:
            w = live["w"]
            moved = float((w != w0).double().mean())
            rel = float((w.double() - w0.double()).norm() / w0.double().norm())
            out.append((k, moved, rel))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="weights")
    ap.add_argument("--sigma", type=float, default=1e-3)
    ap.add_argument("--cycles", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"{a.n} weights ~ N(0, 0.02) in {a.dtype}, in-place add/subtract of sigma*eps, sigma={a.sigma}")
    print(f"{'cycles':>6}  {'moved':>8}  {'rel L2':>9}")
    for k, moved, rel in roundoff(a.n, a.sigma, a.cycles, dtype):
        print(f"{k:>6}  {moved:>8.2%}  {rel:>9.2e}")
    k, moved, rel = roundoff(a.n, a.sigma, a.cycles, dtype, restore="exact")[-1]
    print(f"exact restore (es.restore: exact), same cycles: {moved:.2%} moved after {k} (rel L2 {rel:.1e})")


if __name__ == "__main__":
    main()
