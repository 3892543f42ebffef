"""ES noise throughput (esbatch/perturb/noise.py), side by side on each device present: elements/s of each
generator against torch.randn of the same size on the same device, and bytes/s (fp32 written) against a plain
copy_ of the same fp32 size. On the CPU, once per torch thread count in --threads, with the C kernel's AVX2 and
scalar paths, and a second ratio from process CPU time (all threads): on a shared machine the wall clock also
measures the other jobs, the CPU time much less so. Compare the ratios, not the absolute figures.

    python benchmarks/noise.py [--log2n 24] [--repeat 5] [--threads 1 2] [--eager]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from esbatch.perturb import cpu_kernel as K
from esbatch.perturb import noise as N


def best(fn: Callable[[], object], device: torch.device, repeat: int) -> tuple[float, float]:
    """(wall, process CPU) seconds, each the least of ``repeat`` calls after one warm-up call (builds, compiles)."""
    fn()
    walls, cpus = [], []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls), min(cpus)


def table(dev: torch.device, n: int, repeat: int, eager_n: int | None) -> None:
    """One table: the reference rows, then each generator scaled to randn and copy_ of its own size."""
    src, dst = torch.empty(n, device=dev).normal_(), torch.empty(n, device=dev)
    t_randn, c_randn = best(lambda: torch.randn(n, device=dev), dev, repeat)
    t_copy, c_copy = best(lambda: dst.copy_(src), dev, repeat)
    cpu = dev.type == "cpu"
    threads = f", torch threads {torch.get_num_threads()}" if cpu else ""
    print(f"device {dev}, n = 2^{n.bit_length() - 1}{threads}, best of {repeat}")
    print(f"  {'generator':34s} {'Melem/s':>9s} {'vs randn':>9s} {'vs copy_':>9s}" + (" cpu:vs randn" if cpu else ""))

    def row(label: str, m: int, t: float, c: float) -> None:
        scale = m / n  # randn and copy_ times scaled to this size
        extra = f" {c_randn * scale / c:12.2f}" if cpu else ""
        print(f"  {label:34s} {m / t / 1e6:9.1f} {t_randn * scale / t:9.2f} {t_copy * scale / t:9.3f}{extra}")

    row("torch.randn", n, t_randn, c_randn)
    row("copy_ (fp32 read + write)", n, t_copy, c_copy)
    rows = [("philox-gauss", "philox-gauss", True, n), ("philox-rademacher", "philox-rademacher", True, n)]
    if cpu:
        rows = [(f"{label} (C, {path})", noise, simd, m) for label, noise, _, m in rows for path, simd in paths()]
    else:
        rows = [(f"{label} (compiled)", noise, 2, m) for label, noise, _, m in rows]
    if eager_n:
        rows += [("philox-gauss (eager torch)", "philox-gauss", None, eager_n)]
    rows += [("legacy-cpu (+ copy to device)", "legacy-cpu", 2, n)]
    for label, noise, simd, m in rows:
        K.CPU_SIMD = 2 if simd is None else simd
        t, c = best(lambda m=m, z=noise, f=simd is not None: N.draw(1, "bench", 0, m, dev, z, fast=f), dev, repeat)
        row(label, m, t, c)
    K.CPU_SIMD = 2


def paths() -> list[tuple[str, int]]:
    """The C kernel's paths worth timing here: AVX-512 and AVX2 where the CPU has them, and the scalar one."""
    K.CPU_SIMD = 2
    have = K.SIMD_PATHS.index(K.cpu_simd())
    return [(K.SIMD_PATHS[lv], lv) for lv in range(have, -1, -1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch CPU thread counts to time")
    ap.add_argument("--eager", action="store_true", help="also time the eager torch path (about 100x slower)")
    args = ap.parse_args()
    eager_n = 1 << min(args.log2n, 18) if args.eager else None
    for threads in args.threads:
        torch.set_num_threads(threads)
        table(torch.device("cpu"), 1 << args.log2n, args.repeat, eager_n)
    if torch.cuda.is_available():
        table(torch.device("cuda"), 1 << args.log2n, args.repeat, eager_n)


if __name__ == "__main__":
    main()
