"""rq1-cpu's phases on the HF and vLLM backends, side by side in one run, and the whole sweep's projected wall time
on each (issue 30: `rq1-cpu` uses whichever backend measures faster on 2 cores). In the vLLM environment:

    .venv-vllm/bin/python benchmarks/rq1_cpu_backends.py [--sweep rq1-cpu] [--rounds 2] [--members 4]
        [--grpo-rounds 2] [--grpo-steps 1] [--eval-prompts 8] [--eval-n 32] [--json F]

Every setting comes from the sweep as `esbatch sweep` plans it (load_sweep: model, dtype, sampling, N, B, sigma,
G, lr, eval.tasks, the evaluate phase's eval config), only backend.name changed (engine settings: the planned
run's backend section, or the eval config's). The backends alternate: hf first in even rounds, vllm in odd ones.
The defaults take ~12-15 min on 2 cores.

  (a) ES (the ES run's config; each backend built once): per member, the wall time of evaluate_population over
      --members members of update 0's population on update 0's prompts (perturb, generate, restore), and the
      update of all N members, per round; then one in-training evaluation (held-out greedy + eval.tasks, as the
      run makes them) per backend.
  (c) eval (the base model's eval of the evaluate phase): in round r, task r mod (its tasks): --eval-prompts
      problems x --eval-n samples in one generate call, at the eval's temperature, token limit and few-shot
      prompts, entropy on, as `esbatch eval` asks; seconds per sample. The defaults make the call one HF batch
      of 256 sequences, as in the eval (24 problems x 32 samples per call: HF generates 256 sequences at a
      time, vLLM schedules them itself); smaller calls flatter HF (at 2 x 32: 1.70x here against 1.95x for a
      real `esbatch eval` of Add2).
  (b) GRPO (the GRPO run's config): per round and backend, in a child process, a trainer as `esbatch train`
      builds it (setup: model, DeepSpeed, vLLM engine), one untimed step, --grpo-steps timed ones (rollout /
      weight load / train, and the step's wall time; benchmarks/grpo_step_split.py). Its in-training evals are
      taken to cost the ES one (the same generation on the same backend), plus one weight load with vllm.

Projection (the local launcher runs one task after another): per run and stage of U updates, setup + U x update
+ k x in-training eval (k: after update 0, every eval.every and at the end), an ES update being N x member + the
update; an eval, start-up + samples x s per sample. Costs equal on both backends (process start, imports,
checkpoints, MLflow, scoring) are left out: the hours are a lower bound, the ratios the point.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_step_split import build, step_parts  # noqa: E402 - the GRPO step split, shared

NAMES = ("hf", "vllm")


def order(r: int) -> tuple[str, ...]:
    return NAMES if r % 2 == 0 else NAMES[::-1]


def on(cfg: Any, name: str) -> Any:
    """A copy of run config ``cfg`` on backend ``name`` (its other backend settings kept)."""
    out = copy.deepcopy(cfg)
    out.backend = dataclasses.replace(out.backend, name=name)
    return out


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def es_phase(cfg: Any, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from esbatch.backends import BACKENDS, PerturbedMember, SamplingParams
    from esbatch.es.config import ESConfig, backend_setup
    from esbatch.es.core import direction_weights, draw_population, normalize
    from esbatch.perturb.update import UpdateSpec
    from esbatch.train.problems import evaluate_heldout, load_problems
    from esbatch.train.schedule import batch_indices, schedule_start
    from esbatch.train.taskeval import TaskEvals

    es, gen = cfg.section(ESConfig), cfg.generation
    sampling = SamplingParams(gen.temperature, gen.top_p, gen.max_new_tokens)
    members = draw_population(cfg.run.seed, 0, es.population_size, es.estimator, es.generation_seeds)
    scaled = [PerturbedMember(m.seed, m.sign * es.sigma, m.gen_seed) for m in members]
    z = normalize([float(i % 3) for i in range(len(members))], es.normalization, es.eps_num)
    spec = UpdateSpec(*direction_weights(members, z), es.alpha, es.population_size)
    res: dict[str, dict[str, Any]] = {}
    backends, probs, evals, cfgs = {}, {}, {}, {}
    for name in NAMES:
        cfgs[name] = on(cfg, name)
        t0 = time.perf_counter()
        backends[name] = BACKENDS.get(name).for_es(backend_setup(cfgs[name]))
        res[name] = {"setup_s": time.perf_counter() - t0, "member_s": [], "update_s": [], "eval_s": [], "tokens": 0}
        probs[name] = load_problems(cfgs[name], backends[name])
        evals[name] = TaskEvals(cfgs[name])
        say(f"es {name}: setup {res[name]['setup_s']:.1f} s")
    n = len(probs["hf"].train)
    _, idx = batch_indices(cfg.run.seed, 0, n, es.batch_size, schedule_start(n, cfg.run.data_before))
    try:
        for name, b in backends.items():  # first calls' allocations and page faults: not a per-update cost
            b.generate([probs[name].train_prompts[idx[0]]], sampling, 0)
            b.perturb(0, es.sigma)
            b.restore()
        for r in range(args.rounds):
            chunk = [scaled[(r * args.members + i) % len(scaled)] for i in range(args.members)]
            for name in order(r):
                b, mine = backends[name], res[name]
                prompts = [probs[name].train_prompts[i] for i in idx]
                t0 = time.perf_counter()
                pop = b.evaluate_population(chunk, prompts, sampling)
                mine["member_s"].append((time.perf_counter() - t0) / len(chunk))
                mine["tokens"] += sum(g.n_tokens for gens in pop.generations for g in gens)
                t0 = time.perf_counter()
                b.update(spec)
                mine["update_s"].append(time.perf_counter() - t0)
                say(f"es round {r} {name}: member {mine['member_s'][-1]:.2f} s, update {mine['update_s'][-1]:.2f} s")
        for name in order(args.rounds):  # minutes on HF: once per backend
            t0 = time.perf_counter()  # as the lifecycle evaluates: held-out greedy, then eval.tasks
            evaluate_heldout(cfgs[name], backends[name], probs[name])
            if evals[name]:
                evals[name](backends[name], 0)
            res[name]["eval_s"].append(time.perf_counter() - t0)
            say(f"es {name}: in-training eval {res[name]['eval_s'][-1]:.1f} s")
    finally:
        for b in backends.values():
            b.close()
    return res


def eval_phase(ecfg: Any, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from esbatch.backends import BACKENDS, SamplingParams
    from esbatch.eval.runner import chunk_seed
    from esbatch.tasks import TASKS
    from esbatch.train.taskeval import few_shot_demos

    s = ecfg.sampling
    gens, res = {}, {}
    for name in NAMES:
        t0 = time.perf_counter()
        backend = dataclasses.replace(ecfg.backend, name=name)
        gens[name] = BACKENDS.get(name).for_inference(ecfg.model, None, s.batch_size, backend)
        res[name] = {"startup_s": time.perf_counter() - t0, "s_per_sample": [], "tokens_per_s": []}
        say(f"eval {name}: start-up {res[name]['startup_s']:.1f} s")
    calls = []  # (label, prompts, sampling, seed) per task, as esbatch/eval/runner.py:run_task makes them
    for et in ecfg.task_list():
        label = et.label or et.name
        task = TASKS.get(et.name)(et.data_path, **et.params)
        exs = task.eval_examples(et.limit, s.seed)
        exs = exs[: et.limit] if et.limit else exs
        demos = few_shot_demos(task, et.few_shot, exs, s.seed)
        prompts = [gens["hf"].chat_prompt(task.messages(ex, demos, None)) for ex in exs[: args.eval_prompts]]
        max_new = et.max_new_tokens or s.max_new_tokens
        sampled = SamplingParams(s.temperature, s.top_p, max_new, n=args.eval_n, entropy=True)
        calls.append((label, prompts, sampled, chunk_seed(s.seed, label, 0)))
    try:
        for r in range(args.rounds):
            label, prompts, sampled, seed = calls[r % len(calls)]  # one task per round, the tasks in turn
            for name in order(r):
                t0 = time.perf_counter()
                out = gens[name].generate(prompts, sampled, seed)
                dt, tokens = time.perf_counter() - t0, sum(g.n_tokens for g in out)
                res[name]["s_per_sample"].append(dt / len(out))
                res[name]["tokens_per_s"].append(tokens / dt)
                say(f"eval round {r} {name}: {label}, {len(out)} samples, {tokens} tokens in {dt:.1f} s")
    finally:
        for g in gens.values():
            g.close()
    return res


def grpo_child(cfg: Any, name: str, steps: int) -> dict[str, float]:
    """In a child process of its own (a run's trainer is its own process too: DeepSpeed's and the rollouts' memory
    goes with it): setup, then the step split."""
    import torch

    from esbatch.grpo.trainer import init_distributed

    init_distributed("cpu")
    t0 = time.perf_counter()
    tr = build(on(cfg, name), "cpu")
    out = {"setup_s": time.perf_counter() - t0}
    try:
        out.update(step_parts(tr, steps))
    finally:
        tr.close()
        torch.distributed.destroy_process_group()
    return out


def grpo_phase(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    keys = ("setup_s", "rollout", "load", "train", "wall")
    res: dict[str, dict[str, Any]] = {n: {k: [] for k in keys} for n in NAMES}
    for r in range(args.grpo_rounds):
        for name in order(r):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", name]
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"grpo {name}: the child failed (exit {p.returncode})\n{p.stderr[-3000:]}")
            for k, v in json.loads(line[7:]).items():
                res[name][k].append(v)
            say(f"grpo round {r} {name}: " + ", ".join(f"{k} {res[name][k][-1]:.2f}" for k in keys))
    return res


def med(x: Any) -> float:
    return statistics.median(x) if isinstance(x, list) else x


def project(sweep: Any, es: dict, grpo: dict, ev: dict) -> dict[str, dict[str, float]]:
    """Seconds per planned task (run or eval) on each backend, from the medians."""
    from esbatch.config.eval import eval_config_from_dict
    from esbatch.es.config import ESConfig
    from esbatch.launch.cost import eval_points, problems
    from esbatch.launch.disk import planned_updates
    from esbatch.pipeline import stage_configs

    out: dict[str, dict[str, float]] = {}
    for r in sweep.runs:
        c = r.config
        stages = [sc for _, sc in stage_configs(c, Path(c.run.output_dir) / c.run.name, None)]
        out[r.point.get("method", r.label)] = secs = {}
        for name in NAMES:
            total = 0.0
            for sc in stages if c.algorithm == "pipeline" else [c]:
                U = planned_updates(sc) or 0
                k = eval_points(U, sc.eval.every)
                if sc.algorithm == "es":
                    e = es[name]
                    per = sc.section(ESConfig).population_size * med(e["member_s"]) + med(e["update_s"])
                    total += e["setup_s"] + U * per + k * med(e["eval_s"])
                else:
                    g = grpo[name]
                    # in-training eval: the ES one (the same generation), with vllm after a weight load
                    k_s = med(es[name]["eval_s"]) + med(g["load"])
                    total += med(g["setup_s"]) + U * med(g["wall"]) + k * k_s
            secs[name] = total
    for e in sweep.evals:
        cfg = eval_config_from_dict({k: v for k, v in e.config.items() if k != "checkpoint"})
        n = sum(problems(t.name, t.limit, t.data_path) or 0 for t in cfg.task_list())
        samples = n * (cfg.sampling.n + (1 if cfg.sampling.greedy else 0))
        out[e.label] = {b: ev[b]["startup_s"] + samples * med(ev[b]["s_per_sample"]) for b in NAMES}
    return out


def report(sweep: Any, es: dict, grpo: dict, ev: dict, args: argparse.Namespace) -> dict[str, Any]:
    def per_round(x: list[float], fmt: str = "{:.2f}") -> str:
        return " / ".join(fmt.format(v) for v in x)

    es_cfg = next(r.config for r in sweep.runs if r.config.algorithm == "es")
    g_cfg = next(r.config for r in sweep.runs if r.config.algorithm == "grpo")
    print(f"\nsweep {sweep.name}: {es_cfg.model.name} {es_cfg.model.dtype}, {args.rounds} rounds, backends alternating")
    e = es_cfg.es
    print(
        f"\n(a) ES member: perturb + generate {e.batch_size} prompts (T={es_cfg.generation.temperature}, <= "
        f"{es_cfg.generation.max_new_tokens} tokens) + restore, {args.members} members per round; update of N="
        f"{e.population_size}; one in-training eval"
    )
    print("| backend | setup s | s per member (rounds) | update s | in-training eval s |")
    print("|---|---:|---|---|---|")
    for b in NAMES:
        r = es[b]
        print(
            f"| {b} | {r['setup_s']:.1f} | {per_round(r['member_s'])} | {per_round(r['update_s'])} | "
            f"{per_round(r['eval_s'], '{:.1f}')} |"
        )
    g = g_cfg.grpo
    print(
        f"\n(b) GRPO update: B={g.batch_size} x G={g.group_size}, lr {g.learning_rate}, medians of {args.grpo_steps} "
        "steps per round (rounds)"
    )
    print("| backend | setup s | rollout s | weight load s | train s | step wall s |")
    print("|---|---|---|---|---|---|")
    for b in NAMES:
        r = grpo[b]
        cols = [
            per_round(r[k], "{:.1f}" if k == "setup_s" else "{:.2f}")
            for k in ("setup_s", "rollout", "load", "train", "wall")
        ]
        print(f"| {b} | " + " | ".join(cols) + " |")
    print(f"\n(c) eval: {args.eval_prompts} problems x {args.eval_n} samples of one task per round, entropy on")
    print("| backend | start-up s | tok/s (rounds) | s per sample (rounds) |")
    print("|---|---:|---|---|")
    for b in NAMES:
        r = ev[b]
        print(
            f"| {b} | {r['startup_s']:.1f} | {per_round(r['tokens_per_s'], '{:.1f}')} | "
            f"{per_round(r['s_per_sample'], '{:.4f}')} |"
        )
    ratios = {
        "ES member": med(es["hf"]["member_s"]) / med(es["vllm"]["member_s"]),
        "ES update": med(es["hf"]["update_s"]) / med(es["vllm"]["update_s"]),
        "in-training eval": med(es["hf"]["eval_s"]) / med(es["vllm"]["eval_s"]),
        "GRPO step (wall)": med(grpo["hf"]["wall"]) / med(grpo["vllm"]["wall"]),
        "GRPO rollout alone": med(grpo["hf"]["rollout"]) / med(grpo["vllm"]["rollout"]),
        "eval per sample": med(ev["hf"]["s_per_sample"]) / med(ev["vllm"]["s_per_sample"]),
    }
    print("\nHF time / vLLM time (medians; > 1: vLLM faster)")
    for k, v in ratios.items():
        print(f"  {k:<26}{v:6.2f}")
    proj = project(sweep, es, grpo, ev)
    print(f"\nprojected wall time of `esbatch sweep {sweep.name}` (local launcher, one task at a time), hours")
    print("| task | hf | vllm | faster |")
    print("|---|---:|---:|---|")
    for task, s in proj.items():
        print(f"| {task} | {s['hf'] / 3600:.2f} | {s['vllm'] / 3600:.2f} | {min(s, key=s.get)} |")
    totals = {b: sum(s[b] for s in proj.values()) for b in NAMES}
    best = sum(min(s.values()) for s in proj.values())
    print(
        f"\nall-HF {totals['hf'] / 3600:.2f} h, all-vLLM {totals['vllm'] / 3600:.2f} h, "
        f"per-task best {best / 3600:.2f} h"
    )
    return {
        "es": es,
        "grpo": grpo,
        "eval": ev,
        "ratios": ratios,
        "projected_s": proj,
        "totals_s": {**totals, "best": best},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", default="rq1-cpu", help="a sweep with an ES run, a GRPO run and an evaluate phase")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--members", type=int, default=4, help="ES members timed per round and backend")
    ap.add_argument("--grpo-rounds", type=int, default=2, help="rounds of the GRPO phase (a trainer each)")
    ap.add_argument("--grpo-steps", type=int, default=1, help="timed GRPO steps per round and backend")
    ap.add_argument("--eval-prompts", type=int, default=8, help="problems per eval task")
    ap.add_argument("--eval-n", type=int, default=32, help="samples per problem")
    ap.add_argument("--phases", nargs="+", default=["es", "eval", "grpo"], choices=["es", "eval", "grpo"])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--child", choices=NAMES, help=argparse.SUPPRESS)  # a GRPO trainer on this backend
    args = ap.parse_args()

    from esbatch.config.eval import eval_config_from_dict
    from esbatch.launch.sweep import load_sweep

    sweep = load_sweep(args.sweep)
    es_cfg = next(r.config for r in sweep.runs if r.config.algorithm == "es")
    grpo_cfg = next(r.config for r in sweep.runs if r.config.algorithm == "grpo")
    base = next(e for e in sweep.evals if e.source is None)  # the base model's eval: no center to load
    ecfg = eval_config_from_dict({k: v for k, v in base.config.items() if k != "checkpoint"})
    if args.child:
        print("RESULT " + json.dumps(grpo_child(grpo_cfg, args.child, args.grpo_steps)), flush=True)
        return
    t0 = time.perf_counter()
    es = es_phase(es_cfg, args) if "es" in args.phases else None
    ev = eval_phase(ecfg, args) if "eval" in args.phases else None
    grpo = grpo_phase(args) if "grpo" in args.phases else None
    say(f"measured in {time.perf_counter() - t0:.0f} s")
    if es is None or ev is None or grpo is None:
        print(json.dumps({"es": es, "eval": ev, "grpo": grpo}, indent=1))
        return
    figures = report(sweep, es, grpo, ev, args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
