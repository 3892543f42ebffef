"""Where a vLLM low-rank population's time goes, measured inside the engine's worker: the hooks by kind and step
type (prefill / decode), `es_lowrank_begin` (drawing and stacking the factors), the model's forward passes and the
model runner's other work, for the population and for plain inference of the same N x B prompts on the same
engine, alternated --repeats times (docs/benchmarks.md, "vLLM with the population's factors drawn at once").

A worker extension (TimedExtension, below) wraps EngineLowRank's methods and the model runner's in the worker
process; the driver reads the sums back over collective_rpc after each side. --noop-hooks: the hooks return at
once (wrong outputs; measures what registering them costs).

    .venv-vllm/bin/python benchmarks/vllm_lowrank_profile.py [--n 32] [--rank 4] [--tokens 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from esbatch.backends.vllm_worker import ESWorkerExtension  # noqa: E402

STATS: dict[str, float] = defaultdict(float)
STEP = {"kind": "decode", "t0": 0.0}


def _timed_engine() -> None:
    """Wrap EngineLowRank's hook, token mapping and begin (once per worker process)."""
    from esbatch.backends import vllm_lowrank as vl

    cls = vl.EngineLowRank
    if getattr(cls, "_timed", False):
        return
    cls._timed = True
    hook, map_tokens, begin = cls._hook, cls._map_tokens, cls.begin
    noop = os.environ.get("ESBATCH_PROFILE_NOOP") == "1"

    def timed_hook(self, module, args, output):
        t = time.perf_counter()
        if not noop:
            hook(self, module, args, output)
        site = self.sites[module]
        kind = site.kind + ("" if site.kind != "linear" else "-fused" if len(site.weight) > 1 else "-plain")
        STATS[f"{STEP['kind']}: hooks {kind} s"] += time.perf_counter() - t
        STATS[f"{STEP['kind']}: hook calls"] += 1

    def timed_map(self, module, args, kwargs):
        t = time.perf_counter()
        map_tokens(self, module, args, kwargs)
        tokens, requests = self.token_member.shape[0], self.row_member.shape[0]
        STEP["kind"] = "decode" if tokens < 2 * requests else "prefill"  # (a prefill step: whole prompts)
        STATS[f"{STEP['kind']}: token mapping s"] += time.perf_counter() - t
        STATS[f"{STEP['kind']}: steps"] += 1

    def timed_begin(self, members):
        t = time.perf_counter()
        begin(self, members)
        STATS["population: es_lowrank_begin s"] += time.perf_counter() - t
        _timed_runner(self)

    cls._hook, cls._map_tokens, cls.begin = timed_hook, timed_map, timed_begin


def _timed_runner(engine) -> None:
    """Time the model's forward and the runner's step methods, as population or inference by whether a population
    is hooked in."""
    runner = engine.runner
    if getattr(runner, "_timed", False):
        return
    runner._timed = True

    def side() -> str:
        return "population" if engine.members is not None else "inference"

    def pre(module, args, kwargs):
        STEP["t0"] = time.perf_counter()

    def post(module, args, output):
        STATS[f"{side()}: forward s"] += time.perf_counter() - STEP["t0"]

    runner.model.register_forward_pre_hook(pre, with_kwargs=True)
    runner.model.register_forward_hook(post)
    for name in ("execute_model", "sample_tokens"):
        if not hasattr(runner, name):
            continue
        method = getattr(runner, name)

        def wrapped(*a, _method=method, _name=name, **k):
            t = time.perf_counter()
            try:
                return _method(*a, **k)
            finally:
                STATS[f"{side()}: runner.{_name} s"] += time.perf_counter() - t

        setattr(runner, name, wrapped)


class TimedExtension(ESWorkerExtension):
    """ESWorkerExtension with the timers above; ``profile_stats`` returns and clears the sums."""

    def es_lowrank_begin(self, members):
        _timed_engine()
        return super().es_lowrank_begin(members)

    def profile_stats(self) -> dict[str, float]:
        out = dict(STATS)
        STATS.clear()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="members")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--noop-hooks", action="store_true", help="hooks return at once (their registration's cost)")
    args = ap.parse_args()
    # the worker process imports this module by name (benchmarks.vllm_lowrank_profile)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if args.noop_hooks:
        os.environ["ESBATCH_PROFILE_NOOP"] = "1"
    from transformers import AutoTokenizer

    from benchmarks.lowrank import chat_prompts, population, vllm_fixed_length
    from esbatch.backends import SamplingParams
    from esbatch.backends.vllm_lowrank_backend import VLLMLowRankBackend
    from esbatch.models import model_path

    vllm_fixed_length()
    path = model_path("smollm2-135m-instruct")[0]
    prompts = chat_prompts(AutoTokenizer.from_pretrained(path), args.batch)
    members = population(args.n)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.tokens)
    low = VLLMLowRankBackend(
        path, rank=args.rank, dtype="float32", kv_cache_gb=2, track_drift=False, prefix_caching=False,
        max_model_len=1024, worker_extension="benchmarks.vllm_lowrank_profile:TimedExtension",
    )  # fmt: skip
    try:
        low.evaluate_population(members[:2], prompts, sampling)  # warm-up
        low.engines[0].collective_rpc("profile_stats")
        print(f"# SmolLM2 fp32, N={args.n}, r={args.rank}, B={args.batch}, {args.tokens} tokens, vLLM eager")
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            low.generate(prompts * args.n, sampling, 0)
            inference = time.perf_counter() - t0
            t0 = time.perf_counter()
            low.evaluate_population(members, prompts, sampling)
            pop = time.perf_counter() - t0
            (stats,) = low.engines[0].collective_rpc("profile_stats")
            print(f"\nrepeat {rep}: inference {inference:.2f} s, population {pop:.2f} s, ratio {inference / pop:.3f}")
            for key in sorted(stats):
                print(f"  {key:42s} {stats[key]:9.3f}")
    finally:
        low.close()


if __name__ == "__main__":
    main()
