"""The `esbatch` command line: train, sweep, status, aggregate, eval, eval-plot, validate, ls, plot."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import esbatch
from esbatch.config import RESUME_OVERRIDABLE


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set es.sigma=0.01 (repeatable; values parsed as YAML)",
    )


def cmd_train(args: argparse.Namespace) -> int:
    from esbatch.config import load_config
    from esbatch.es.trainer import train

    if args.resume:
        rd = Path(args.resume)
        if not (rd / "config.yaml").exists():
            print(
                f"error: --resume {rd}: no config.yaml there; give the run directory printed by `esbatch train`",
                file=sys.stderr,
            )
            return 2
        if args.config:
            print("error: give either a CONFIG or --resume RUN_DIR, not both", file=sys.stderr)
            return 2
        fixed = [o for o in args.overrides if o.partition("=")[0].strip() not in RESUME_OVERRIDABLE]
        if fixed:
            print(
                f"error: --set {fixed[0]}: cannot change this on resume (the logged updates depend on it); "
                f"start a new run instead. On resume you may set: {', '.join(sorted(RESUME_OVERRIDABLE))}",
                file=sys.stderr,
            )
            return 2
        cfg = load_config(str(rd / "config.yaml"), args.overrides)
        if args.overrides:
            (rd / "config.yaml").write_text(cfg.to_yaml())
        run_dir = rd
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
    print(
        f"esbatch {esbatch.__version__}: {'resuming' if args.resume else 'training'} {cfg.algorithm} "
        f"on {cfg.task.name} with {cfg.model.name} ({cfg.model.dtype}) -> {run_dir}",
        file=sys.stderr,
    )

    def _terminate(signum: int, frame: object) -> None:  # scancel / kill: stop after this update, mark KILLED
        from esbatch.es.trainer import STOP

        STOP.set()

    signal.signal(signal.SIGTERM, _terminate)
    if cfg.run.nproc_per_node > 1 and "RANK" not in os.environ and cfg.algorithm != "pipeline":
        return _start_ranks(cfg.run.nproc_per_node)
    if cfg.algorithm == "grpo":
        return _train_grpo(cfg, run_dir, args)
    if cfg.algorithm == "pipeline":
        from esbatch.pipeline import run_pipeline

        try:
            s = run_pipeline(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress)
        except KeyboardInterrupt:
            print(f"\ninterrupted. Continue with: esbatch train --resume {run_dir}", file=sys.stderr)
            return 130
        print(f"\ndone: pipeline {' -> '.join(cfg.pipeline.stages)} in {s['run_dir']}")
        for st in s["stages"]:
            print(f"  {st['name']}: {st['run_dir']} (MLflow run {st['mlflow_run_id']})")
        print(f"final weights: {s['center']}; MLflow parent run {s['mlflow_run_id']} in {s['tracking_uri']}")
        return 0
    try:
        s = train(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted. Continue with: esbatch train --resume {run_dir}", file=sys.stderr)
        return 130
    if "rank" in s:  # not rank 0: rank 0 prints the summary
        return 0
    first, last = s["heldout_first"], s["heldout_last"]
    print(f"\ndone: {s['updates']} updates in {s['wall_s']:.0f} s, peak RSS {s['peak_rss_mb']:.0f} MB")
    if first and last:
        print(
            f"held-out greedy accuracy: {first['heldout/accuracy']:.3f} (update {first['t']}) -> "
            f"{last['heldout/accuracy']:.3f} (update {last['t']})"
        )
    print(f"run directory: {s['run_dir']}")
    print(f"MLflow run {s['mlflow_run_id']} (experiment {s['experiment_id']}) in {s['tracking_uri']}")
    if s["tracking_uri"].startswith("sqlite:"):
        print(f"  view it: mlflow ui --backend-store-uri {s['tracking_uri']}")
    return 0


def _start_ranks(n: int) -> int:
    """Re-run this command under torchrun with n ranks (ES: the population is split over them; GRPO: data
    parallel). Exits non-zero when any rank fails; the run folder is then resumable with --resume."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "-m", "esbatch", *sys.argv[1:]]
    print(f"starting {n} ranks: {' '.join(cmd[1:])}", file=sys.stderr)
    rc = subprocess.call(cmd)
    if rc:
        print(
            f"error: a rank failed (exit {rc}); see its traceback above. The run folder is resumable.", file=sys.stderr
        )
    return rc


def _train_grpo(cfg: object, run_dir: Path, args: argparse.Namespace) -> int:
    """GRPO under torchrun (gloo on CPU, NCCL on GPU) or as one process."""
    from esbatch.grpo.trainer import train_grpo

    try:
        s = train_grpo(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted. Continue with: esbatch train --resume {run_dir}", file=sys.stderr)
        return 130
    if s:
        print(f"\ndone: {s['updates']} GRPO steps on {s['world_size']} rank(s) in {s['wall_s']:.0f} s")
        print(f"run directory: {s['run_dir']}")
        print(f"MLflow run {s['mlflow_run_id']} in {s['tracking_uri']}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from esbatch.config import ConfigError, describe, load_config

    if args.schema:
        for key, tp, default, help_ in describe():
            print(f"{key:28s} {tp:16s} default={default!r}\n    {help_}")
        return 0
    if not args.files:
        print("error: give one or more config files (or --schema)", file=sys.stderr)
        return 2
    bad = 0
    for f in args.files:
        try:
            if _is_sweep_file(f):
                from esbatch.launch.sweep import load_sweep

                sw = load_sweep(f, overrides=args.overrides)
                print(f"ok: {f} (sweep {sw.name}: {len(sw.runs)} runs, launcher {sw.launcher})")
                continue
            cfg = load_config(f, args.overrides)
            print(f"ok: {f} ({cfg.algorithm}, task {cfg.task.name}, model {cfg.model.name})")
        except ConfigError as e:
            bad += 1
            print(str(e), file=sys.stderr)
    return 1 if bad else 0


def _is_sweep_file(f: str) -> bool:
    import yaml

    p = Path(f)
    try:
        data = yaml.safe_load(p.read_text()) if p.is_file() else None
    except yaml.YAMLError:
        return False
    return isinstance(data, dict) and bool({"grid", "zip", "seeds", "launcher"} & set(data))


def cmd_ls(args: argparse.Namespace) -> int:
    from esbatch.backends import BACKENDS
    from esbatch.config import builtin_configs
    from esbatch.models import MODELS
    from esbatch.tasks import TASKS

    for title, reg in (("tasks", TASKS), ("models", MODELS), ("backends", BACKENDS)):
        print(f"{title}:")
        for name in reg:
            print(f"  {name:32s} {reg.help(name)}")
    print("built-in configs:")
    for name in builtin_configs():
        print(f"  {name}")
    from esbatch.launch.profile import REPO_ROOT, available_launchers

    print("sweeps:")
    for p in sorted((REPO_ROOT / "sweeps").glob("*.yaml")):
        print(f"  {p.stem}")
    print("launchers:")
    for name in available_launchers():
        print(f"  {name}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from esbatch.aggregate.plots import plot_runs

    missing = [d for d in args.run_dirs if not (Path(d) / "config.yaml").exists()]
    if missing:
        print(f"error: {missing[0]} is not a run directory (no config.yaml)", file=sys.stderr)
        return 2
    print(plot_runs(args.run_dirs, args.output, title=args.title))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from esbatch.launch.submit import submit_sweep
    from esbatch.launch.sweep import load_sweep

    sweep = load_sweep(args.sweep, launcher=args.launcher, overrides=args.overrides)  # validates everything first
    return submit_sweep(sweep, dry_run=args.dry_run, wait=args.wait)


def _sweep_dir(arg: str) -> Path:
    """A sweep folder, or a sweep file / name whose folder is looked up."""
    p = Path(arg)
    if (p / "sweep.json").exists():
        return p
    from esbatch.launch.sweep import load_sweep

    return load_sweep(arg).dir


def cmd_status(args: argparse.Namespace) -> int:
    from esbatch.launch.state import SweepDir
    from esbatch.launch.submit import follow, format_table, run_states

    sd = SweepDir(_sweep_dir(args.sweep))
    if not sd.exists():
        print(
            f"error: {sd.path}: nothing submitted yet (no sweep.json). Submit with: esbatch sweep {args.sweep}",
            file=sys.stderr,
        )
        return 2
    if args.follow:
        follow(sd)
    meta = sd.read()
    print(f"sweep {meta['name']} ({meta['launcher']}, {meta['cluster']}) in {sd.path}")
    print(format_table(run_states(sd)))
    return 0


def cmd_aggregate(args: argparse.Namespace) -> int:
    from esbatch.aggregate.collect import aggregate

    out = aggregate(_sweep_dir(args.sweep))
    print(f"results: {out}")
    for f in sorted(out.glob("*.md")):
        if f.name != "README.md":
            print(f"\n## {f.stem}\n{f.read_text()}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from esbatch.eval.config import load_eval_config
    from esbatch.eval.runner import evaluate

    overrides = list(args.overrides)
    if args.recompute:
        d = Path(args.recompute)
        if not (d / "config.yaml").exists():
            print(f"error: --recompute {d}: not an eval folder (no config.yaml)", file=sys.stderr)
            return 2
        cfg = load_eval_config(str(d / "config.yaml"), overrides)
    else:
        for flag, key in ((args.model, "model.name"), (args.checkpoint, "checkpoint"), (args.mlflow_run, "mlflow_run")):
            if flag:
                overrides.append(f"{key}={flag}")
        cfg = load_eval_config(args.config, overrides)
    s = evaluate(cfg, progress=not args.no_progress, recompute=bool(args.recompute))
    out = Path(cfg.output_dir) / cfg.name
    print((out / "table.md").read_text())
    if s.get("tokens_per_s"):
        print(f"generation: {s['tokens']} tokens in {s['generation_s']:.0f} s = {s['tokens_per_s']:.1f} tokens/s")
    print(f"eval folder: {out}  (samples, table.csv, passk.csv, passk.png)")
    print(f"MLflow run {s['mlflow_run_id']}  ({s['source']})")
    return 0


def cmd_eval_plot(args: argparse.Namespace) -> int:
    from esbatch.eval.plots import plot_pareto, plot_passk

    missing = [d for d in args.eval_dirs if not (Path(d) / "metrics.json").exists()]
    if missing:
        print(f"error: {missing[0]} is not a finished eval folder (no metrics.json)", file=sys.stderr)
        return 2
    if args.kind == "passk":
        print(plot_passk(args.eval_dirs, args.output))
    else:
        print(plot_pareto(args.eval_dirs, args.output, k=args.k, task=args.task))
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    """Per-update FLOPs of ES and GRPO for a config, and the matched setting of the other (App. G.2)."""
    from esbatch.config import load_config
    from esbatch.grpo.flops import format_accounting

    cfg = load_config(args.config, args.overrides)
    params, prompt_tokens = args.params, args.prompt_tokens
    if params is None or prompt_tokens is None:
        from esbatch.backends.hf import HFGenerator
        from esbatch.es.trainer import load_problems
        from esbatch.models import load_model_and_tokenizer

        m = cfg.model
        model, tok = load_model_and_tokenizer(m.name, m.gguf_file, m.revision, "float32", "cpu")
        params = params or sum(p.numel() for p in model.parameters())
        if prompt_tokens is None:
            prompts = load_problems(cfg, HFGenerator(model, tok)).train_prompts[:64]
            prompt_tokens = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts) / len(prompts)
    gen_tokens = args.gen_tokens or cfg.generation.max_new_tokens
    algo = cfg.grpo if cfg.algorithm == "grpo" else cfg.es
    print(
        f"model {cfg.model.name}: P = {params:,} parameters; prompt {prompt_tokens:.0f} tokens, "
        f"generation {gen_tokens:.0f} tokens{' (max_new_tokens: an upper bound)' if not args.gen_tokens else ''}"
    )
    print(
        format_accounting(
            params,
            algo.batch_size,
            prompt_tokens,
            gen_tokens,
            N=cfg.es.population_size,
            G=cfg.grpo.group_size,
            beta=cfg.grpo.beta,
            updates=algo.updates or 1,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="esbatch", description="ES and GRPO post-training for LLM reasoning.")
    p.add_argument("--version", action="version", version=f"esbatch {esbatch.__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="train one config (default: the built-in CPU quickstart)")
    t.add_argument("config", nargs="?", help="YAML file or built-in config name (see `esbatch ls`)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run from its run directory")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (for batch logs)")
    _add_set(t)
    t.set_defaults(func=cmd_train)

    sw = sub.add_parser("sweep", help="run a sweep file as one SLURM array job (default: the CPU quickstart sweep)")
    sw.add_argument("sweep", nargs="?", help="sweep YAML file or name in sweeps/ (default: quickstart)")
    sw.add_argument("--launcher", help="launcher profile (launchers/NAME.yaml) instead of the sweep's")
    sw.add_argument("--dry-run", action="store_true", help="print the runs and the sbatch script; submit nothing")
    sw.add_argument("--wait", action="store_true", help="follow the submitted jobs with a live progress display")
    _add_set(sw)
    sw.set_defaults(func=cmd_sweep)

    st = sub.add_parser("status", help="each run of a sweep: state, progress, last reward")
    st.add_argument("sweep", help="sweep folder, file or name")
    st.add_argument("--follow", action="store_true", help="live progress until nothing is queued or running")
    st.set_defaults(func=cmd_status)

    ag = sub.add_parser("aggregate", help="tables and plots of a sweep, from MLflow, into <sweep>/results")
    ag.add_argument("sweep", help="sweep folder, file or name")
    ag.set_defaults(func=cmd_aggregate)

    ev = sub.add_parser("eval", help="Pass@1, Pass@K, Maj@K and entropy of a model, ES run or MLflow run on tasks")
    ev.add_argument("config", nargs="?", help="eval YAML or built-in name: eval-easy, eval-hard, eval-quick (default)")
    ev.add_argument("--model", help="model alias, HF dir, hub id or .gguf (sets model.name)")
    ev.add_argument("--checkpoint", metavar="RUN_DIR", help="evaluate the final center of an ES run folder")
    ev.add_argument("--mlflow-run", metavar="RUN_ID", help="evaluate a training run's final center (nested run)")
    ev.add_argument("--recompute", metavar="EVAL_DIR", help="re-score saved responses and rebuild the tables")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars (for batch logs)")
    _add_set(ev)
    ev.set_defaults(func=cmd_eval)

    ep = sub.add_parser("eval-plot", help="Pass@K profiles or Pass@1-vs-Pass@K Pareto fronts of eval folders")
    ep.add_argument("eval_dirs", nargs="+", metavar="EVAL_DIR")
    ep.add_argument("--kind", choices=("passk", "pareto"), default="passk")
    ep.add_argument("--k", type=int, default=32, help="K of the Pareto plot's y axis")
    ep.add_argument("--task", default="average", help="task label for the Pareto plot (default: task average)")
    ep.add_argument("-o", "--output", default="passk.png")
    ep.set_defaults(func=cmd_eval_plot)

    fl = sub.add_parser("flops", help="ES vs GRPO FLOPs per update for a config, and the FLOP-matched N or G")
    fl.add_argument("config", nargs="?", help="YAML file or built-in config name")
    fl.add_argument("--params", type=int, help="parameter count (default: load the model and count)")
    fl.add_argument("--prompt-tokens", type=float, help="mean prompt tokens (default: measured on the task)")
    fl.add_argument("--gen-tokens", type=float, help="mean generated tokens (default: max_new_tokens)")
    _add_set(fl)
    fl.set_defaults(func=cmd_flops)

    v = sub.add_parser("validate", help="check config or sweep files without loading any model")
    v.add_argument("files", nargs="*", help="YAML config or sweep files, or built-in config names")
    v.add_argument("--schema", action="store_true", help="print every config key with its type, default and help")
    _add_set(v)
    v.set_defaults(func=cmd_validate)

    pl = sub.add_parser("plot", help="plot held-out accuracy and population reward of run directories")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    pl.add_argument("-o", "--output", default="es-curves.png", help="PNG file to write")
    pl.add_argument("--title", default="ES training")
    pl.set_defaults(func=cmd_plot)

    ls = sub.add_parser("ls", help="list registered tasks, models, backends and built-in configs")
    ls.set_defaults(func=cmd_ls)
    return p


def main(argv: list[str] | None = None) -> int:
    from esbatch.config import ConfigError
    from esbatch.registry import UnknownNameError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (UnknownNameError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
