"""Peak memory of one ES update vs one GRPO step vs inference alone (SmolLM2-135M-Instruct, fp32, CPU).

    .venv/bin/python benchmarks/memory_es_vs_grpo.py --n 8 --g 8 --batch 8 --tokens 64 --threads 2 [--beta 0.04]
    .venv/bin/python benchmarks/memory_es_vs_grpo.py --batch 8 32 --micro-batch 8 --max-gb 16 [--phases es grpo]

Paper claim: ES needs about inference-level memory; GRPO adds gradients, optimizer state and activations.
Each phase runs in its own fresh subprocess (ru_maxrss is a per-process high-water mark) on the same B
prompts of the quickstart arithmetic task (the batch of update/step t = 0), with the same sampling settings:

  infer-es    the ES update's N x B rollouts (N generate calls of B prompts), fixed weights, no ES state
  es          one es_step: N x (perturb, generate, restore) + the update; tracking.drift false, i.e. the
              minimum (drift tracking adds an fp32 theta_0 copy, P*4 bytes, shown in the accounting)
  infer-grpo  the GRPO step's B x G rollouts (G samples per prompt, one batched call), fixed weights
  grpo        one GRPOTrainer.step on a DeepSpeed engine built as GRPOTrainer.setup builds it (world size 1, AdamW, ZeRO
              stage from the config), beta 0: no reference model; --micro-batch sets grpo.micro_batch_size (the
              forward/backward then holds that many sequences' activations at a time)
  grpo-ref    the same with beta = --beta: a frozen reference copy (only with --beta > 0)

Per phase: RSS right after the model is loaded (weights paged in), RSS just before the step (ES master copy,
DeepSpeed engine built), peak RSS, wall time of the step (or generation), generated tokens. Each training
phase is compared with the inference phase that generates the same rollouts. Children run under an
address-space limit (--max-gb, default 75% of available memory), so a phase that would exhaust a shared
machine fails with an allocation error instead.

Several --batch sizes run the phases once per size and end with a summary: GRPO step peak vs ES update peak
per B. --phases picks a subset (e.g. es grpo, to skip the inference baselines at a large B).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 2**20


def rss_now_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_cfg(args: argparse.Namespace, phase: str, beta: float = 0.0):
    from esbatch.config import load_config

    sets = {
        "algorithm": "grpo" if "grpo" in phase else "es",
        "model.dtype": "float32",
        "model.device": "cpu",
        "run.threads": args.threads,
        "task.heldout_size": 0,
        "tracking.drift": "false",
        "generation.max_new_tokens": args.tokens,
        "es.population_size": args.n,
        "es.batch_size": args.batch,
        "grpo.group_size": args.g,
        "grpo.batch_size": args.batch,
        "grpo.updates": 1,
        "grpo.beta": beta,
    }
    if args.micro_batch:
        sets["grpo.micro_batch_size"] = args.micro_batch
    return load_config("quickstart", [f"{k}={v}" for k, v in sets.items()])


def run_phase(args: argparse.Namespace) -> dict:
    """The child: load the model, build what the phase needs, run it once, report memory and time."""
    import torch

    from esbatch.backends import SamplingParams
    from esbatch.backends.hf import HFBackend, HFGenerator
    from esbatch.es.core import draw_population
    from esbatch.es.trainer import es_step
    from esbatch.grpo.trainer import _step_seed
    from esbatch.models import load_model_and_tokenizer
    from esbatch.train.problems import load_problems
    from esbatch.train.schedule import batch_indices

    torch.set_num_threads(args.threads)
    phase = args.phase
    cfg = make_cfg(args, phase, args.beta if phase == "grpo-ref" else 0.0)
    m, gen_cfg = cfg.model, cfg.generation
    model, tok = load_model_and_tokenizer(m.name, m.gguf_file, m.revision, m.dtype, m.device)
    with torch.no_grad():  # the weights may be memory-mapped: page them in so that "loaded" counts them
        for p in model.parameters():
            p.sum()
    sizes = [p.numel() for p in model.parameters()]
    out = {"phase": phase, "loaded_mb": rss_now_mb(), "params": sum(sizes), "largest": max(sizes)}
    sampling = SamplingParams(gen_cfg.temperature, gen_cfg.top_p, gen_cfg.max_new_tokens)
    probs = None
    try:
        if phase == "es":  # = HFBackend.for_es(cfg), split so that RSS can be read after the load
            backend = HFBackend(model, tok, batch_size=gen_cfg.batch_size, track_drift=cfg.tracking.drift)
            probs = load_problems(cfg, backend)
            out["ready_mb"], t0 = rss_now_mb(), time.perf_counter()
            tokens = es_step(cfg, backend, probs, 0)["metrics"]["tokens/generated"]
        elif phase.startswith("infer"):
            gen = HFGenerator(model, tok, batch_size=gen_cfg.batch_size)
            probs = load_problems(cfg, gen)
            _, idx = batch_indices(cfg.run.seed, 0, len(probs.train), args.batch)
            prompts = [probs.train_prompts[i] for i in idx]
            out["ready_mb"], t0 = rss_now_mb(), time.perf_counter()
            if phase == "infer-es":
                es = cfg.es
                members = draw_population(cfg.run.seed, 0, es.population_size, es.estimator, es.generation_seeds)
                gens = [g for mem in members for g in gen.generate(prompts, sampling, mem.gen_seed)]
            else:
                n_sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens, n=args.g)
                gens = gen.generate(prompts, n_sampling, _step_seed(cfg.run.seed, 0, 0))
            tokens = sum(g.n_tokens for g in gens)
        else:  # grpo / grpo-ref: GRPOTrainer.setup with world size 1, on the model loaded above
            import copy
            import tempfile

            import deepspeed

            from esbatch.grpo.trainer import GRPOTrainer, ds_config, init_distributed
            from esbatch.train.rundir import RunDir

            ranks = init_distributed("cpu")
            world = ranks.world
            ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.grpo.beta > 0 else None
            model.requires_grad_(True)
            engine, *_ = deepspeed.initialize(
                model=model,
                config=ds_config(cfg, world, False),
                model_parameters=[p for p in model.parameters() if p.requires_grad],
            )
            tr = GRPOTrainer(cfg, RunDir(tempfile.mkdtemp()), ranks, "cpu")
            tr.tok, tr.ref, tr.engine = tok, ref, engine
            tr.gen = HFGenerator(engine.module, tok, batch_size=gen_cfg.batch_size)
            tr.probs = probs = load_problems(cfg, tr.gen)
            out["ready_mb"], t0 = rss_now_mb(), time.perf_counter()
            met = tr.step(0)["metrics"]
            tokens = round(met["tokens/per_s"] * met["time/generation_s"])  # the step's sampled tokens
        out.update(step_s=time.perf_counter() - t0, tokens=tokens)
    except (RuntimeError, MemoryError) as e:  # most likely the --max-gb limit
        out["error"] = str(e).splitlines()[0].split("] ")[-1][:110]
    if "grpo" in phase and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo aborts at exit without it
    if probs is not None:
        _, idx = batch_indices(cfg.run.seed, 0, len(probs.train), args.batch)
        out["prompt_tokens"] = max(len(tok(probs.train_prompts[i], add_special_tokens=False)["input_ids"]) for i in idx)
    out["vocab"], out["peak_mb"] = model.config.vocab_size, peak_mb()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="ES population size N")
    ap.add_argument("--g", type=int, default=8, help="GRPO group size G")
    ap.add_argument(
        "--batch", type=int, nargs="+", default=[8], help="B: prompts per ES update / GRPO step (several: one run each)"
    )
    ap.add_argument("--micro-batch", type=int, default=None, help="grpo.micro_batch_size (default: none, one pass)")
    all_phases = ["infer-es", "es", "infer-grpo", "grpo", "grpo-ref"]
    ap.add_argument("--phases", nargs="+", choices=all_phases, help="run only these phases (default: all)")
    ap.add_argument("--tokens", type=int, default=64, help="generation.max_new_tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--beta", type=float, default=0.0, help="> 0: also run GRPO with a reference model")
    avail = int(next(ln for ln in open("/proc/meminfo") if ln.startswith("MemAvailable")).split()[1]) / 2**20
    ap.add_argument("--max-gb", type=float, default=round(0.75 * avail, 1), help="address-space limit per child")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        args.batch = args.batch[0]
        print(json.dumps(run_phase(args)))
        return
    sizes, summary = args.batch, []
    for b in sizes:
        args.batch = b
        t0 = time.perf_counter()
        res = run_all(args)
        summary.append((b, res, time.perf_counter() - t0))
    if len(sizes) > 1 or args.micro_batch:
        mb = args.micro_batch or "none (whole batch)"
        print(
            f"\nsummary: peak RSS MB, one ES update (N={args.n}) vs one GRPO step (G={args.g}, micro_batch_size {mb})"
        )
        print(f"{'B':>4}{'ES peak':>10}{'GRPO peak':>11}{'GRPO/ES':>9}{'wall s':>8}")
        for b, res, wall in summary:
            es, grpo = res.get("es", {}), res.get("grpo", {})
            e, g = es.get("peak_mb"), grpo.get("peak_mb")
            cell = lambda v, r: "-" if v is None else (f"{v:.0f}" + ("!" if "error" in r else ""))  # noqa: E731
            ratio = f"{g / e:.2f}" if e and g else "-"
            print(f"{b:>4}{cell(e, es):>10}{cell(g, grpo):>11}{ratio:>9}{wall:>8.0f}")
        print("! = the phase failed (e.g. at the address-space limit); its figure is the peak reached before")


def run_all(args: argparse.Namespace) -> dict:
    """Every phase for one B, each in a child process; prints the per-B table and returns the results."""

    def limit() -> None:
        lim = int(args.max_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))

    phases = ["infer-es", "es", "infer-grpo", "grpo"] + (["grpo-ref"] if args.beta > 0 else [])
    phases = [ph for ph in phases if not args.phases or ph in args.phases]
    res = {}
    for ph in phases:
        flags = [
            f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("n", "g", "batch", "tokens", "threads", "beta")
        ] + ([f"--micro-batch={args.micro_batch}"] if args.micro_batch else [])
        cmd = [sys.executable, __file__, "--phase", ph, *flags]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=limit)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        err = f"exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"
        res[ph] = json.loads(lines[-1]) if lines else {"phase": ph, "error": err}
        print(f"  {ph}: {res[ph]}", file=sys.stderr, flush=True)

    print(
        f"\nSmolLM2-135M-Instruct fp32 CPU, {args.threads} threads; ES N={args.n}, GRPO G={args.g}, "
        f"B={args.batch} prompts, {args.tokens} new tokens; child address-space limit {args.max_gb} GB"
        + (f"; GRPO micro_batch_size {args.micro_batch}" if args.micro_batch else "")
    )
    head = ("loaded", "ready", "peak MB", "+ over loaded", "x infer", "step s", "tokens")
    print(f"{'phase':<11}" + "".join(f"{h:>{n}}" for h, n in zip(head, (8, 8, 9, 15, 9, 8, 8))))
    base = {"infer-es": "infer-es", "es": "infer-es", "infer-grpo": "infer-grpo", "grpo": "infer-grpo"}
    for ph, r in res.items():
        if "peak_mb" not in r:
            print(f"{ph:<11}  failed: {r['error']}")
            continue
        b = res.get(base.get(ph, "infer-grpo"), {}).get("peak_mb")
        ratio = f"{r['peak_mb'] / b:.2f}" if b else "-"
        print(
            f"{ph:<11}{r['loaded_mb']:8.0f}{r.get('ready_mb', 0):8.0f}{r['peak_mb']:9.0f}"
            f"{r['peak_mb'] - r['loaded_mb']:15.0f}{ratio:>9}"
            + (f"{r['step_s']:8.1f}{r['tokens']:8}" if "error" not in r else f"  FAILED at this peak: {r['error']}")
        )
    print("x infer: peak / peak of the inference phase generating the same rollouts (infer-es or infer-grpo)")
    es, grpo = res.get("es", {}), res.get("grpo", {})
    if "peak_mb" in es and "peak_mb" in grpo:
        at_least = "> " if "error" in grpo else ""
        print(f"headline: GRPO step peak / ES update peak = {at_least}{grpo['peak_mb'] / es['peak_mb']:.2f}")

    ok = next((r for r in res.values() if "params" in r), None)
    if ok is None:
        return res
    P, w = ok["params"], ok["params"] * 4 / MB
    seqs, L = min(args.batch * args.g, args.micro_batch or args.batch * args.g), ok["prompt_tokens"] + args.tokens
    logits = seqs * (L - 1) * ok["vocab"] * 4 / MB
    print(f"\ntheory (P = {P / 1e6:.1f}M parameters, fp32): weights P*4 = {w:.0f} MB, in every phase")
    big = ok["largest"] * 24 / MB  # es_update per tensor: fp32 acc + eps, float64 copy + its square (for the norm)
    print(
        f"  ES extra   : fp32 master copy P*4 = {w:.0f} MB (+ theta_0 P*4 = {w:.0f} MB with tracking.drift on),\n"
        f"               + es_update transients on the largest tensor, up to 24 bytes/element = {big:.0f} MB"
    )
    print(
        f"  GRPO extra : gradients P*4 + AdamW 2*P*4 = {3 * w:.0f} MB, + DeepSpeed ZeRO-1/2 fp32 master partition "
        f"P*4 = {w:.0f} MB (kept even for an fp32 model), + reference P*4 = {w:.0f} MB when beta > 0,\n"
        f"               + activations of one forward over {seqs} sequences x <= {L} tokens "
        f"(the logits alone: {logits:.0f} MB per fp32 copy)"
    )
    if "peak_mb" in grpo and "error" not in grpo:
        act = grpo["peak_mb"] - grpo["loaded_mb"] - 4 * w
        print(f"  measured GRPO increase minus the {4 * w:.0f} MB of states = {act:.0f} MB (activations, buffers)")
    return res


if __name__ == "__main__":
    main()
