"""vLLM's multi-LoRA route for a low-rank ES population, measured against pure batched inference on the same engine
(issue 16 asks for whichever of it and the worker-extension hooks measures faster and stays exact).

Each member i becomes a LoRA adapter of rank r on every linear layer of every block (q, k, v, o, gate, up, down):
lora_B = s A_i / sqrt(r) and lora_A = B_i^T, drawn as the low-rank ES directions are (LowRankWeights.population),
so x (W + lora_B lora_A)^T is the member's linear output. Per population the adapters are written to a temporary
folder (PEFT layout) and every request carries its member's LoRARequest (new adapter ids, so the engine loads
them, as each new population would). Timed: writing + loading + generating the N x B rollouts, against plain
generation of the same N x B prompts on the same engine, alternated --repeats times (medians).

Not the same algorithm as es.perturbation: lowrank, so this is a throughput figure only: the LoRA route cannot
perturb the embedding, the tied head or the norm weights (docs/lowrank.md, "In vLLM").

    .venv-vllm/bin/python benchmarks/vllm_lora_route.py [--n 8,32] [--ranks 1,4] [--tokens 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(folder: Path, weights, members: list[tuple[int, float]], rank: int, base: str) -> list[str]:
    """One PEFT adapter folder per member; lora_alpha = r, so vLLM's scaling (alpha / r) is 1."""
    from safetensors.torch import save_file

    mats, _ = weights.population(members)
    paths = []
    for i in range(len(members)):
        tensors = {}
        for name, (a, b) in mats.items():
            if name.split(".")[-2] not in TARGETS:
                continue
            stem = "base_model.model." + name.removesuffix(".weight")
            tensors[f"{stem}.lora_A.weight"] = b[i].T.contiguous()  # (r, in)
            tensors[f"{stem}.lora_B.weight"] = a[i].contiguous()  # (out, r): s A / sqrt(r)
        path = folder / f"member{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": TARGETS, "bias": "none"}
        config |= {"task_type": "CAUSAL_LM", "base_model_name_or_path": base}
        (path / "adapter_config.json").write_text(json.dumps(config))
        paths.append(str(path))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="8,32")
    ap.add_argument("--ranks", default="1,4")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # as benchmarks/lowrank.py's engines (kv_cache_gb=2)
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from benchmarks.lowrank import chat_prompts, population
    from esbatch.backends.vllm import VLLMBackend
    from esbatch.models import model_path
    from esbatch.perturb.lowrank import LowRankWeights

    path = model_path("smollm2-135m-instruct")[0]
    prompts = chat_prompts(AutoTokenizer.from_pretrained(path), args.batch)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    next_id, rows = 1, []
    for r in [int(x) for x in args.ranks.split(",")]:
        weights = LowRankWeights(dict(hf.named_parameters()), track_drift=False, rank=r, vectors="frozen")
        for n in [int(x) for x in args.n.split(",")]:
            llm = LLM(
                model=path, dtype="float32", enforce_eager=True, enable_lora=True, max_loras=n, max_cpu_loras=n,
                max_lora_rank=1 if r == 1 else 8, max_model_len=1024, enable_prefix_caching=False, seed=0,
                **VLLMBackend._whole_prompts(path, None, 1024),  # the esbatch engines' CPU scheduling
            )  # fmt: skip
            sampling = [
                SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=j)
                for j in range(n * args.batch)
            ]
            members = [(seed, scale) for seed, scale, _ in population(n)]
            llm.generate(prompts, sampling[: len(prompts)], use_tqdm=False)  # warm-up
            with tempfile.TemporaryDirectory() as tmp:  # the adapters are applied: a large member changes greedy text
                greedy = SamplingParams(temperature=0.0, max_tokens=8)
                (big,) = write_adapters(Path(tmp), weights, [(members[0][0], 0.5)], r, path)
                base = llm.generate(prompts, greedy, use_tqdm=False)
                moved = llm.generate(prompts, greedy, lora_request=LoRARequest("big", next_id, big), use_tqdm=False)
                next_id += 1
                if [o.outputs[0].token_ids for o in base] == [o.outputs[0].token_ids for o in moved]:
                    raise RuntimeError("the LoRA adapters have no effect: check their tensor names")
            inf, pop = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = llm.generate(prompts * n, sampling, use_tqdm=False)
                inf.append(time.perf_counter() - t0)
                assert sum(len(c.token_ids) for o in outs for c in o.outputs) == n * args.batch * args.tokens
                with tempfile.TemporaryDirectory() as tmp:
                    t0 = time.perf_counter()
                    paths = write_adapters(Path(tmp), weights, members, r, path)
                    loras = [LoRARequest(f"m{next_id + i}", next_id + i, p) for i, p in enumerate(paths)]
                    next_id += n
                    requests = [loras[i] for i in range(n) for _ in prompts]
                    outs = llm.generate(prompts * n, sampling, lora_request=requests, use_tqdm=False)
                    pop.append(time.perf_counter() - t0)
                assert sum(len(c.token_ids) for o in outs for c in o.outputs) == n * args.batch * args.tokens
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            rows.append((n, r, med(inf), med(pop), [round(i / p, 3) for i, p in zip(inf, pop)]))
            print(f"N={n} r={r}: inference {med(inf):.2f} s, LoRA population {med(pop):.2f} s", flush=True)
            llm.llm_engine.engine_core.shutdown()
    print(f"# vLLM multi-LoRA route, SmolLM2 fp32, B={args.batch}, {args.tokens} tokens/rollout, eager")
    print("N   r  inference s  LoRA population s  LoRA / inference (throughput)  pairs")
    for n, r, i, p, pairs in rows:
        print(f"{n:<3d} {r:<2d} {i:11.2f}  {p:17.2f}  {i / p:29.2f}  {pairs}")


if __name__ == "__main__":
    main()
