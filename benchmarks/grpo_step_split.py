"""A GRPO step split into rollout, weight load and training, vLLM rollouts (the engine in the trainer's process,
backend.policy_engine: in_process, and in its own, separate) against HF rollouts; then the weight load alone
against model size. fp32, CPU, in the vLLM environment (it has DeepSpeed too):

    .venv-vllm/bin/python benchmarks/grpo_step_split.py [--models tiny smollm2] [--steps 2] [--batch 2] [--group 4]
        [--rounds R]

Per model (the tiny random Llama of tests/toy.py, hidden 128; SmolLM2-135M-Instruct) and backend (vllm, hf), the
trainer is built as `esbatch train` builds it (GRPOTrainer.setup: DeepSpeed, world size 1, ZeRO 2; the generator
from BACKENDS.get(backend.name).for_policy) on the quickstart's arithmetic task (0-shot, --batch prompts x --group
responses, --tokens tokens, --temperature 0.7; at 0.01 both backends sample the argmax tokens, nearly always, so
the train phase does the same work). One untimed step, then --steps steps, each split as the trainer
logs it: rollout (time/generation_s), weight load into the engine before it (time/weight_sync_s; nothing to load
for hf, which generates from the trained module) and training (time/train_s: forward/backward and the optimizer
step); medians. "setup" is GRPOTrainer.setup (with vllm: the engine start and first load). Last, the weight load
alone (VLLMPolicy.load_policy of every tensor: cast, handed over as tensors in process or packed into the RPC,
copied into the engine's views, prefix cache reset, sampled coordinates checked), median of 5, per model size,
in GB/s (2^30 bytes). Each (model, backend) runs in a process of its own (--rounds R: R processes each, in turn,
their steps pooled; the step ratio gets a 95% bootstrap interval over the steps); the tables come last.

--malloc picks the measured processes' allocator. keep (the default, as `esbatch train` runs on CPU:
run.keep_freed_memory, esbatch/train/memory.py): glibc keeps freed blocks under 1 GiB in the process. glibc (its
defaults, run.keep_freed_memory: false): every freed block over 32 MB goes back to the kernel, so each training step
faults its activations in again (3.2M page faults per step at B=8 x G=8); on a VM that reports free pages to its host
(this one: page_reporting) a fault's cost varies with the process's footprint, and the larger process, the one beside
an engine, paid more. tcmalloc: LD_PRELOADed (Debian's libtcmalloc-minimal4), which keeps freed memory too.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_dir(name: str, tmp: str) -> str:
    if name == "smollm2":
        return "smollm2-135m-instruct"
    if name != "tiny":  # an alias, folder or hub id (scripts/gpu_check.py passes its --model)
        return name
    sys.path.insert(0, str(ROOT / "tests"))
    from toy import make_tiny_model

    return str(make_tiny_model(Path(tmp) / name, hidden=128, heads=2))


BACKENDS = {"vllm": ("vllm", "in_process"), "vllm-separate": ("vllm", "separate"), "hf": ("hf", None)}


def trainer(model: str, backend: str, args: argparse.Namespace) -> Any:
    from esbatch.config import load_config

    sets = {
        "algorithm": "grpo",
        "model.name": model,
        "model.dtype": args.dtype,
        "model.device": args.device,
        "run.threads": args.threads,
        "task.heldout_size": 0,
        "task.few_shot": 0,
        "tracking.drift": "false",
        "generation.max_new_tokens": args.tokens,
        "generation.temperature": args.temperature,
        "grpo.group_size": args.group,
        "grpo.batch_size": args.batch,
        "grpo.updates": 100,
        "backend.name": BACKENDS[backend][0],
        **({"backend.policy_engine": BACKENDS[backend][1]} if BACKENDS[backend][1] else {}),
        "backend.kv_cache_gb": 1,
        "backend.max_model_len": 256,
        **({"backend.gpu_memory_utilization": 0.3} if args.device == "cuda" else {}),  # DeepSpeed shares the GPU
    }
    return build(load_config("quickstart", [f"{k}={v}" for k, v in sets.items()]), args.device)


def build(cfg: Any, device: str) -> Any:
    """A GRPO trainer of run config ``cfg`` set up as `esbatch train` sets it up, in a scratch run folder."""
    from esbatch.grpo.trainer import GRPOTrainer
    from esbatch.train.ranks import Ranks
    from esbatch.train.rundir import RunDir

    tr = GRPOTrainer(cfg, RunDir(tempfile.mkdtemp()), Ranks(), device)
    tr.setup()
    return tr


def step_parts(tr: Any, steps: int) -> dict[str, float]:
    """One untimed step (t=0), then ``steps`` timed ones: medians of rollout, load, train (the trainer's own
    split) and "wall", the whole step as the caller waits for it (scoring, drift and the rest included)."""
    tr.step(0)
    parts: dict[str, list[float]] = {"rollout": [], "load": [], "train": [], "wall": []}
    for t in range(1, steps + 1):
        t0 = time.perf_counter()
        m = tr.step(t)["metrics"]
        parts["wall"].append(time.perf_counter() - t0)
        parts["rollout"].append(m["time/generation_s"])
        parts["load"].append(m["time/weight_sync_s"])
        parts["train"].append(m["time/train_s"])
    return {**{k: statistics.median(v) for k, v in parts.items()}, "per_step": parts}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (model, backend)'s processes (--rounds of them) as one: medians over all their timed steps."""
    steps = {k: [x for r in runs for x in r["per_step"][k]] for k in ("rollout", "load", "train", "wall")}
    out: dict[str, Any] = {k: statistics.median(v) for k, v in steps.items()}
    out["per_step"] = steps
    for k in ("setup_s", "mb", "load_only", "rss_gb"):
        if k in runs[0]:
            out[k] = statistics.median(r[k] for r in runs)
    return out


def ratio_interval(a: dict[str, Any], b: dict[str, Any], n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of median step (rollout + load + train) of ``a`` over ``b``'s: each side's timed
    steps resampled with replacement (seed 0). Steps of one process are not independent (the same engine, the same
    memory layout): --rounds > 1 spreads them over processes."""
    import random

    rng = random.Random(0)

    def steps(r: dict[str, Any]) -> list[float]:
        p = r["per_step"]
        return [x + y + z for x, y, z in zip(p["rollout"], p["load"], p["train"])]

    sa, sb = steps(a), steps(b)
    ratios = sorted(
        statistics.median(rng.choices(sa, k=len(sa))) / statistics.median(rng.choices(sb, k=len(sb))) for _ in range(n)
    )
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def split(model: str, backend: str, args: argparse.Namespace) -> dict[str, float]:
    """Medians of one GRPO step's parts over --steps steps (after an untimed one), and the setup time."""
    t0 = time.perf_counter()
    tr = trainer(model, backend, args)
    out = {"setup_s": time.perf_counter() - t0}
    try:
        out.update(step_parts(tr, args.steps))
        if backend != "hf":
            params = list(tr.engine.module.named_parameters())
            out["mb"] = sum(p.numel() * p.element_size() for _, p in params) / 2**20
            times = []
            for _ in range(5):
                t1 = time.perf_counter()
                tr.gen.load_policy(params)
                times.append(time.perf_counter() - t1)
            out["load_only"] = statistics.median(times)
    finally:
        tr.close()
    out["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak
    return out


TCMALLOC = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4"]


def preload(malloc: str) -> None:
    """--malloc tcmalloc: run this process again (same pid, same arguments) with tcmalloc LD_PRELOADed, unless it
    already is; its subprocesses inherit it. Debian's libtcmalloc-minimal4 (apt-get install libtcmalloc-minimal4)."""
    if malloc != "tcmalloc" or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = next((p for p in TCMALLOC if Path(p).exists()), None)
    if lib is None:
        sys.exit(f"--malloc tcmalloc: none of {', '.join(TCMALLOC)} exists; apt-get install libtcmalloc-minimal4")
    env = {**os.environ, "LD_PRELOAD": ":".join(filter(None, [lib, os.environ.get("LD_PRELOAD")]))}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], help="tiny, smollm2, or a model alias/dir")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", help="also write the figures here (scripts/gpu_check.py reads them)")
    ap.add_argument("--steps", type=int, default=2, help="timed GRPO steps per (model, backend)")
    ap.add_argument("--batch", type=int, default=2, help="grpo.batch_size B (prompts per step)")
    ap.add_argument("--group", type=int, default=4, help="grpo.group_size G")
    ap.add_argument("--tokens", type=int, default=16, help="generation.max_new_tokens")
    ap.add_argument("--temperature", type=float, default=0.7, help="generation.temperature (> 0: G samples per prompt)")
    ap.add_argument("--threads", type=int, default=2, help="run.threads (torch threads of the trainer)")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument(
        "--rounds", type=int, default=1, help="processes per (model, backend), run in turn (vllm, hf, vllm, hf, ...)"
    )
    ap.add_argument(
        "--malloc",
        choices=["keep", "glibc", "tcmalloc"],
        default="keep",
        help="the measured processes' allocator: keep (esbatch's default on CPU), glibc's defaults, or tcmalloc "
        "LD_PRELOADed (docstring)",
    )
    args = ap.parse_args()
    preload(args.malloc)

    import json
    import subprocess

    res: dict[tuple[str, str], dict[str, Any]] = {}
    if len(args.models) * len(args.backends) * args.rounds > 1:  # each in a process of its own: an engine in the
        # trainer's process binds its threads (vLLM's CPU worker), which would slow whatever the process measured next
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.rounds):
                for name in args.models:
                    for backend in args.backends:
                        out = Path(tmp) / "one.json"
                        cmd = [sys.executable, __file__, "--models", name, "--backends", backend, "--json", str(out)]
                        for flag in ("device", "dtype", "steps", "batch", "group", "tokens", "temperature", "threads"):
                            cmd += [f"--{flag}", str(getattr(args, flag))]
                        cmd += ["--malloc", args.malloc]
                        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                        (r,) = json.loads(out.read_text())
                        runs.setdefault((name, backend), []).append(r)
        res = {k: pooled(v) for k, v in runs.items()}
    else:
        import torch

        from esbatch.grpo.trainer import init_distributed

        if args.malloc == "keep" and args.device == "cpu":  # as esbatch train does (RunSession)
            from esbatch.train.memory import keep_freed_memory

            if refused := keep_freed_memory():
                print(f"--malloc keep: {refused}", file=sys.stderr)

        init_distributed(args.device)
        with tempfile.TemporaryDirectory() as tmp:
            (name,), (backend,) = args.models, args.backends
            res[name, backend] = split(model_dir(name, tmp), backend, args)
        torch.distributed.destroy_process_group()
    for (name, backend), r in res.items():
        print(f"  {name} {backend}: { {k: v for k, v in r.items() if k != 'per_step'} }", file=sys.stderr, flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps([{"model": n, "backend": b, **r} for (n, b), r in res.items()]))
    shape = f"B={args.batch} x G={args.group}, {args.tokens} tokens at T={args.temperature}, {args.dtype}, "
    shape += f"{args.threads} threads, malloc {args.malloc}"
    steps = f"{args.steps} steps" + (f" in each of {args.rounds} processes" if args.rounds > 1 else "")
    print(f"\nGRPO step split (s, median of {steps}; {shape})")
    head = f"{'model':<9}{'rollouts':<14}{'rollout':>9}{'load':>8}{'train':>8}{'step':>8}{'/ hf':>7}"
    print(head + f"  {'95% CI':<14}{'setup':>6}{'peak GB':>8}")
    for (name, backend), r in res.items():
        step = r["rollout"] + r["load"] + r["train"]
        hf = res.get((name, "hf"))
        ratio = step / (hf["rollout"] + hf["load"] + hf["train"]) if hf else float("nan")
        ci = "{:.2f}-{:.2f}".format(*ratio_interval(r, hf)) if hf and backend != "hf" and "per_step" in r else ""
        row = f"{name:<9}{backend:<14}{r['rollout']:>9.3f}{r['load']:>8.3f}{r['train']:>8.3f}{step:>8.3f}{ratio:>7.2f}"
        print(row + f"  {ci:<14}{r['setup_s']:>6.1f}{r['rss_gb']:>8.1f}")
    print("\nweight load into the vLLM engine (all tensors, median of 5)")
    print(f"{'model':<9}{'engine':<14}{'MB':>9}{'load s':>9}{'GB/s':>8}")
    for (name, backend), r in res.items():
        if backend != "hf":
            print(f"{name:<9}{backend:<14}{r['mb']:>9.1f}{r['load_only']:>9.4f}{r['mb'] / 1024 / r['load_only']:>8.2f}")


if __name__ == "__main__":
    main()
