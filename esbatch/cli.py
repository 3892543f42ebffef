"""The `esbatch` command line: train, sweep, status, cancel, aggregate, eval, center, eval-plot, flops, validate, ls,
plot, analyze (drift, diversity, threshold-curve), threshold, diagnose (kappa).

Every subcommand's module is imported here; none loads torch, transformers, mlflow or matplotlib at import (they
do inside the functions that need them), so `esbatch --help` stays fast."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import esbatch
from esbatch import durable
from esbatch.aggregate.collect import aggregate
from esbatch.aggregate.plots import plot_runs
from esbatch.analyze.diversity import DiversityInputError, analyze
from esbatch.analyze.drift import DEFAULT_TAUS, analyze_drift, table4_rows
from esbatch.analyze.threshold import S_TAU, plot_threshold_curve, threshold_run
from esbatch.backends import BACKENDS
from esbatch.config import RESUME_OVERRIDABLE, ConfigError, load_config, load_run_config
from esbatch.config.aggregate import parse_specs
from esbatch.config.eval import load_eval_config
from esbatch.config.kinds import detect_kind
from esbatch.config.launcher import load_profile
from esbatch.config.loader import KINDS, available, find, find_all, noun, read_yaml
from esbatch.config.reference import schema_text
from esbatch.diagnose.protocol import OBJECTIVES, SEED_MODES, KappaProtocol, planned_evaluations, run_kappa
from esbatch.diagnose.report import write_outputs
from esbatch.es.config import ESConfig, backend_setup
from esbatch.eval.center import center_at
from esbatch.eval.plots import plot_pareto, plot_passk
from esbatch.eval.runner import EvalDir, evaluate
from esbatch.grpo.config import GRPOConfig
from esbatch.launch.base import LAUNCHERS
from esbatch.launch.cost import load_table
from esbatch.launch.state import SWEEP_RECORD_KEYS, SweepDir, folder_problem
from esbatch.launch.submit import (
    BackendUnavailable,
    cancel_sweep,
    dry_run,
    folder_notes,
    follow,
    format_table,
    memory_warnings,
    run_states,
    submit_sweep,
)
from esbatch.launch.sweep import load_sweep
from esbatch.models import DTYPES, MODELS, ModelFileError, meta_parameter_count
from esbatch.registry import UnknownNameError
from esbatch.tasks import TASKS, DataFileError
from esbatch.tasks.verify import ScoringError
from esbatch.tracking import TrackingStoreError
from esbatch.train import fingerprint, stop, train
from esbatch.train.config import ALGORITHMS
from esbatch.train.flops import format_accounting, mean_prompt_tokens
from esbatch.train.lock import held_env, writer_lock
from esbatch.train.rundir import RunDir, RunFolderError
from esbatch.train.sections import RunConfig


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set es.sigma=0.01 (repeatable; values parsed as YAML)",
    )


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


# ----------------------------------------------------------------------------- train


def _lead_rank() -> bool:
    """Rank 0 of a torchrun job (or a plain process): the run folder's one writer."""
    return os.environ.get("RANK", "0") == "0"


def _train_config(args: argparse.Namespace, hold: contextlib.ExitStack) -> tuple[Any, Path] | int:
    """The config and run folder of `esbatch train CONFIG` or `esbatch train --resume RUN_DIR`; rank 0 takes the
    folder's writer lock into ``hold`` before it reads what it may rewrite (esbatch/train/lock.py)."""
    if not args.resume:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
        if _lead_rank() and not (run_dir / "sweep.json").exists():  # a sweep folder: RunSession says so
            hold.enter_context(writer_lock(run_dir))
        return cfg, run_dir
    rd = RunDir(args.resume)
    if not rd.config.exists():
        return _err(f"--resume {rd.path}: no {RunDir.CONFIG} there; give the run directory printed by `esbatch train`")
    if args.config:
        return _err("give either a CONFIG or --resume RUN_DIR, not both")
    fixed = [o for o in args.overrides if o.partition("=")[0].strip() not in RESUME_OVERRIDABLE]
    if fixed:
        return _err(
            f"--set {fixed[0]}: cannot change this on resume (the logged updates depend on it); "
            f"start a new run instead. On resume you may set: {', '.join(sorted(RESUME_OVERRIDABLE))}"
        )
    fingerprint.check(rd, load_run_config(rd.path, args.overrides))  # an edited config: refused, the lock untaken
    if _lead_rank():
        hold.enter_context(writer_lock(rd.path))
    cfg = load_run_config(rd.path, args.overrides)  # a folder from before es.noise: legacy-cpu
    fingerprint.check(rd, cfg)  # again under the lock, before config.yaml is rewritten
    if args.overrides and _lead_rank():  # atomically: the other ranks of a torchrun job read it at the same moment
        durable.write_text(rd.config, cfg.to_yaml())
    return cfg, rd.path


def cmd_train(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as hold:  # the run folder's writer lock, held until the command ends
        return _cmd_train(args, hold)


def _cmd_train(args: argparse.Namespace, hold: contextlib.ExitStack) -> int:
    got = _train_config(args, hold)
    if isinstance(got, int):
        return got
    cfg, run_dir = got
    verb = "resuming" if args.resume else "training"
    print(
        f"esbatch {esbatch.__version__}: {verb} {cfg.algorithm} on {cfg.task.name} with {cfg.model.name} "
        f"({cfg.model.dtype}) -> {run_dir}",
        file=sys.stderr,
    )
    stop.install((signal.SIGTERM, signal.SIGINT, signal.SIGUSR2))  # USR2: SLURM's warning before the time limit
    if cfg.run.nproc_per_node > 1 and "RANK" not in os.environ and cfg.algo().multi_rank:
        return _start_ranks(cfg.run.nproc_per_node, run_dir)
    try:
        s = train(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted. Continue with: esbatch train --resume {run_dir}", file=sys.stderr)
        return 130
    if "rank" not in s:  # ranks other than 0 leave the summary to rank 0
        _print_summary(s)
    return 0


def _print_summary(s: dict[str, Any]) -> None:
    first, last = s.get("heldout_first"), s.get("heldout_last")
    if s.get("stages"):
        print(f"\ndone: pipeline {' -> '.join(st['name'] for st in s['stages'])} in {s['run_dir']}")
        for st in s["stages"]:
            print(f"  {st['name']}: {st['run_dir']} (MLflow run {st['mlflow_run_id']})")
        print(f"final weights: {s['center']}")
    elif s["algorithm"] == "grpo":
        print(f"\ndone: {s['updates']} GRPO steps on {s['world_size']} rank(s) in {s['wall_s']:.0f} s")
    else:
        print(f"\ndone: {s['updates']} updates in {s['wall_s']:.0f} s, peak RSS {s['peak_rss_mb']:.0f} MB")
    if first and last and "heldout/accuracy" in first and "heldout/accuracy" in last:
        print(
            f"held-out greedy accuracy: {first['heldout/accuracy']:.3f} (update {first['t']}) -> "
            f"{last['heldout/accuracy']:.3f} (update {last['t']})"
        )
    print(f"run directory: {s['run_dir']}")
    print(f"MLflow run {s['mlflow_run_id']} (experiment {s['experiment_id']}) in {s['tracking_uri']}")
    if s["tracking_uri"].startswith("sqlite:"):
        print(f"  view it: mlflow ui --backend-store-uri {s['tracking_uri']}")


def _start_ranks(n: int, run_dir: Path) -> int:
    """Re-run this command under torchrun with n ranks (ES: the population is split over them; GRPO: data
    parallel). Exits non-zero when any rank fails; the run folder is then resumable with --resume. This process
    keeps holding the run folder's writer lock; its rank 0 writes under it."""

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "-m", "esbatch", *sys.argv[1:]]
    print(f"starting {n} ranks: {' '.join(cmd[1:])}", file=sys.stderr)
    rc = subprocess.call(cmd, env={**os.environ, **held_env(run_dir)})
    if rc:
        print(
            f"error: a rank failed (exit {rc}); see its traceback above. The run folder is resumable.", file=sys.stderr
        )
    return rc


# ----------------------------------------------------------------------------- config files


def cmd_validate(args: argparse.Namespace) -> int:
    if args.schema:
        print(schema_text(args.kind or "config"))
        return 0
    if not args.files:
        return _err("give one or more config, sweep, launcher or eval files (or --schema)")
    bad = 0
    for f in args.files:
        try:
            for what in _validate(f, args.kind, args.overrides):
                print(f"ok: {f} ({what})")
        except ConfigError as e:
            bad += 1
            print(str(e), file=sys.stderr)
    return 2 if bad else 0  # 2, like every other command's bad input


def _validate(name: str, kind: str | None, overrides: list[str]) -> list[str]:
    """Check a file (or every built-in file of that name); one description per file checked."""
    if kind == "aggregate":
        path = find(name, "config")
        raw = read_yaml(path).get("aggregate")
        return [f"{len(parse_specs(raw if raw is not None else []))} aggregate analyses"]
    hits = [(find(name, kind), kind)] if kind else find_all(name)
    return [_validate_one(path, k or detect_kind(read_yaml(path), path), overrides) for path, k in hits]


def _validate_one(path: Path, kind: str, overrides: list[str]) -> str:
    """Check one file of a known kind; returns a one-line description of what it is."""
    if kind == "sweep":
        sw = load_sweep(str(path), overrides=overrides)
        evals = f", {len(sw.evals)} evals" if sw.evals else ""
        return f"{noun(kind)} {sw.name}: {len(sw.runs)} runs{evals}, launcher {sw.launcher}"
    if kind == "launcher":
        prof = load_profile(str(path))
        return f"{noun(kind)}: cluster {prof.cluster}"
    if kind == "eval":
        ec = load_eval_config(str(path), overrides)
        return f"{noun(kind)}: {len(ec.task_list())} tasks, model {ec.model.name}"

    cfg = load_config(str(path), overrides)
    return f"{noun(kind)}: {cfg.algorithm}, task {cfg.task.name}, model {cfg.model.name}"


def cmd_ls(args: argparse.Namespace) -> int:
    for title, reg in (("algorithms", ALGORITHMS), ("tasks", TASKS), ("models", MODELS), ("backends", BACKENDS)):
        print(f"{title}:")
        for name in reg:
            print(f"  {name:32s} {reg.help(name)}")
    print("launcher kinds:\n" + "".join(f"  {n:32s} {LAUNCHERS.help(n)}\n" for n in LAUNCHERS), end="")
    for kind, (folder, words) in KINDS.items():
        print(f"{words}s (./{folder}/ or built in):")
        for name in available(kind):
            print(f"  {name}")
    return 0


# ----------------------------------------------------------------------------- sweeps


def cmd_sweep(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep, launcher=args.launcher, overrides=args.overrides, name=args.name)
    table = load_table(args.throughput)  # the cost plan's rates: built in, or measured (scripts/gpu_check.py)
    if args.dry_run:
        return dry_run(sweep, sys.stdout, table)
    stop.install()
    code = submit_sweep(sweep, wait=args.wait, table=table)
    if code != 130 and (sweep.profile.cluster == "local" or (args.wait and not sweep.profile.aggregate_job)):
        code = _aggregate_after_sweep(sweep.dir) or code
    elif code != 130 and args.wait and (sweep.dir / "results" / "README.md").exists():
        print(f"results: {sweep.dir / 'results'}")
    return code


def _aggregate_after_sweep(sweep_dir: Path) -> int:
    """Aggregate a sweep that has run; 1 (and why, and how to retry) when that fails: the runs are safe on disk."""

    try:
        print(f"results: {aggregate(sweep_dir)}")
    except Exception as e:  # noqa: BLE001 - any failure: said, and the sweep's exit status says it too
        print(
            f"error: aggregation failed ({type(e).__name__}: {e}); retry with: esbatch aggregate {sweep_dir}",
            file=sys.stderr,
        )
        return 1
    return 0


def _sweep_dir(arg: str, name: str | None = None) -> Path:
    """A sweep folder, or a sweep file / name whose folder is looked up (under another --name if given)."""
    p = Path(arg)
    if (p / "sweep.json").exists():
        return p

    try:
        return load_sweep(arg, name=name).dir
    except ConfigError:
        ran = Path(RunConfig().output_dir) / arg  # a sweep run under --name NAME in the default output folder
        if name is None and (ran / "sweep.json").exists():
            return ran
        raise


def cmd_status(args: argparse.Namespace) -> int:
    sd = SweepDir(_sweep_dir(args.sweep, args.name))
    if not sd.exists():
        return _err(f"{sd.path}: nothing submitted yet (no sweep.json). Submit with: esbatch sweep {args.sweep}")
    if args.follow:
        follow(sd)
    meta = sd.read(require=SWEEP_RECORD_KEYS)
    print(f"sweep {meta['name']} ({meta.get('launcher', 'local')}, {meta.get('cluster', 'local')}) in {sd.path}")
    states = run_states(sd)
    print(format_table(states))
    for note in folder_notes(sd, states):
        print(note)
    for w in memory_warnings(sd):
        print(f"memory: {w}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    sd = SweepDir(_sweep_dir(args.sweep, args.name))
    if not sd.exists():
        return _err(f"{sd.path}: nothing submitted yet (no sweep.json)")
    keys = cancel_sweep(sd)
    print(f"cancelled {len(keys)} queued or running run(s) of {sd.path}; `esbatch sweep` resumes them")
    return 0


def cmd_aggregate(args: argparse.Namespace) -> int:
    out = aggregate(_sweep_dir(args.sweep, args.name))
    print(f"results: {out}")
    for f in sorted(out.glob("*.md")):
        if f.name != "README.md":
            print(f"\n## {f.stem}\n{f.read_text()}")
    return 0


# ----------------------------------------------------------------------------- evaluation


def cmd_eval(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.recompute:
        ed = EvalDir(args.recompute)
        if not ed.config.exists():
            return _err(f"--recompute {ed.path}: not an eval folder (no {ed.config.name})")
        cfg = load_eval_config(str(ed.config), overrides)
    else:
        for flag, key in ((args.model, "model.name"), (args.checkpoint, "checkpoint"), (args.mlflow_run, "mlflow_run")):
            if flag:
                overrides.append(f"{key}={flag}")
        if args.at is not None:
            overrides.append(f"checkpoint_update={args.at}")
        cfg = load_eval_config(args.config, overrides)
    stop.install()
    try:
        s = evaluate(cfg, progress=not args.no_progress, recompute=bool(args.recompute))
    except KeyboardInterrupt:
        print("\ninterrupted: the same command continues the eval where it stopped", file=sys.stderr)
        return 130
    out = Path(cfg.output_dir) / cfg.name
    print((out / "table.md").read_text())
    if s.get("tokens_per_s"):
        print(f"generation: {s['tokens']} tokens in {s['generation_s']:.0f} s = {s['tokens_per_s']:.1f} tokens/s")
    print(f"eval folder: {out}  (samples, table.csv, passk.csv, passk.png)")
    print(f"MLflow run {s['mlflow_run_id']}  ({s['source']})")
    return 0


def cmd_center(args: argparse.Namespace) -> int:
    if args.at < 0:
        return _err(f"--at {args.at}: give an update count >= 0 (0 = the run's theta_0)")
    out = center_at(args.run_dir, args.at, args.out)
    print(f"center after update {args.at} of {args.run_dir}: {out}")
    if args.out is None:
        print(f"evaluate it: esbatch eval --checkpoint {args.run_dir} --at {args.at}")
    return 0


def cmd_eval_plot(args: argparse.Namespace) -> int:
    missing = [d for d in args.eval_dirs if not (Path(d) / "metrics.json").exists()]
    if missing:
        return _err(f"{missing[0]} is not a finished eval folder (no metrics.json)")
    if args.kind == "passk":
        print(plot_passk(args.eval_dirs, args.output))
    else:
        print(plot_pareto(args.eval_dirs, args.output, k=args.k, task=args.task))
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    """Per-update FLOPs of ES and GRPO for a config, and the matched setting of the other (App. G.2)."""
    cfg = load_config(args.config, args.overrides)
    m = cfg.model
    params = args.params or meta_parameter_count(m.name, m.gguf_file, m.revision)  # config only: no weights
    prompt_tokens = args.prompt_tokens if args.prompt_tokens is not None else mean_prompt_tokens(cfg)
    gen_tokens = args.gen_tokens or cfg.generation.max_new_tokens
    es, grpo = cfg.section(ESConfig), cfg.section(GRPOConfig)
    sec = grpo if cfg.algorithm == "grpo" else es  # a pipeline: the ES stage's batch
    print(
        f"model {cfg.model.name}: P = {params:,} parameters; prompt {prompt_tokens:.0f} tokens, "
        f"generation {gen_tokens:.0f} tokens{' (max_new_tokens: an upper bound)' if not args.gen_tokens else ''}"
    )
    print(
        format_accounting(
            params,
            sec.batch_size,
            prompt_tokens,
            gen_tokens,
            N=es.population_size,
            G=grpo.group_size,
            beta=grpo.beta,
            updates=sec.updates or 1,
            iterations=grpo.iterations,
        )
    )
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    for d in args.run_dirs:  # the same words as `esbatch status`, `sweep` and `aggregate`
        if problem := folder_problem(RunDir(d)):
            return _err(f"damaged: {problem}")
        if not RunDir(d).exists():
            return _err(f"{d} is not a run directory (no {RunDir.CONFIG})")
    print(plot_runs(args.run_dirs, args.output, title=args.title))
    return 0


# ----------------------------------------------------------------------------- diagnostics (RQ2)


AS_DTYPE_HELP = (
    "compare theta_final with theta_0 in this dtype (default: theta_0's, the run's compute dtype, as the paper "
    "counts bf16 models; float32: the fp32 center itself)"
)


def _bad_taus(taus: list[float]) -> str | None:
    bad = [t for t in taus if not (t > 0 and t != float("inf"))]
    if bad:
        return f"--tau {bad[0]:g}: thresholds must be finite numbers > 0 (|delta| in (0, tau]), e.g. --tau 1e-6 1e-5"
    return None


def cmd_analyze_drift(args: argparse.Namespace) -> int:
    if why := _bad_taus(args.tau):
        return _err(why)
    if args.top_k < 1 or args.bins_per_decade < 1:
        return _err(f"--top-k {args.top_k} / --bins-per-decade {args.bins_per_decade}: give counts >= 1")
    done = analyze_drift(
        args.runs,
        args.reference,
        taus=args.tau,
        top_k=args.top_k,
        per_decade=args.bins_per_decade,
        base_dtype=args.base_dtype,
        as_dtype=args.as_dtype,
        mlflow=not args.no_mlflow,
    )
    stats = [s for _, s, _ in done]
    ref = stats[0] if args.reference else None
    rows = table4_rows(stats, ref)
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    for _, s, folder in done:
        files = f"; files: {folder}" if folder else " (a model: no files)"
        print(f"{s.label}: max |delta| {s.max_abs:.8g} at {s.max_count} coordinate(s){files}")
    return 0


def cmd_threshold_curve(args: argparse.Namespace) -> int:
    try:
        png, table = plot_threshold_curve(args.eval_dirs, args.output, task=args.task)
    except ValueError as e:
        return _err(str(e))
    print(f"{png}\n{table}")
    return 0


def cmd_threshold(args: argparse.Namespace) -> int:
    if why := _bad_taus(args.tau):
        return _err(why)
    for folder in threshold_run(args.run_dir, args.tau, base_dtype=args.base_dtype, as_dtype=args.as_dtype):
        s = json.loads((folder / S_TAU).read_text())
        print(
            f"tau {s['tau']:g}: s_tau {100 * s['s_tau']:.4f}% of nonzero updates zeroed, "
            f"{100 * s['kept_share_of_all']:.4f}% of all coordinates keep their update -> {folder}"
        )
    print(f"evaluate one: esbatch eval --checkpoint {folder}")
    return 0


def _analysis_commands(sub: Any) -> None:
    an = sub.add_parser(
        "analyze", help="analyses of run folders: drift from theta_0, population diversity, Figure 4's curve"
    )
    asub = an.add_subparsers(dest="analysis", metavar="ANALYSIS", required=True)
    dr = asub.add_parser(
        "drift", help="relative L2 drift, s_tau, |delta| histograms by parameter type, largest updates (Table 4)"
    )
    dr.add_argument("runs", nargs="+", metavar="RUN", help="run folders (ES, GRPO, a pipeline or its stage<k>-<algo>)")
    dr.add_argument(
        "--reference",
        metavar="RUN|MODEL",
        help="run, or model (alias, hub id, folder: a released GRPO checkpoint), whose relative L2 distance from the "
        "runs' base model the others are divided by (GRPO)",
    )
    dr.add_argument(
        "--tau",
        type=float,
        nargs="+",
        default=list(DEFAULT_TAUS),
        help="thresholds of s_tau (default: %(default)s; 1.5e-3 is the paper's, the rest ours)",
    )
    dr.add_argument("--top-k", type=int, default=100, help="largest |delta| coordinates to locate (default 100)")
    dr.add_argument("--bins-per-decade", type=int, default=4, help="histogram bins per power of ten (default 4)")
    dr.add_argument(
        "--base-dtype", choices=DTYPES, help="round theta_0 to this dtype (default: the run's model.dtype, as loaded)"
    )
    dr.add_argument("--as-dtype", choices=DTYPES, help=AS_DTYPE_HELP)
    dr.add_argument("--no-mlflow", action="store_true", help="write the files only, log nothing to MLflow")
    dr.set_defaults(func=cmd_analyze_drift)

    di = asub.add_parser(
        "diversity",
        help="population diversity over training (paper Section 3.1) from the runs' log.jsonl: CSV, Markdown, PNG",
    )
    di.add_argument("run_dirs", nargs="+", metavar="RUN", help="ES, GRPO or pipeline run folders (overlaid)")
    di.add_argument("--out", metavar="DIR", help="output folder (default: <first RUN>/analysis/diversity)")
    di.set_defaults(func=cmd_analyze_diversity)
    tc = asub.add_parser("threshold-curve", help="Figure 4: target-task Pass@1 vs update sparsity, one line per model")
    tc.add_argument("eval_dirs", nargs="+", metavar="EVAL_DIR", help="evals of thresholded checkpoints (and full runs)")
    tc.add_argument("--task", help="eval task label (default: the run's training task)")
    tc.add_argument("-o", "--output", default="threshold-curve.png", help="PNG to write (a CSV goes beside it)")
    tc.set_defaults(func=cmd_threshold_curve)

    th = sub.add_parser("threshold", help="magnitude-thresholded checkpoints: updates with |delta| <= tau set to 0")
    th.add_argument("run_dir", metavar="RUN_DIR")
    th.add_argument("--tau", type=float, nargs="+", required=True, help="thresholds; one checkpoint folder per tau")
    th.add_argument("--base-dtype", choices=DTYPES, help="round theta_0 to this dtype (default: the run's model.dtype)")
    th.add_argument("--as-dtype", choices=DTYPES, help=AS_DTYPE_HELP)
    th.set_defaults(func=cmd_threshold)


# ----------------------------------------------------------------------------- diagnostics


def cmd_diagnose_kappa(args: argparse.Namespace) -> int:
    """Appendix E's local subtraction diagnostic (kappa_base, kappa_pair) for a run config's model and task."""
    cfg = load_config(args.config, args.overrides)
    proto = KappaProtocol(
        sigmas=args.sigmas,
        objectives=args.objectives,
        seed_modes=args.seed_modes,
        prompts=args.prompts,
        seeds=args.seeds,
        directions=args.directions,
        fixed_prompts=args.fixed_prompts,
        fixed_seeds=args.fixed_seeds,
        fixed_directions=args.fixed_directions,
        sst2_examples=args.sst2_examples,
        sst2_directions=args.sst2_directions,
        supervised_task=args.supervised_task,
        supervised_data=args.supervised_data,
        score_batch_size=args.score_batch_size,
    )
    errors = proto.errors()
    if proto.supervised_data and not Path(proto.supervised_data).is_file():
        errors.append(f"--supervised-data {proto.supervised_data}: no such file (give a jsonl/json/parquet/csv file)")
    scoring = {"sst2-ce", "fixed"} & set(proto.objectives)
    if scoring and cfg.backend.name != "hf":
        errors.append(
            f"backend.name: {cfg.backend.name} cannot run objectives {', '.join(sorted(scoring))} (they score tokens "
            "with the model's logits); use --set backend.name=hf, or --objectives regenerated"
        )
    if "regenerated" in proto.objectives and cfg.backend.name == "hf" and proto.prompts > cfg.generation.batch_size:
        errors.append(
            f"--prompts {proto.prompts} > generation.batch_size {cfg.generation.batch_size}: the hf backend seeds "
            "once per generate call, so common seeds couple the three points only when all prompts share one call; "
            "raise generation.batch_size or lower --prompts"
        )
    why = BACKENDS.unsupported(cfg.backend.name, "es")
    if why:
        errors.append(f"backend.name: {cfg.backend.name} cannot perturb weights: {why}")
    if errors:
        return _err("diagnose kappa: " + "; ".join(errors))
    out = Path(args.out or Path("esbatch-diagnose") / f"kappa-{cfg.run.name}")
    from esbatch.clock import progress as tqdm  # monotonic: a clock jump moves no ETA

    if cfg.run.threads:
        import torch  # heavy

        torch.set_num_threads(cfg.run.threads)
    print(
        f"esbatch {esbatch.__version__}: kappa diagnostic of {cfg.model.name} ({cfg.model.dtype}) -> {out}",
        file=sys.stderr,
    )
    backend = BACKENDS.get(cfg.backend.name).for_es(backend_setup(cfg))
    bar = tqdm(total=planned_evaluations(cfg, proto), desc="kappa", unit="eval", disable=args.no_progress)
    try:
        cells = run_kappa(cfg, proto, backend, tick=bar.update)
    except ValueError as e:  # the data did not fit the protocol (too few rows, a malformed file)
        return _err(f"diagnose kappa: {e}")
    finally:
        bar.close()
        backend.close()

    paths = write_outputs(cells, out)
    durable.write_text(out / "config.yaml", cfg.to_yaml())
    durable.write_text(out / "protocol.json", json.dumps(dataclasses.asdict(proto), indent=2) + "\n")
    print(paths["md"].read_text())
    print(f"diagnostic folder: {out}  (kappa.csv, kappa.md, kappa.png, observations.csv)")
    return 0


def cmd_analyze_diversity(args: argparse.Namespace) -> int:
    try:
        files = analyze(args.run_dirs, args.out)
    except DiversityInputError as e:
        return _err(str(e))
    for f in files.values():
        print(f)
    return 0


# ----------------------------------------------------------------------------- the parser


def _training_commands(sub: Any) -> None:
    t = sub.add_parser("train", help="train one config (default: the built-in CPU quickstart)")
    t.add_argument("config", nargs="?", help="YAML file or built-in config name (see `esbatch ls`)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run from its run directory")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (for batch logs)")
    _add_set(t)
    t.set_defaults(func=cmd_train)

    fl = sub.add_parser("flops", help="ES vs GRPO FLOPs per update for a config, and the FLOP-matched N or G")
    fl.add_argument("config", nargs="?", help="YAML file or built-in config name")
    fl.add_argument("--params", type=int, help="parameter count (default: from the model's config, no weights)")
    fl.add_argument("--prompt-tokens", type=float, help="mean prompt tokens (default: measured on the task)")
    fl.add_argument("--gen-tokens", type=float, help="mean generated tokens (default: max_new_tokens)")
    _add_set(fl)
    fl.set_defaults(func=cmd_flops)

    pl = sub.add_parser("plot", help="plot held-out accuracy and population reward of run directories")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    pl.add_argument("-o", "--output", default="es-curves.png", help="PNG file to write")
    pl.add_argument("--title", default="ES training")
    pl.set_defaults(func=cmd_plot)


def _sweep_commands(sub: Any) -> None:
    sw = sub.add_parser("sweep", help="run a sweep file as one SLURM array job (default: the CPU quickstart sweep)")
    sw.add_argument(
        "sweep", nargs="?", help="sweep YAML file or sweep name (./sweeps/ or built in; default: quickstart)"
    )
    sw.add_argument("--launcher", help="launcher profile name or file instead of the sweep's")
    sw.add_argument("--name", help="run the sweep under another name (its own folder and MLflow experiment)")
    sw.add_argument("--dry-run", action="store_true", help="print the runs and the sbatch script; submit nothing")
    sw.add_argument("--wait", action="store_true", help="follow the submitted jobs with a live progress display")
    sw.add_argument(
        "--throughput",
        metavar="FILE",
        help="measured generation rates for the cost plan: a saved scripts/gpu_check.py output (default: "
        "$ESBATCH_THROUGHPUT, else the built-in table of esbatch/launch/throughput.py)",
    )
    _add_set(sw)
    sw.set_defaults(func=cmd_sweep)

    named = "the sweep ran under this --name"
    st = sub.add_parser("status", help="each run of a sweep: state, progress, last reward")
    st.add_argument("sweep", help="sweep folder, file or name")
    st.add_argument("--name", help=named)
    st.add_argument("--follow", action="store_true", help="live progress until nothing is queued or running")
    st.set_defaults(func=cmd_status)

    ag = sub.add_parser("aggregate", help="tables and plots of a sweep, from MLflow, into <sweep>/results")
    ag.add_argument("sweep", help="sweep folder, file or name")
    ag.add_argument("--name", help=named)
    ag.set_defaults(func=cmd_aggregate)

    ca = sub.add_parser("cancel", help="stop a sweep's queued and running runs (they stay resumable)")
    ca.add_argument("sweep", help="sweep folder, file or name")
    ca.add_argument("--name", help=named)
    ca.set_defaults(func=cmd_cancel)


def _eval_commands(sub: Any) -> None:
    ev = sub.add_parser("eval", help="Pass@1, Pass@K, Maj@K and entropy of a model, run folder or MLflow run")
    ev.add_argument("config", nargs="?", help="eval YAML or built-in name: eval-easy, eval-hard, eval-quick (default)")
    ev.add_argument("--model", help="model alias, HF dir, hub id or .gguf (sets model.name)")
    ev.add_argument("--checkpoint", metavar="RUN_DIR", help="evaluate the final center of a run folder")
    ev.add_argument("--mlflow-run", metavar="RUN_ID", help="evaluate a training run's final center (nested run)")
    ev.add_argument(
        "--at", type=int, metavar="T", help="with --checkpoint: the center after update T (sets checkpoint_update)"
    )
    ev.add_argument("--recompute", metavar="EVAL_DIR", help="re-score saved responses and rebuild the tables")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars (for batch logs)")
    _add_set(ev)
    ev.set_defaults(func=cmd_eval)

    ce = sub.add_parser(
        "center",
        help="the center after update T of a run: ES rebuilds it from theta_0 and the seed log, GRPO copies a snapshot",
    )
    ce.add_argument("run_dir", metavar="RUN_DIR")
    ce.add_argument("--at", type=int, required=True, metavar="T", help="updates the center includes (0 = theta_0)")
    ce.add_argument("--out", metavar="FILE", help="where to write it (default: RUN_DIR/snapshots/center-T.safetensors)")
    ce.set_defaults(func=cmd_center)

    ep = sub.add_parser("eval-plot", help="Pass@K profiles or Pass@1-vs-Pass@K Pareto fronts of eval folders")
    ep.add_argument("eval_dirs", nargs="+", metavar="EVAL_DIR")
    ep.add_argument("--kind", choices=("passk", "pareto"), default="passk")
    ep.add_argument("--k", type=int, default=32, help="K of the Pareto plot's y axis")
    ep.add_argument("--task", default="average", help="task label for the Pareto plot (default: task average)")
    ep.add_argument("-o", "--output", default="passk.png")
    ep.set_defaults(func=cmd_eval_plot)


def _config_commands(sub: Any) -> None:
    v = sub.add_parser("validate", help="check run config, sweep, launcher or eval files without loading any model")
    v.add_argument("files", nargs="*", help="YAML files, or names of built-in ones")
    v.add_argument(
        "--kind", choices=("config", "sweep", "launcher", "eval", "aggregate"), help="the kind (default: detected)"
    )
    v.add_argument("--schema", action="store_true", help="print every key of a kind with its type, default and help")
    _add_set(v)
    v.set_defaults(func=cmd_validate)

    ls = sub.add_parser("ls", help="list algorithms, tasks, models, backends, configs, sweeps and launchers")
    ls.set_defaults(func=cmd_ls)


def _diagnose_commands(sub: Any) -> None:
    d = KappaProtocol()
    dg = sub.add_parser("diagnose", help="estimator diagnostics around a checkpoint (kappa: paper App. E)")
    dsub = dg.add_subparsers(dest="diagnostic", metavar="DIAGNOSTIC", required=True)
    k = dsub.add_parser(
        "kappa",
        help="App. E local subtraction diagnostic: kappa_base and kappa_pair per objective and sigma",
        description="Evaluate objectives at theta + sigma eps, theta, theta - sigma eps and report "
        "kappa_base = Var[J+ - J0]/Var[J+] and kappa_pair = Var[J+ - J-]/Var[J+] (paper App. E, Table 13). "
        "Defaults are Table 13's protocol.",
    )
    k.add_argument("config", help="run config (model, backend, task, generation, reward, grpo) or built-in name")
    k.add_argument(
        "--sigmas", type=float, nargs="+", default=d.sigmas, help="perturbation scales (default: %(default)s)"
    )
    k.add_argument("--objectives", nargs="+", default=d.objectives, metavar="OBJ", help=f"of {', '.join(OBJECTIVES)}")
    k.add_argument(
        "--seed-modes", nargs="+", default=d.seed_modes, metavar="MODE", help=f"regenerated: {', '.join(SEED_MODES)}"
    )
    k.add_argument("--prompts", type=int, default=d.prompts, help="regenerated: prompts (default: %(default)s)")
    k.add_argument("--seeds", type=int, default=d.seeds, help="regenerated: generation seeds (default: %(default)s)")
    k.add_argument(
        "--directions", type=int, default=d.directions, help="regenerated: directions (default: %(default)s)"
    )
    k.add_argument("--fixed-prompts", type=int, default=d.fixed_prompts, help="fixed: prompts (default: %(default)s)")
    k.add_argument(
        "--fixed-seeds", type=int, default=d.fixed_seeds, help="fixed: rollouts per prompt (default: %(default)s)"
    )
    k.add_argument(
        "--fixed-directions", type=int, default=d.fixed_directions, help="fixed: directions (default: %(default)s)"
    )
    k.add_argument(
        "--sst2-examples", type=int, default=d.sst2_examples, help="sst2-ce: examples (default: %(default)s)"
    )
    k.add_argument(
        "--sst2-directions", type=int, default=d.sst2_directions, help="sst2-ce: directions (default: %(default)s)"
    )
    k.add_argument("--supervised-task", default=d.supervised_task, help="task of the CE control (default: %(default)s)")
    k.add_argument("--supervised-data", metavar="FILE", help="local jsonl/parquet (sentence, label) instead of the hub")
    k.add_argument(
        "--score-batch-size", type=int, default=d.score_batch_size, help="sequences per scoring forward pass"
    )
    k.add_argument("-o", "--out", metavar="DIR", help="output folder (default: esbatch-diagnose/kappa-<run.name>)")
    k.add_argument("--no-progress", action="store_true", help="no progress bar (for batch logs)")
    _add_set(k)
    k.set_defaults(func=cmd_diagnose_kappa)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="esbatch", description="ES and GRPO post-training for LLM reasoning.")
    p.add_argument("--version", action="version", version=f"esbatch {esbatch.__version__}")
    p.add_argument("--debug", action="store_true", help="Show the traceback of an error instead of one paragraph.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add in (
        _training_commands,
        _sweep_commands,
        _eval_commands,
        _analysis_commands,
        _config_commands,
        _diagnose_commands,
    ):
        add(sub)
    return p


STORAGE_ADVICE = {
    errno.ENOSPC: "The disk is full: free space (df -h), then resume; nothing already written is lost",
    errno.EDQUOT: "Your disk quota is used up: free space (quota -s), then resume",
    errno.EACCES: "No permission: check the folder's owner and mode (ls -ld), then resume",
    errno.EPERM: "Not permitted (an immutable file? lsattr): clear it (chattr -i) or move the folder, then resume",
    errno.EROFS: "The file system is read-only: put output_dir on a writable one",
}


def storage_message(e: OSError) -> str:
    """One paragraph for an I/O failure: the file, what happened, what to do (`--debug` shows the traceback)."""
    where = e.filename or "a file"
    return f"{where}: {e.strerror or e}. {STORAGE_ADVICE[e.errno]} (--debug shows where it happened)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    debug_was = os.environ.get("ESBATCH_DEBUG")
    if args.debug:  # also for the ranks a run starts: tracking retries print their tracebacks
        os.environ["ESBATCH_DEBUG"] = "1"

    try:
        return args.func(args)
    except (ConfigError, UnknownNameError, FileExistsError, FileNotFoundError, RunFolderError, BackendUnavailable) as e:
        if args.debug:
            raise
        return _err(str(e))
    except (
        ScoringError,
        ModelFileError,
        TrackingStoreError,
        DataFileError,
    ) as e:  # the run stopped; run.json says failed, and why
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in STORAGE_ADVICE or args.debug:
            raise
        print(f"error: {storage_message(e)}", file=sys.stderr)
        return 1
    finally:
        stop.settle()
        if args.debug and debug_was is None:  # main() is called in-process by tests
            os.environ.pop("ESBATCH_DEBUG", None)


if __name__ == "__main__":
    sys.exit(main())
