"""ES weight moves against the memory bound on one device, for one model loaded once.

Measures, each a median of --repeat calls (CUDA synchronized around every call):
  - copy bandwidth: ``dst.copy_(src)`` of a large fp32 buffer, bytes read + written per second;
  - noise throughput: elements/s of ``draw`` (philox-gauss, philox-rademacher) and of ``torch.randn``, against the
    rate fp32 could be written at the copy bandwidth;
  - one perturb, one restore and one update (N directions) through CenteredWeights on the model's own
    parameters, against the least bytes each must move divided by the copy bandwidth (``min_bytes``);
  - peak device memory of ES (HFBackend with its fp32 master: perturb + generate + restore + update) against
    inference alone (HFGenerator, the same B rollouts), each from a reset of torch.cuda.max_memory_allocated.
    Not measured on the CPU: ru_maxrss is a per-process high-water mark that cannot be reset between the two
    (benchmarks/es_overhead.py measures RSS in two processes); the same steps still run there.

Prints one markdown table (quantity | measured | bound / reference | ratio | ok); scripts/gpu_check.py adds
these rows to its own table.

    python benchmarks/es_kernels.py --device cuda --dtype bfloat16 --model smollm2-135m-instruct
    python benchmarks/es_kernels.py --device cpu --model path/to/hf/dir --json kernels.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NOISE_RATES = ("torch.randn", "philox-gauss", "philox-rademacher")  # the noise throughput rows
OPS = ("perturb", "restore", "update")
MASTER_BYTES = 4  # the fp32 center, per parameter
WORKSPACE_CHUNKS = 16  # fp32 noise chunks (noise.CHUNK elements) of scratch the ES memory bound allows


def min_bytes(op: str, elt: int) -> int:
    """Bytes per parameter ``op`` must move at the least, with live weights of ``elt`` bytes per element.

    perturb: read the fp32 master, write live (the noise is computed, not read); restore: the same copy;
    update: read and write the master, and write live, which must follow the new center."""
    return {"perturb": MASTER_BYTES + elt, "restore": MASTER_BYTES + elt, "update": 2 * MASTER_BYTES + elt}[op]


@dataclass(frozen=True)
class Row:
    """One line of the check's table; ``status`` is ok, FAILED..., info (a figure, not judged) or n/a: why."""

    quantity: str
    measured: str
    reference: str = "-"
    ratio: float | None = None
    status: str = "info"

    @property
    def failed(self) -> bool:
        return self.status.startswith("FAILED")


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| quantity | measured | bound / reference | ratio | ok |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3g}"
        lines.append(f"| {r.quantity} | {r.measured} | {r.reference} | {ratio} | {r.status} |")
    return "\n".join(lines)


@dataclass
class KernelReport:
    """What ``measure`` found; ``rows`` turns it into the table (the arithmetic of the bounds lives here)."""

    device: str
    dtype: str
    model: str
    noise: str  # the generator perturb and update draw with
    params: int  # distinct parameters (tied weights once)
    tensors: int
    largest: int  # elements of the largest tensor
    elt: int  # bytes per live element (compute dtype)
    copy_bytes_per_s: float
    noise_n: int  # elements per timed draw
    noise_per_s: dict[str, float]  # NOISE_RATES -> elements/s
    directions: int  # N of the timed update
    ms: dict[str, float]  # OPS -> median milliseconds
    repeat: int
    batch: int
    tokens: int
    es_state_bytes: int  # what the ES backend holds beyond inference (fp32 master, theta_0 when tracked)
    peak_inference: int | None = None  # bytes; None: not measured (CPU)
    peak_es: int | None = None
    peak_es_host: int | None = None  # the same ES work with es.master: host (fp32 center in host memory)

    def bound_ms(self, op: str) -> float:
        """The least time ``op`` can take: its bytes at the measured copy bandwidth."""
        return min_bytes(op, self.elt) * self.params / self.copy_bytes_per_s * 1e3

    def noise_ms(self, op: str) -> float:
        """Time to draw the noise ``op`` needs at the measured rate of its generator (restore draws none)."""
        draws = {"perturb": 1, "restore": 0, "update": self.directions}[op]
        return draws * self.params / self.noise_per_s[self.noise] * 1e3

    def write_rate(self) -> float:
        """fp32 elements/s written at the copy bandwidth: what a generator bound by memory alone would reach."""
        return self.copy_bytes_per_s / 4

    def workspace_bytes(self) -> int:
        """Scratch ES may hold beyond its state: update's compute-dtype copy of the largest tensor and its changed
        mask (CenteredWeights.update), plus WORKSPACE_CHUNKS fp32 noise chunks (draws, accumulators)."""
        from esbatch.perturb.noise import CHUNK

        return self.largest * (self.elt + 1) + WORKSPACE_CHUNKS * CHUNK * 4

    def memory_bound(self) -> int | None:
        if self.peak_inference is None:
            return None
        return self.peak_inference + self.es_state_bytes + self.workspace_bytes()

    def rows(self) -> list[Row]:
        rows = [
            Row(
                f"copy bandwidth ({self.device}, fp32 copy_, read + write)",
                f"{self.copy_bytes_per_s / 1e9:.1f} GB/s",
                "basis of the bounds below",
            )
        ]
        write = self.write_rate()
        for name in NOISE_RATES:
            rate = self.noise_per_s[name]
            rows.append(
                Row(
                    f"noise {name}, {self.noise_n} elements",
                    f"{rate / 1e9:.3g} Gelem/s",
                    f"{write / 1e9:.3g} Gelem/s (fp32 written at copy bandwidth)",
                    write / rate,
                )
            )
        size = f"{self.params / 1e6:.3g}M params, {self.tensors} tensors, {self.dtype}"
        for op in OPS:
            what = f"update, N={self.directions}" if op == "update" else op
            extra = f"; its noise alone {self.noise_ms(op):.3g} ms" if op != "restore" else ""
            rows.append(
                Row(
                    f"{what} ({size})",
                    f"{self.ms[op]:.3g} ms",
                    f"{self.bound_ms(op):.3g} ms ({min_bytes(op, self.elt)} B/param at copy bandwidth){extra}",
                    self.ms[op] / self.bound_ms(op),
                )
            )
        rows.append(self.memory_row())
        rows.append(self.target_row())
        return rows

    def target_row(self) -> Row:
        """Issue 15's goal, apart from the accounting above: ES at most inference + 2 B/param (+ workspace), met by
        es.master: host (the fp32 center in host memory, a compute-dtype copy on the device: offload.py); the
        default layout (es.master: device, the row above) keeps the fp32 center on the device and would not."""
        what = "peak memory, ES (es.master: host) vs inference + 2 B/param (issue 15 target)"
        if self.peak_inference is None or self.peak_es_host is None:
            return Row(what, "not measured", status=f"n/a: {self.device} (ru_maxrss cannot be reset)")
        mib = 2**20
        goal = self.peak_inference + 2 * self.params + self.workspace_bytes()
        peak = self.peak_es_host
        return Row(
            what,
            f"ES {peak / mib:.0f} MiB",
            f"{goal / mib:.0f} MiB (inference + 2 B/param + workspace)",
            peak / goal,
            "ok" if peak <= goal else f"FAILED: {(peak - goal) / mib:.1f} MiB above the target",
        )

    def memory_row(self) -> Row:
        what = f"peak memory, ES vs inference (B={self.batch}, {self.tokens} tokens)"
        bound = self.memory_bound()
        if bound is None or self.peak_es is None:
            return Row(what, "not measured", status=f"n/a: {self.device} (ru_maxrss cannot be reset)")
        mib = 2**20
        over = (self.peak_es - bound) / mib
        return Row(
            what,
            f"ES {self.peak_es / mib:.0f} MiB",
            f"inference {self.peak_inference / mib:.0f} MiB; allowed {bound / mib:.0f} MiB (+ ES state "
            f"{self.es_state_bytes / mib:.0f} + workspace {self.workspace_bytes() / mib:.0f})",
            self.peak_es / self.peak_inference,
            "ok" if self.peak_es <= bound else f"FAILED: {over:.1f} MiB above inference + state + workspace",
        )


# ----------------------------------------------------------------------------- measuring


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn: Callable[[], object], device, repeat: int, setup: Callable[[], object] | None = None) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` (``setup`` run untimed before each), device synchronized."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device, n: int, repeat: int) -> float:
    """Bytes read + written per second by ``copy_`` of ``n`` fp32 elements."""
    import torch

    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst
    return 2 * 4 * n / median_s(lambda: dst.copy_(src), device, repeat)


def noise_rates(device, n: int, repeat: int) -> dict[str, float]:
    """Elements/s of torch.randn and of each philox generator's ``draw`` (one untimed call first: builds the C
    kernel, compiles on CUDA)."""
    import torch

    from esbatch.perturb.noise import draw

    calls = {"torch.randn": lambda: torch.randn(n, device=device)}
    for noise in NOISE_RATES[1:]:
        calls[noise] = lambda noise=noise: draw(1, "bench", 0, n, device, noise)
    rates = {}
    for name, fn in calls.items():
        fn()
        rates[name] = n / median_s(fn, device, repeat)
    return rates


def prompts(gen, batch: int) -> list[str]:
    """B short chat prompts (raw text when the tokenizer has no chat template)."""
    texts = [f"Count from {i} to {i + 9}." for i in range(batch)]
    try:
        return [gen.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    except ValueError:
        return texts


def generate_full(gen, texts: list[str], tokens: int) -> None:
    """Sample exactly ``tokens`` new tokens for every prompt (EOS suppressed), so ES and inference hold the same
    KV cache whatever the weights."""
    import torch

    from esbatch.backends import SamplingParams

    s = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=tokens)
    gcfg = gen.generation_config(s)
    gcfg.min_new_tokens = tokens
    torch.manual_seed(0)
    gen.generate_call(texts, gcfg, s)


class Peak:
    """torch.cuda.max_memory_allocated from a reset; None on other devices (no resettable high-water mark)."""

    def __init__(self, device) -> None:
        self.device = device

    def reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            _sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> int | None:
        import torch

        if self.device.type != "cuda":
            return None
        _sync(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


def measure(
    model: str,
    device: str = "cuda",
    dtype: str = "bfloat16",
    *,
    noise: str = "philox-gauss",
    directions: int = 8,
    repeat: int = 5,
    copy_log2n: int = 28,
    noise_log2n: int = 20,
    batch: int = 16,
    tokens: int = 64,
    sigma: float = 1e-3,
) -> KernelReport:
    """Load ``model`` once on ``device`` in ``dtype`` and measure everything ``KernelReport`` holds."""
    import torch

    from esbatch.backends.hf import HFBackend, HFGenerator
    from esbatch.models import load_model_and_tokenizer
    from esbatch.perturb import CenteredWeights, UpdateSpec

    dev = torch.device(device)
    lm, tok = load_model_and_tokenizer(model, dtype=dtype, device=device)
    bandwidth = copy_bandwidth(dev, 1 << copy_log2n, repeat)
    rates = noise_rates(dev, 1 << noise_log2n, repeat)

    peak = Peak(dev)
    gen = HFGenerator(lm, tok, batch_size=batch)
    texts = prompts(gen, batch)
    peak.reset()
    generate_full(gen, texts, tokens)
    peak_inference = peak.read()

    es = HFBackend(lm, tok, batch_size=batch, track_drift=False, noise=noise)
    weights = es.weights
    assert isinstance(weights, CenteredWeights), type(weights)
    live = weights.live
    spec = UpdateSpec(tuple(range(1, directions + 1)), tuple((-1.0) ** i for i in range(directions)), 1e-4, directions)
    weights.perturb(0, sigma)  # warm-up: compiles for these chunk sizes
    weights.restore()
    weights.update(spec)
    ms = {
        "perturb": median_s(lambda: weights.perturb(0, sigma), dev, repeat, setup=weights.restore) * 1e3,
    }
    weights.restore()
    ms["restore"] = median_s(weights.restore, dev, repeat, setup=lambda: weights.perturb(0, sigma)) * 1e3
    ms["update"] = median_s(lambda: weights.update(spec), dev, repeat) * 1e3

    def es_peak(backend) -> int | None:
        """Peak device memory of one member's perturb + generate + restore, then the update."""
        peak.reset()
        backend.perturb(0, sigma)
        generate_full(backend, texts, tokens)
        backend.restore()
        backend.update(spec)
        return peak.read()

    peak_es = es_peak(es)

    mem = es.memory_report()
    peak_es_host = None
    if dev.type == "cuda":  # the same work with the fp32 center in host memory (es.master: host)
        import gc

        del es, weights, live
        gc.collect()
        torch.cuda.empty_cache()
        host = HFBackend(lm, tok, batch_size=batch, track_drift=False, noise=noise, master="host")
        peak_es_host = es_peak(host)
        live = host.weights.live
    return KernelReport(
        device=str(dev),
        dtype=dtype,
        model=model,
        noise=noise,
        params=sum(p.numel() for p in live.values()),
        tensors=len(live),
        largest=max(p.numel() for p in live.values()),
        elt=next(iter(live.values())).element_size(),
        copy_bytes_per_s=bandwidth,
        noise_n=1 << noise_log2n,
        noise_per_s=rates,
        directions=directions,
        ms=ms,
        repeat=repeat,
        batch=batch,
        tokens=tokens,
        es_state_bytes=int(mem["master_bytes"] + mem["theta0_bytes"]),
        peak_inference=peak_inference,
        peak_es=peak_es,
        peak_es_host=peak_es_host,
    )


def main() -> int:
    import torch

    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF dir or hub id")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--noise", default="philox-gauss", choices=["philox-gauss", "philox-rademacher"])
    ap.add_argument("--directions", type=int, default=8, help="N of the timed update")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--copy-log2n", type=int, help="fp32 elements of the copy buffer, log2 (default 28 CUDA, 24 CPU)")
    ap.add_argument("--noise-log2n", type=int, default=20, help="elements per timed draw, log2 (20: noise.CHUNK)")
    ap.add_argument("--batch", type=int, default=16, help="rollouts B of the memory measurement")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per rollout (EOS suppressed)")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    on_cuda = args.device.startswith("cuda")
    report = measure(
        args.model,
        args.device,
        args.dtype or ("bfloat16" if on_cuda else "float32"),
        noise=args.noise,
        directions=args.directions,
        repeat=args.repeat,
        copy_log2n=args.copy_log2n or (28 if on_cuda else 24),
        noise_log2n=args.noise_log2n,
        batch=args.batch,
        tokens=args.tokens,
    )
    print(f"{report.model} on {report.device} in {report.dtype}, median of {report.repeat}")
    print(markdown(report.rows()))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 1 if any(r.failed for r in report.rows()) else 0


if __name__ == "__main__":
    sys.exit(main())
