"""A sweep's cost plan, printed by `esbatch sweep FILE --dry-run` and before `esbatch sweep` submits: per phase
(training, evaluation) and in total, the tokens it will generate, the device-hours those take at the throughput
table's rates (esbatch/launch/throughput.py) and the disk it will write; and a warning for every array task whose
estimate exceeds the launcher profile's time limit. Nothing is loaded or downloaded: parameter counts come from the
model's config on the meta device (esbatch/models.py), else its files' headers, else its model card's figure.

A GRPO run on vLLM adds its weight syncs into the rank's engine (one per generated batch, every parameter in the
engine's dtype) at SYNC_RATES, measured on CPU and assumed on GPUs (labelled so in the plan).

Generated tokens are an upper bound (every response runs to its max_new_tokens; most stop earlier):

    ES run          N x B x max_new_tokens per update (+ (m - 1) x N x B more on es.diversity updates)
    GRPO run        G x B x max_new_tokens per generated batch, ceil(updates / grpo.iterations) batches
    pipeline        its stages', each with its own share of the budget
    in training     at update 0, every eval.every updates and at the end: task.heldout_size greedy responses, and
                    problems x eval.samples per eval.tasks entry
    an eval         per task: problems x (sampling.n + 1 if greedy) x max_new_tokens

An epochs budget becomes updates with the dataset card's training-split size (``Task.train_rows``), and a task's
problems are its ``limit``, else its evaluation split (``Task.eval_rows``; a generated task draws 500). Hours are
generation only, at the table's rate for the model's size class, the backend and the profile's device: ES's
perturb/restore/update, GRPO's forward/backward passes and scoring come on top.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from esbatch.backends.config import resolve_weight_transfer
from esbatch.config.eval import eval_config_from_dict
from esbatch.config.launcher import LauncherProfile
from esbatch.es.config import ESConfig
from esbatch.grpo.config import GRPOConfig
from esbatch.launch.disk import human, planned_updates, run_disk
from esbatch.launch.throughput import Rate, Table, device_kind, load_rates
from esbatch.models import HUB_PREFIX, NOMINAL_PARAMETERS, config_location, meta_parameter_count, parameter_count
from esbatch.pipeline import stage_configs
from esbatch.schema import ConfigError
from esbatch.tasks import TASKS, Task
from esbatch.train.config import TrainConfig

SAMPLE_BYTES_PER_TOKEN = 4  # eval samples: ~4 characters of text per token (assumed), stored as JSON
SAMPLE_OVERHEAD = 100  # bytes per response besides its text (n_tokens, entropy, verdict, key)
PROBLEM_BYTES = 1000  # bytes per problem row besides its responses (question, gold)
LOG_BYTES = (1000, 150)  # log.jsonl per update: a record, plus per ES member (seed, sign, reward, z, weight)
# GB/s (2^30 bytes) of a GRPO weight sync into the rank's vLLM engine, by device kind and transport (the engine in
# the rank's process, else backend.weight_transfer: esbatch/backends/config.py:resolve_weight_transfer)
SYNC_RATES = {
    ("cpu", "in_process"): (11.2, "measured on CPU, SmolLM2 fp32: benchmarks/grpo_step_split.py, 2026-12-06"),
    ("cpu", "rpc"): (0.26, "measured on CPU, SmolLM2 fp32: benchmarks/grpo_step_split.py, 2026-12-06"),
    ("gpu", "in_process"): (25.0, "assumed, not run on a GPU: verl copied Qwen2.5-7B bf16 in process in 0.55 s"),
    ("gpu", "rpc"): (0.3, "assumed, not run on a GPU: packed bytes through collective_rpc, as on CPU"),
    ("gpu", "ipc"): (18.0, "assumed, not run on a GPU: verl sent Qwen2.5-7B bf16 over NCCL in 0.79 s"),
}
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


@dataclass
class Work:
    """One array task of the plan: a run's training or one eval."""

    key: str
    label: str
    phase: str  # training | evaluation
    model: str
    params: int | None
    backend: str
    parts: list[tuple[str, int]] = field(default_factory=list)  # (what, generated tokens at most)
    disk: int = 0
    unknown: str | None = None  # why the token count is not known
    rate: Rate | None = None
    sync: tuple[str, float] | None = None  # GRPO on vLLM: (what, device-seconds) of its weight syncs

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def seconds(self) -> float | None:
        """Device-seconds of generation at the table's rate; None without a rate or a token count."""
        if self.rate is None or self.unknown:
            return None
        return self.tokens / self.rate.tokens_per_s + (self.sync[1] if self.sync else 0.0)


@dataclass
class Plan:
    work: list[Work]
    device: str  # cpu, h100, a100, ...
    devices_per_task: int
    profile: LauncherProfile
    launcher: str

    def phase(self, name: str) -> list[Work]:
        return [w for w in self.work if w.phase == name]


# ----------------------------------------------------------------------------- counts


def problems(task_name: str, limit: int | None, data_path: str | None = None) -> int | None:
    """Problems an eval of a task scores: ``limit`` (at most the split), the split (the hub's default one; a local
    ``data_path`` is not read: unknown), or 500 for a generated task."""
    cls: type[Task] = TASKS.get(task_name)
    rows = None if data_path else cls.eval_rows
    if rows is None and cls.eval_examples is Task.eval_examples:  # generated: draws limit or default_eval_size
        rows = limit or cls.default_eval_size
    if rows is None:
        return limit
    return min(limit, rows) if limit else rows


def eval_points(updates: int, every: int) -> int:
    """In-training evaluations: after update 0, every ``every`` updates, and at the end."""
    return len({0, updates, *range(every, updates + 1, every)} if every else {0, updates})


def training_parts(cfg: TrainConfig) -> tuple[list[tuple[str, int]], str | None]:
    """(what, generated tokens at most) of one run config (a pipeline: its stages'), or why it is not known."""
    if cfg.algorithm == "pipeline":
        parts: list[tuple[str, int]] = []
        for rd, sc in stage_configs(cfg, Path(cfg.run.output_dir) / cfg.run.name, None):
            sub, why = training_parts(sc)
            if why:
                return [], f"{rd.path.name}: {why}"
            parts += [(f"{rd.path.name} {what}", n) for what, n in sub]
        return parts, None
    U = planned_updates(cfg)
    if U is None:
        return [], f"the size of {cfg.task.name}'s training split, so the updates of its epochs budget, is unknown"
    L = cfg.generation.max_new_tokens
    parts = []
    if cfg.algorithm == "grpo":
        g = cfg.section(GRPOConfig)
        batches = cfg.algo().data_batches(cfg, U)
        parts.append(
            (
                f"rollouts G={g.group_size} x B={g.batch_size} x {batches} batches x {L}",
                g.group_size * g.batch_size * batches * L,
            )
        )
    elif cfg.algorithm == "es":
        es = cfg.section(ESConfig)
        N, B = es.population_size, es.batch_size
        parts.append((f"rollouts N={N} x B={B} x {U} updates x {L}", N * B * U * L))
        d = es.diversity
        if d.every and d.samples > 1:
            k = len(range(0, U, d.every))
            parts.append(
                (f"diversity ({d.samples - 1} more) x N x B x {k} updates x {L}", (d.samples - 1) * N * B * k * L)
            )
    else:
        return [], f"algorithm {cfg.algorithm}: its generation is not planned here"
    ev, Le = cfg.eval, cfg.eval.max_new_tokens or L
    k = eval_points(U, ev.every)
    if cfg.task.heldout_size:
        parts.append((f"held-out {cfg.task.heldout_size} x {k} evals x {Le}", cfg.task.heldout_size * k * Le))
    for et in ev.tasks:
        n = problems(et.name, et.limit, et.data_path)
        if n is None:
            return [], f"eval.tasks {et.label or et.name}: its problem count is unknown (give it a limit)"
        Lt = et.max_new_tokens or Le
        parts.append(
            (f"eval.tasks {et.label or et.name} {n} x {ev.samples} x {k} evals x {Lt}", n * ev.samples * k * Lt)
        )
    return parts, None


def weight_syncs(cfg: TrainConfig, params: int | None, device: str, devices: int = 1) -> tuple[str, float] | None:
    """(what, device-seconds) of a GRPO run's weight syncs into its vLLM engines: one per generated batch on each
    of ``devices``, every parameter in the engine's dtype (fp32 on CPU), at SYNC_RATES by the transport the run
    resolves to on ``device``; None for other runs."""
    if cfg.algorithm != "grpo" or cfg.backend.name != "vllm" or params is None:
        return None
    U = planned_updates(cfg)
    if U is None:
        return None
    batches = cfg.algo().data_batches(cfg, U)
    kind = "cpu" if device == "cpu" else "gpu"
    b = cfg.backend
    try:
        transport = resolve_weight_transfer(b.weight_transfer, b.policy_engine, on_gpu=kind == "gpu")
    except ValueError:  # ipc on a CPU plan: the sweep refuses it (launch/sweep.py:engine_errors)
        return None
    gbps, source = SYNC_RATES[kind, transport]
    nbytes = params * (4 if kind == "cpu" else DTYPE_BYTES.get(cfg.model.dtype, 2))
    what = f"weight syncs {batches} x {human(nbytes)} at {gbps:g} GB/s ({transport}; {source})"
    return what, devices * batches * nbytes / (gbps * 2**30)


def eval_parts(config: dict[str, Any]) -> tuple[list[tuple[str, int]], int, str | None]:
    """(what, generated tokens at most) of one planned eval, the bytes of its samples, or why not known."""
    cfg = eval_config_from_dict({k: v for k, v in config.items() if k != "checkpoint"})
    s, parts, disk = cfg.sampling, [], 0
    per = s.n + (1 if s.greedy else 0)
    for et in cfg.task_list():
        n = problems(et.name, et.limit, et.data_path)
        label = et.label or et.name
        if n is None:
            return [], 0, f"task {label}: its problem count is unknown (give it a limit)"
        L = et.max_new_tokens or s.max_new_tokens
        parts.append((f"{label} {n} x {per} x {L}", n * per * L))
        disk += n * (PROBLEM_BYTES + per * (SAMPLE_OVERHEAD + SAMPLE_BYTES_PER_TOKEN * L))
    return parts, disk, None


# ----------------------------------------------------------------------------- the plan


class Counts:
    """Parameter counts, one per model, each with how it was found."""

    def __init__(self) -> None:
        self.known: dict[tuple[str, str | None, str | None], tuple[int | None, str]] = {}

    def __call__(self, name: str, gguf_file: str | None = None, revision: str | None = None) -> int | None:
        key = (name, gguf_file, revision)
        if key not in self.known:
            self.known[key] = planned_parameters(name, gguf_file, revision)
        return self.known[key][0]


def planned_parameters(name: str, gguf_file: str | None = None, revision: str | None = None) -> tuple[int | None, str]:
    """(parameter count, how it was found), fetching nothing: the config on the meta device, else the weight files'
    headers, else the model card's figure (NOMINAL_PARAMETERS); (None, why) when none is on this machine."""
    if not name.startswith(HUB_PREFIX):
        if _a_gguf_file(name, gguf_file, revision):  # its tensor table reads in milliseconds, its config in seconds
            n = parameter_count(name, gguf_file, revision)
            if n is not None:
                return n, "from its files' headers"
        try:
            return meta_parameter_count(name, gguf_file, revision, local_only=True), "from its config, meta device"
        except (OSError, ValueError, KeyError, ImportError):
            pass
        n = parameter_count(name, gguf_file, revision)
        if n is not None:
            return n, "from its files' headers"
    if name in NOMINAL_PARAMETERS:
        return NOMINAL_PARAMETERS[name], "as its model card gives it: not on this machine yet"
    return None, "unknown: its config is not on this machine"


def _a_gguf_file(name: str, gguf_file: str | None, revision: str | None) -> bool:
    """Whether the model's config would be read from a GGUF file (no dequantized copy yet)."""
    try:
        return "gguf_file" in config_location(name, gguf_file, revision)[1]
    except (OSError, ValueError):
        return False


def plan_sweep(
    sweep: Any,
    runs: list[Any] | None = None,
    evals: list[Any] | None = None,
    table: Table | None = None,
    counts: Counts | None = None,
) -> Plan:
    """The plan of ``runs`` and ``evals`` (default: every run and eval of the sweep)."""
    table, counts = table or Table(), counts or Counts()
    prof = sweep.profile
    device = device_kind(prof, sweep.launcher)
    plan = Plan([], device, max(1, prof.gpus_per_node * prof.nodes) if device != "cpu" else 1, prof, sweep.launcher)
    for r in sweep.runs if runs is None else runs:
        m = r.config.model
        params = counts(m.name, m.gguf_file, m.revision)
        parts, why = training_parts(r.config)
        w = Work(r.key, r.label, "training", m.name, params, r.config.backend.name, parts, unknown=why)
        if params is not None:
            U = planned_updates(r.config) or 0
            N = r.config.section(ESConfig).population_size if r.config.algorithm != "grpo" else 0
            w.disk = run_disk(r.config, params).total + U * (LOG_BYTES[0] + LOG_BYTES[1] * N)
        w.rate = table.get(params, w.backend, device)
        w.sync = weight_syncs(r.config, params, device, plan.devices_per_task)
        plan.work.append(w)
    for e in sweep.evals if evals is None else evals:
        model = e.config.get("model") or {}
        name = model.get("name", "")
        params = counts(name, model.get("gguf_file"), model.get("revision"))
        if params is None and e.point.get("model.name"):  # a released checkpoint tabulated as its base model
            params = counts(e.point["model.name"])
        parts, disk, why = eval_parts(e.config)
        backend = (e.config.get("backend") or {}).get("name", "hf")
        w = Work(e.key, e.label, "evaluation", name, params, backend, parts, disk, why)
        if e.tau and params:  # the thresholded checkpoint it writes first: an fp32 center
            w.disk += 4 * params
        w.rate = table.get(params, backend, device)
        plan.work.append(w)
    return plan


# ----------------------------------------------------------------------------- what is printed


def count(n: float) -> str:
    """Tokens in short form: 950, 12.3k, 490.7M, 1.2B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def hours(seconds: float) -> str:
    h = seconds / 3600
    return f"{h:.2f}" if h < 10 else f"{h:.1f}"


def _name(w: Work) -> str:
    """The task's label, and its model unless the label names it."""
    return w.label if w.model in w.label else f"{w.label}, {w.model}"


def time_warnings(plan: Plan) -> list[str]:
    """One line per array task whose estimate exceeds the profile's time limit (SLURM profiles only: the local
    launcher has none). Equal to the limit does not warn."""
    prof = plan.profile
    if prof.cluster != "slurm":
        return []
    limit = prof.time_minutes() * 60
    out = []
    for w in plan.work:
        if w.seconds is None or w.seconds / plan.devices_per_task <= limit:
            continue
        what = "run" if w.phase == "training" else "eval"
        out.append(
            f"warning: {what} {w.key} ({_name(w)}): about {hours(w.seconds / plan.devices_per_task)} h on "
            f"{plan.devices_per_task} {plan.device}, over the time limit {prof.time} of launcher profile "
            f"{plan.launcher} (`time`)"
        )
    if out:
        out.append(
            f"(a task over the limit is stopped there, checkpoints and is requeued, at most {prof.max_requeues} times "
            "(max_requeues): raise `time` in launcher_overrides, or shorten it)"
        )
    return out


def format_plan(plan: Plan, detail: bool = True) -> list[str]:
    """The plan as lines: per task (``detail``), per phase and in total, the rates used, the time-limit warnings."""
    unit = "CPU-h" if plan.device == "cpu" else "GPU-h"
    per = f", {plan.devices_per_task} GPU(s) per task" if plan.device != "cpu" else ""
    lines = [
        f"cost plan (device {plan.device}{per}; tokens generated at most: every response at its max_new_tokens; "
        f"{unit}: generation only, at the rates below):"
    ]
    if detail:
        for w in plan.work:
            kind = "run " if w.phase == "training" else "eval"
            if w.unknown:
                lines.append(f"  {kind} {w.key}  {_name(w)}: tokens unknown: {w.unknown}")
                continue
            h = f"{hours(w.seconds)} {unit}" if w.seconds is not None else f"? {unit}"
            parts = "; ".join(f"{what} = {count(n)}" for what, n in w.parts)
            if w.sync:
                parts += f"; {w.sync[0]} = {w.sync[1]:.0f} s"
            lines.append(f"  {kind} {w.key}  {_name(w)}: {count(w.tokens)} tokens, {h}, disk {human(w.disk)} ({parts})")
    rows = [("phase", "tokens (at most)", unit, "disk")]
    for name in ("training", "evaluation", "total"):
        work = plan.work if name == "total" else plan.phase(name)
        if not work and name != "total":
            continue
        known = [w for w in work if not w.unknown]
        timed = [w.seconds for w in known if w.seconds is not None]
        n_unknown, n_untimed = len(work) - len(known), len(known) - len(timed)
        tok = count(sum(w.tokens for w in known)) + (f" (+ {n_unknown} unknown)" if n_unknown else "")
        hrs = hours(sum(timed)) + (f" (+ {n_untimed} without a rate)" if n_untimed else "")
        rows.append((name, tok, hrs, human(sum(w.disk for w in work))))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  " + "  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip() for r in rows]
    used = {(w.rate.size, w.rate.backend, w.rate.device): w.rate for w in plan.work if w.rate}
    for r in used.values():
        lines.append(f"  rate {r.backend} {r.size} {r.device}: {r.tokens_per_s:g} tokens/s ({r.source})")
    missing = sorted({(w.backend, w.model) for w in plan.work if w.rate is None and not w.unknown})
    for backend, model in missing:
        lines.append(f"  no rate for {model} on {backend} ({plan.device}): its hours are not counted")
    return lines + ["  " + w for w in time_warnings(plan)]


def load_table(path: str | None = None) -> Table:
    """The built-in rates, with the measured ones of ``path`` (else $ESBATCH_THROUGHPUT) over them."""
    path = path or os.environ.get("ESBATCH_THROUGHPUT")
    if not path:
        return Table()
    try:
        rates = load_rates(path, lambda name: planned_parameters(name)[0])
    except (OSError, ValueError) as e:
        raise ConfigError([f"throughput file: {e}"]) from None
    return Table().with_measurements(rates)


def print_plan(
    sweep: Any,
    out: Any,
    runs: list[Any] | None = None,
    evals: list[Any] | None = None,
    table: Table | None = None,
    detail: bool = True,
) -> Plan:
    """Print the plan of ``runs`` and ``evals`` (default: the whole sweep); returns it."""
    plan = plan_sweep(sweep, runs, evals, table)
    print("\n" + "\n".join(format_plan(plan, detail)), file=out)
    return plan
