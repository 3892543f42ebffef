"""GPU check for a fresh cluster node or container image, in under 5 minutes.

    apptainer exec --nv esbatch.sif python scripts/gpu_check.py    # from a checkout of this repository

1. a short ES run (3 updates) through `esbatch train` with the HF backend in bfloat16: the live weights are
   bf16, the center an fp32 master copy (HFBackend.master), so small updates are not rounded away;
2. the same with the vLLM backend when vllm is importable;
3. benchmarks/backends.py on the GPU: rollout tokens/s and the ES overhead ratio (ES update time / time to
   generate the same rollouts without perturbation) for each backend, side by side;
4. ES noise (docs/noise.md): every tensor of the model drawn on the GPU and on the CPU (C kernel) for both
   philox generators, compared bit for bit, and benchmarks/noise.py (elements/s vs torch.randn, bytes/s vs
   copy_ on each device).
Exits non-zero when there is no NVIDIA GPU or a step fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m-instruct", help="alias, HF dir or hub id (e.g. qwen2.5-0.5b-instruct)"
    )
    ap.add_argument("--budget", type=float, default=280.0, help="seconds for the whole check")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("error: torch sees no CUDA device (use --nv with apptainer, --gpus all with docker)", file=sys.stderr)
        return 2
    print(f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}")
    backends = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    start = time.time()
    left = lambda: max(10.0, args.budget - (time.time() - start))  # noqa: E731
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name in backends:
            sets = [
                f"model.name={args.model}",
                "model.device=cuda",
                "model.dtype=bfloat16",
                f"backend.name={name}",
                "es.updates=3",
                "es.population_size=8",
                "es.batch_size=16",
                "generation.max_new_tokens=128",
                "task.heldout_size=16",
                "eval.every=0",
                f"run.output_dir={tmp}",
                f"run.name=gpu-check-{name}",
                "backend.gpu_memory_utilization=0.4",
            ]
            cmd = [sys.executable, "-m", "esbatch", "train", "quickstart", "--no-progress"]
            for s in sets:
                cmd += ["--set", s]
            p = run(cmd, left() / 2)
            ok &= p.returncode == 0
            print(("ok: " if p.returncode == 0 else "FAILED: ") + f"3 ES updates with the {name} backend in bf16")
            print("\n".join((p.stdout + p.stderr).strip().splitlines()[-6:]))
            log = Path(tmp) / f"gpu-check-{name}" / "log.jsonl"
            if log.exists():
                for line in log.read_text().splitlines():
                    m = json.loads(line)["metrics"]
                    print(
                        f"  update: reward {m['reward/mean']:.3f}, {m['tokens/per_s']:.0f} tok/s, "
                        f"changed {m['update/changed_fraction']:.4f} of bf16 weights, {m['time/total_s']:.1f} s"
                    )
        p = run(
            [
                sys.executable,
                "benchmarks/backends.py",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--model",
                args.model,
                "--n",
                "8",
                "--batch",
                "32",
                "--tokens",
                "128",
                "--backends",
                ",".join(backends),
            ],
            left(),
        )
        print(p.stdout[-4000:])
        ok &= p.returncode == 0 and "| hf |" in p.stdout
    t0 = time.time()
    tensors, elements, bad = noise_identity(args.model, "cuda")
    ok &= not bad
    print(
        f"{'ok' if not bad else 'FAILED'}: ES noise on cuda vs cpu: {tensors} tensor draws, {elements / 1e9:.2f}G "
        f"elements, {len(bad)} differ {bad[:5]} ({time.time() - t0:.0f} s)"
    )
    p = run([sys.executable, "benchmarks/noise.py", "--log2n", "26", "--repeat", "5", "--threads", "1"], left())
    print(p.stdout[-3000:])
    ok &= p.returncode == 0
    print(f"gpu check {'passed' if ok else 'FAILED'} in {time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
