"""GPU check for a fresh cluster node or container image, in under 8 minutes, ending in one table.

    apptainer exec --nv esbatch.sif python scripts/gpu_check.py    # from a checkout of this repository

1. benchmarks/es_kernels.py: copy bandwidth; noise throughput (philox-gauss, philox-rademacher, torch.randn)
   against the rate fp32 can be written; one perturb, restore and update (N=8) through CenteredWeights on the
   model's parameters against the least bytes each must move at that bandwidth; peak device memory of ES
   (fp32 master, perturb + generate + restore + update) against inference alone, and with es.master: host
   (the fp32 center in pinned host memory) against inference + 2 B/param;
2. ES noise (docs/noise.md): every tensor of the model drawn on the GPU and on the CPU (C kernel) for both
   philox generators and two seeds, compared bit for bit;
3. a short ES run (3 updates) through `esbatch train` with the HF backend in bfloat16 (the live weights bf16,
   the center an fp32 master copy, so small updates are not rounded away), and the same with the vLLM backend
   when vllm is importable;
4. benchmarks/backends.py: the ES overhead ratio (ES update time / time to generate the same rollouts with
   fixed weights), split into generation / perturb+restore / update, for each backend;
5. with vLLM: benchmarks/eval_backends.py, evaluation tokens/s on vLLM against HF at equal work,
   benchmarks/grpo_step_split.py, a GRPO step (rollout, weight load, training) with vLLM rollouts against HF's,
   and the GRPO weight sync into a separate engine (backend.policy_engine: separate) by each transport
   (backend.weight_transfer: rpc, bytes through collective_rpc; ipc, vLLM's weight-transfer API with CUDA IPC
   handles, esbatch/backends/weight_transfer.py), in GB/s; the ipc row is that path's first run on a GPU.
Then one markdown table: quantity | measured | bound / reference | ratio | ok. Rows marked ok or FAILED are
judged (a step that fails, noise that differs, ES memory above inference + its state + workspace); speed rows
are "info": figures against their bound, which never fail the check. Exits 2 without CUDA, 1 when a row failed.
Its output saved (`... | tee gpu-check.txt`) gives the cost plan of `esbatch sweep --throughput gpu-check.txt` each
backend's measured generation rate on this GPU (esbatch/launch/throughput.py).

`--device cpu --model DIR` runs step 1 and the table on the CPU (steps 2-4 marked n/a), so this code path
runs without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.es_kernels import KernelReport, Row, markdown  # noqa: E402


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """The command's output, or None when it ran past ``timeout`` seconds."""
    print("$ " + " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout:.0f} s", flush=True)
        return None


def tail(p: subprocess.CompletedProcess | None, lines: int = 6) -> str:
    return "" if p is None else "\n".join((p.stdout + p.stderr).strip().splitlines()[-lines:])


def failure(p: subprocess.CompletedProcess | None, timeout: float) -> str:
    return f"FAILED: timed out after {timeout:.0f} s" if p is None else f"FAILED: exit {p.returncode}"


def noise_identity(model: str, device: str, seeds: tuple[int, ...] = (0, 2**32 - 1)) -> tuple[int, int, list[str]]:
    """(tensors compared, elements compared, names that differ): eps of every parameter of ``model`` drawn on
    ``device`` against the same draw on the CPU, for each philox generator and seed. Shapes come from the model's
    config on the meta device, so no weights are loaded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from esbatch.models import model_path
    from esbatch.perturb.noise import direction

    path, revision = model_path(model)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, revision=revision))
    tensors = elements = 0
    bad = []
    for name, p in net.named_parameters():
        for noise in ("philox-gauss", "philox-rademacher"):
            for seed in seeds:
                here = direction(seed, name, p.shape, noise, device)
                if not torch.equal(here.cpu(), direction(seed, name, p.shape, noise, "cpu")):
                    bad.append(f"{name} ({noise}, seed {seed})")
                tensors += 1
                elements += p.numel()
    return tensors, elements, bad


def kernel_rows(args: argparse.Namespace, tmp: Path, timeout: float) -> list[Row]:
    """Step 1 in its own process (its memory high-water mark and compiled kernels stay out of this one)."""
    out = tmp / "kernels.json"
    cmd = [sys.executable, "benchmarks/es_kernels.py", "--device", args.device, "--dtype", args.dtype]
    cmd += ["--model", args.model, "--json", str(out)]
    if args.device == "cpu":  # a few seconds for a small model; minutes for SmolLM2 on 2 cores
        cmd += ["--repeat", "3", "--batch", "4", "--tokens", "16", "--copy-log2n", "24"]
    else:
        cmd += ["--repeat", "5", "--batch", "16", "--tokens", "128"]
    p = run(cmd, timeout)
    if p is None or not out.exists():
        print(tail(p, 20))
        return [Row("ES kernels (benchmarks/es_kernels.py)", "not measured", status=failure(p, timeout))]
    print(p.stdout.strip().splitlines()[0])  # its table is part of the final one
    return KernelReport(**json.loads(out.read_text())).rows()


def es_run_row(args: argparse.Namespace, backend: str, tmp: Path, timeout: float) -> Row:
    """3 ES updates through `esbatch train` on this backend; the last update's figures."""
    sets = [
        f"model.name={args.model}",
        "model.device=cuda",
        f"model.dtype={args.dtype}",
        f"backend.name={backend}",
        "es.updates=3",
        "es.population_size=8",
        "es.batch_size=16",
        "generation.max_new_tokens=128",
        "task.heldout_size=16",
        "eval.every=0",
        f"run.output_dir={tmp}",
        f"run.name=gpu-check-{backend}",
        "backend.gpu_memory_utilization=0.4",
    ]
    cmd = [sys.executable, "-m", "esbatch", "train", "quickstart", "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    p = run(cmd, timeout)
    print(tail(p))
    what = f"3 ES updates, {backend} backend, {args.dtype} (fp32 master)"
    log = tmp / f"gpu-check-{backend}" / "log.jsonl"
    measured = "no log"
    if log.exists() and (lines := log.read_text().splitlines()):
        m = json.loads(lines[-1])["metrics"]
        measured = (
            f"last update: reward {m['reward/mean']:.3f}, {m['tokens/per_s']:.0f} tok/s, changed "
            f"{m['update/changed_fraction']:.4f} of live weights, {m['time/total_s']:.1f} s"
        )
    ok = p is not None and p.returncode == 0
    return Row(what, measured, "exits 0", status="ok" if ok else failure(p, timeout))


def overhead_rows(args: argparse.Namespace, backends: list[str], tmp: Path, timeout: float) -> list[Row]:
    """benchmarks/backends.py: the ES overhead ratio of each backend, N=8 x B=32, 128 new tokens."""
    out = tmp / "backends.json"
    cmd = [sys.executable, "benchmarks/backends.py", "--device", "cuda", "--dtype", args.dtype, "--model", args.model]
    cmd += ["--n", "8", "--batch", "32", "--tokens", "128", "--backends", ",".join(backends), "--json", str(out)]
    p = run(cmd, timeout)
    print("" if p is None else p.stdout[-4000:])
    got = {r["backend"]: r for r in json.loads(out.read_text())} if out.exists() else {}
    rows = []
    for name in backends:
        what = f"ES overhead ratio, {name} (N=8, B=32, 128 tokens)"
        if name not in got:
            rows.append(Row(what, "not measured", status=failure(p, timeout) if p is None else "FAILED: no result"))
            continue
        r = got[name]
        rows.append(
            Row(
                what,
                f"ES update {r['es_update_s']:.1f} s = generation {r['es_generation_s']:.1f} + perturb/restore "
                f"{r['es_perturb_restore_s']:.2f} + update {r['es_update_only_s']:.2f}",
                f"same rollouts, fixed weights: {r['pure_generation_s']:.1f} s ({r['tokens_per_s']:.0f} tok/s)",
                r["overhead_ratio"],
            )
        )
    return rows


def eval_rows(args: argparse.Namespace, tmp: Path, timeout: float) -> list[Row]:
    """benchmarks/eval_backends.py: evaluation tokens/s (n samples per prompt with the token entropy, as `esbatch
    eval` generates) on HF and on vLLM at equal work, and their ratio."""
    out = tmp / "eval_backends.json"
    cmd = [sys.executable, "benchmarks/eval_backends.py", "--model", args.model, "--dtype", args.dtype]
    cmd += ["--prompts", "32", "--n", "8", "--tokens", "256", "--json", str(out)]
    p = run(cmd, timeout)
    print(tail(p, 12))
    what = "eval generation, vLLM vs HF (32 prompts x 8 samples, 256 tokens, entropy on)"
    if not out.exists():
        return [Row(what, "not measured", status=failure(p, timeout) if p is None or p.returncode else "FAILED")]
    r = json.loads(out.read_text())
    best = {n: max(r[n]["tokens_per_s"]) for n in ("hf", "vllm")}
    measured = f"vllm {best['vllm']:.0f} tok/s, hf {best['hf']:.0f} tok/s (best of rounds)"
    return [Row(what, measured, "vllm / hf", best["vllm"] / best["hf"])]


def grpo_rows(args: argparse.Namespace, tmp: Path, timeout: float) -> list[Row]:
    """benchmarks/grpo_step_split.py: a GRPO step (B=8 x G=8, 256 tokens) split into rollout, weight load into the
    engine and training, vLLM rollouts against HF's."""
    out = tmp / "grpo_split.json"
    cmd = [sys.executable, "benchmarks/grpo_step_split.py", "--models", args.model, "--device", "cuda"]
    cmd += ["--dtype", args.dtype, "--batch", "8", "--group", "8", "--tokens", "256", "--json", str(out)]
    cmd += ["--backends", "vllm", "hf"]  # the separate engine's syncs: sync_rows, by transport
    p = run(cmd, timeout)
    print(tail(p, 12))
    what = "GRPO step, vLLM rollouts vs HF (B=8 x G=8, 256 tokens)"
    if not out.exists():
        return [Row(what, "not measured", status=failure(p, timeout) if p is None or p.returncode else "FAILED")]
    got = {r["backend"]: r for r in json.loads(out.read_text())}
    step = {b: r["rollout"] + r["load"] + r["train"] for b, r in got.items()}
    v = got["vllm"]
    measured = (
        f"vllm (engine in process): rollout {v['rollout']:.2f} + load {v['load']:.2f} + train {v['train']:.2f} s; "
        f"hf: rollout {got['hf']['rollout']:.2f} + train {got['hf']['train']:.2f} s"
    )
    rows = [Row(what, measured, "hf step / vllm step", step["hf"] / step["vllm"])]
    if "vllm" in got:  # the weight sync alone: every tensor, bucketed, copied in and checked (median of 5)
        r = got["vllm"]
        gbs = r["mb"] / 1024 / r["load_only"]
        rows.append(
            Row(
                "GRPO weight sync, engine in the trainer's process",
                f"{r['mb']:.0f} MB in {r['load_only']:.3f} s",
                "GB/s",
                gbs,
            )
        )
    return rows


SYNC_TRANSPORTS = {"rpc": "bytes through collective_rpc", "ipc": "vLLM's weight-transfer API, CUDA IPC"}


def sync_probe(model: str, dtype: str, transport: str, out: Path) -> None:
    """(--sync-probe, in a process of its own) A GRPO policy engine in its own process (VLLMPolicy, policy_engine
    separate) loaded with the model's weights on the GPU through ``transport``: one untimed sync, then 5 timed
    (cast, buckets, the transfer, prefix cache reset, sampled coordinates checked); the median to ``out``."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    from esbatch.backends.vllm_policy import VLLMPolicy
    from esbatch.models import model_path

    path, rev = model_path(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: rpc only, to try the probe itself
    net = AutoModelForCausalLM.from_pretrained(path, revision=rev, torch_dtype=getattr(torch, dtype)).to(device)
    params = list(net.named_parameters())
    gen = VLLMPolicy(
        path,
        revision=rev,
        dtype=dtype,
        in_process=False,
        weight_transfer=transport,
        gpu_memory_utilization=0.3,
        kv_cache_gb=1,
        max_model_len=256,
        rpc_timeout_s=120,
    )
    try:
        gen.load_policy(params)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            gen.load_policy(params)
            times.append(time.perf_counter() - t0)
        sync = {"mb": gen.last_sync["bytes"] / 2**20, "buckets": gen.last_sync["buckets"]}
        out.write_text(json.dumps({"transport": transport, "load_only": statistics.median(times), **sync}))
    finally:
        gen.close()


def sync_rows(args: argparse.Namespace, tmp: Path, timeout: float) -> list[Row]:
    """The GRPO weight sync into a separate engine by each backend.weight_transfer, each in a process of its own
    (sync_probe): GB/s (2^30 bytes) of the whole sync."""
    rows = []
    for i, (transport, how) in enumerate(SYNC_TRANSPORTS.items()):
        out, limit = tmp / f"sync_{transport}.json", timeout / (len(SYNC_TRANSPORTS) - i)
        cmd = [sys.executable, "scripts/gpu_check.py", "--sync-probe", transport, "--model", args.model]
        t0 = time.time()
        p = run(cmd + ["--dtype", args.dtype, "--json", str(out)], limit)
        timeout -= time.time() - t0
        what = f"GRPO weight sync, engine in its own process, {transport} ({how})"
        if not out.exists():
            print(tail(p, 20))
            rows.append(Row(what, "not measured", status=failure(p, limit) if p is None or p.returncode else "FAILED"))
            continue
        r = json.loads(out.read_text())
        measured = f"{r['mb']:.0f} MB in {r['load_only']:.3f} s ({r['buckets']} buckets)"
        rows.append(Row(what, measured, "GB/s", r["mb"] / 1024 / r["load_only"]))
    return rows


def identity_row(model: str) -> Row:
    what = "ES noise, CUDA vs CPU kernel, every tensor (2 philox generators x 2 seeds)"
    import torch

    tensors, elements, bad = noise_identity(model, "cuda")
    torch.cuda.empty_cache()  # the largest draws' blocks, before the ES runs start their own processes
    measured = f"{tensors} tensor draws, {elements / 1e9:.2f}G elements, {len(bad)} differ"
    return Row(what, measured, "bit-identical", status="ok" if not bad else f"FAILED: {', '.join(bad[:3])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m-instruct", help="alias, HF dir or hub id (e.g. qwen2.5-0.5b-instruct)"
    )
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: step 1 and the table only")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--sync-probe", choices=list(SYNC_TRANSPORTS), help=argparse.SUPPRESS)  # sync_rows' process
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.sync_probe:
        sync_probe(args.model, args.dtype, args.sync_probe, Path(args.json))
        return 0
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: torch sees no CUDA device (use --nv with apptainer, --gpus all with docker)", file=sys.stderr)
        return 2
    where = f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if cuda else "CPU (--device cpu)"
    print(f"{where}, torch {torch.__version__}, model {args.model}, {args.dtype}")
    backends = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    start = time.time()
    left: Callable[[], float] = lambda: max(10.0, args.budget - (time.time() - start))  # noqa: E731
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rows += kernel_rows(args, tmp, 0.3 * left())
        if cuda:
            t0 = time.time()
            rows.append(identity_row(args.model))
            print(f"noise identity: {rows[-1].measured} ({time.time() - t0:.0f} s)")
            for i, name in enumerate(backends):
                rows.append(es_run_row(args, name, tmp, left() / (len(backends) - i + 1)))
            rows += overhead_rows(args, backends, tmp, left())
            if "vllm" in backends:
                rows += eval_rows(args, tmp, left() / 3)
                rows += grpo_rows(args, tmp, left() / 2)
                rows += sync_rows(args, tmp, left())
        else:
            skipped = "n/a: --device cpu"
            rows.append(Row("ES noise, CUDA vs CPU kernel, every tensor", "not run", status="n/a: no CUDA"))
            rows.append(Row("3 ES updates through esbatch train", "not run", status=skipped))
            rows.append(Row("ES overhead ratio (benchmarks/backends.py)", "not run", status=skipped))
            rows.append(Row("eval generation, vLLM vs HF (benchmarks/eval_backends.py)", "not run", status=skipped))
            rows.append(Row("GRPO step, vLLM vs HF (benchmarks/grpo_step_split.py)", "not run", status=skipped))
    ok = not any(r.failed for r in rows)
    print(f"\n## GPU check: {where}, {args.model}, {args.dtype}\n")
    print(markdown(rows))
    print(f"\ngpu check {'passed' if ok else 'FAILED'} in {time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
