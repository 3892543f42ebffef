"""ES noise throughput (esbatch/perturb/noise.py), side by side on each device present: elements/s of each
generator against torch.randn of the same size on the same device, and bytes/s (fp32 written) against a plain
copy_ of the same fp32 size. The machine may be shared: compare the ratios, not the absolute figures.

    python benchmarks/noise.py [--log2n 24] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from esbatch.perturb import noise as N


def best(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Seconds of the fastest of ``repeat`` calls (after one warm-up call: builds, compiles, caches)."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--eager-log2n", type=int, default=20, help="the eager torch path is slow: a smaller size")
    args = ap.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for dev in devices:
        n = 1 << args.log2n
        src, dst = torch.empty(n, device=dev).normal_(), torch.empty(n, device=dev)
        t_randn = best(lambda n=n, dev=dev: torch.randn(n, device=dev), dev, args.repeat)
        t_copy = best(lambda dst=dst, src=src: dst.copy_(src), dev, args.repeat)
        print(f"device {dev}, n = 2^{args.log2n}, torch threads {torch.get_num_threads()}, best of {args.repeat}")
        print(f"  {'generator':34s} {'Melem/s':>9s} {'vs randn':>9s} {'GB/s out':>9s} {'vs copy_':>9s}")
        print(
            f"  {'torch.randn':34s} {n / t_randn / 1e6:9.1f} {1:9.2f} {4 * n / t_randn / 1e9:9.2f} "
            f"{t_copy / t_randn:9.3f}"
        )
        print(
            f"  {'copy_ (fp32 read + write)':34s} {n / t_copy / 1e6:9.1f} {t_randn / t_copy:9.2f} "
            f"{4 * n / t_copy / 1e9:9.2f} {1:9.3f}"
        )
        rows = [
            ("philox-gauss (fast)", "philox-gauss", True, n),
            ("philox-rademacher (fast)", "philox-rademacher", True, n),
            ("philox-gauss (eager torch)", "philox-gauss", False, 1 << args.eager_log2n),
            ("philox-rademacher (eager torch)", "philox-rademacher", False, 1 << args.eager_log2n),
            ("legacy-cpu (+ copy to device)", "legacy-cpu", True, n),
        ]
        threads = torch.get_num_threads()
        if dev.type == "cpu" and threads > 1:
            rows.insert(2, ("philox-gauss (fast, 1 thread)", "philox-gauss", True, n))
        for label, noise, fast, m in rows:
            torch.set_num_threads(1 if "1 thread" in label else threads)
            t = best(lambda m=m, d=dev, z=noise, f=fast: N.draw(1, "bench", 0, m, d, z, fast=f), dev, args.repeat)
            tr = t_randn * m / n  # randn time scaled to this size
            print(f"  {label:34s} {m / t / 1e6:9.1f} {tr / t:9.2f} {4 * m / t / 1e9:9.2f} {t_copy * m / n / t:9.3f}")
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
