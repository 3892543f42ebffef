"""`esbatch eval`: n sampled responses per problem (plus an optional greedy one), scored, saved, summarized.

The eval folder (``<output_dir>/<name>/``) holds ``config.yaml``, ``samples/<task>.jsonl`` (one line per
problem: every response with its tokens, entropy, verdict and normalized answer), ``metrics.json``,
``table.csv`` / ``table.md`` (x100, like the paper's Tables 2, 3, 5) and ``passk.csv`` (Pass@K for K = 1..n).
Samples are appended chunk by chunk (fsynced), so a killed eval continues where it stopped, and
``esbatch eval --recompute DIR`` re-scores and re-tabulates without generating again.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from esbatch import durable
from esbatch.backends import BACKENDS
from esbatch.config import flatten, load_run_config
from esbatch.config.eval import EvalConfig, EvalTask
from esbatch.eval.center import center_at, newest_t, stored_center
from esbatch.eval.plots import plot_passk
from esbatch.metrics import pass_at_k
from esbatch.tasks import TASKS
from esbatch.tasks.base import Example
from esbatch.tracking import MLflowTracker, default_tracking_uri, run_tags
from esbatch.train import stop
from esbatch.train.config import TrainConfig
from esbatch.train.lock import writer_lock
from esbatch.train.rundir import RunDir, RunFolderError, read_jsonl
from esbatch.train.taskeval import few_shot_demos, score_responses, task_metrics  # shared with in-training evals


@dataclass
class WeightsSource:
    """What is evaluated: a model (alias/dir/hub id/gguf), optionally an ES center on top, and the
    training run to nest the eval's MLflow run under."""

    model: Any
    center: Path | None = None
    parent_uri: str | None = None
    parent_run_id: str | None = None
    description: str = ""
    replay: tuple[RunDir, int] | None = None  # (run, t): an ES center rebuilt from the log when the model is built


def resolve_weights(cfg: EvalConfig) -> WeightsSource:
    if cfg.mlflow_run:
        return _from_mlflow(cfg)
    if cfg.checkpoint:
        rd = RunDir(cfg.checkpoint)
        train_cfg = load_run_config(rd.path)  # its es.noise rebuilds its centers
        meta = rd.read_meta()
        if cfg.checkpoint_update is not None:
            center, what = _center_after(rd, train_cfg, cfg.checkpoint_update)
            what = f"{_label(meta.get('algorithm', train_cfg.algorithm))} {what}"
            return WeightsSource(train_cfg.model, center, meta.get("tracking_uri"), meta.get("mlflow_run_id"), what)
        return _final_weights(rd, train_cfg, meta)
    return WeightsSource(cfg.model, description=f"base model {cfg.model.name}")


def _final_weights(rd: RunDir, train_cfg: TrainConfig, meta: dict[str, Any]) -> WeightsSource:
    """A run's final weights by its checkpoint.center: center.safetensors; else final_model/ (the compute-dtype
    export) when it holds the last logged update; else (ES) the center rebuilt from the log."""

    label = _label(meta.get("algorithm", train_cfg.algorithm))
    uri, run_id = meta.get("tracking_uri"), meta.get("mlflow_run_id")
    if not rd.center.exists() and train_cfg.algorithm != "es":
        raise FileNotFoundError(f"{rd.path}: no {RunDir.CENTER} yet (the run has not saved a checkpoint)")
    t = newest_t(rd, train_cfg.algorithm)  # a damaged center is named now (RunFolderError), not in the loader
    if rd.center.exists():
        return WeightsSource(train_cfg.model, rd.center, uri, run_id, f"{label} center of {rd.path}")
    if rd.export_t() == t:
        folder = {"name": str(rd.final_model), "gguf_file": None, "revision": None, "init_weights": None}
        model = type(train_cfg.model)(**{**train_cfg.model.__dict__, **folder})
        return WeightsSource(model, None, uri, run_id, f"{label} final model of {rd.path} ({model.dtype}, update {t})")
    what = f"{label} center of {rd.path} (rebuilt from its log, update {t})"
    return WeightsSource(train_cfg.model, None, uri, run_id, what, replay=(rd, t))


def _center_after(rd: RunDir, train_cfg: TrainConfig, t: int) -> tuple[Path, str]:
    """The file holding run ``rd``'s center after ``t`` updates (ES: rebuilt from the log when not kept)."""

    try:
        return stored_center(rd, t, train_cfg.algorithm), f"center after update {t} of {rd.path}"
    except RunFolderError:
        if train_cfg.algorithm != "es":
            raise
    return center_at(rd.path, t), f"center after update {t} of {rd.path} (rebuilt from its log)"


def _label(algorithm: str) -> str:
    return {"es": "ES", "grpo": "GRPO"}.get(algorithm, algorithm)


def _from_mlflow(cfg: EvalConfig) -> WeightsSource:
    """A training run id: use its run folder when it is on this machine, else its final_model artifact."""
    from mlflow.tracking import MlflowClient

    uri = cfg.tracking.uri or "sqlite:///esbatch-runs/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(cfg.mlflow_run)
    p = run.data.params
    rd = RunDir(Path(p.get("run.output_dir", "")) / p.get("run.name", ""))
    if rd.center.exists() or (rd.exists() and rd.updates_logged()):  # ES without a center: rebuilt from its log
        train_cfg = load_run_config(rd.path)  # its es.noise rebuilds its centers
        if rd.center.exists() or train_cfg.algorithm == "es":
            meta = {"algorithm": p.get("algorithm", "es"), "tracking_uri": uri, "mlflow_run_id": cfg.mlflow_run}
            return _final_weights(rd, train_cfg, meta)
    names = {a.path for a in client.list_artifacts(cfg.mlflow_run)}
    if RunDir.FINAL_MODEL not in names:
        raise FileNotFoundError(
            f"MLflow run {cfg.mlflow_run}: its run folder {rd} is not here and it has no final_model artifact "
            f"(train with tracking.log_model: true, or give checkpoint: RUN_FOLDER)"
        )
    local = client.download_artifacts(cfg.mlflow_run, RunDir.FINAL_MODEL, str(Path(cfg.output_dir) / cfg.name))
    model = type(cfg.model)(**{**cfg.model.__dict__, "name": local, "gguf_file": None})
    return WeightsSource(model, None, uri, cfg.mlflow_run, f"final_model of MLflow run {cfg.mlflow_run}")


def build_generator(cfg: EvalConfig, src: WeightsSource) -> Any:
    """The configured backend's generator for ``src`` (the base model, plus a run's center if given)."""

    backend = BACKENDS.get(cfg.backend.name)
    if src.replay is None:
        return backend.for_inference(src.model, src.center, cfg.sampling.batch_size, cfg.backend)
    rd, t = src.replay
    tmp = rd.path / f".center-rebuilt-{t}.tmp{os.getpid()}.safetensors"  # read once by the loader, then deleted
    try:
        return backend.for_inference(src.model, center_at(rd.path, t, tmp), cfg.sampling.batch_size, cfg.backend)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- the eval folder


class EvalDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / "config.yaml"
        self.samples = self.path / "samples"

    def sample_file(self, label: str) -> Path:
        return self.samples / f"{label.replace('/', '_')}.jsonl"

    def _scan(self, label: str) -> tuple[list[dict[str, Any]], int]:
        """(rows, bytes of complete lines) up to the first torn or corrupt line. Reads only."""
        return read_jsonl(self.sample_file(label))

    def read_samples(self, label: str) -> list[dict[str, Any]]:
        """The complete rows; never changes the file (tables and --recompute only read)."""
        return self._scan(label)[0]

    def repair(self, label: str) -> list[dict[str, Any]]:
        """Before appending: cut a torn tail left by a killed eval so the file stays valid JSONL."""
        rows, good = self._scan(label)
        f = self.sample_file(label)
        if f.exists() and good != f.stat().st_size:
            with open(f, "r+b") as fh:
                fh.truncate(good)
        return rows

    def append(self, label: str, rows: list[dict[str, Any]]) -> None:
        self.samples.mkdir(parents=True, exist_ok=True)
        with open(self.sample_file(label), "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())


def chunk_seed(seed: int, label: str, start: int) -> int:
    """The generation seed of a task's chunk of problems from ``start`` on: the same on every rerun and backend."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{label}/{start}".encode(), digest_size=4).digest(), "little")


def run_task(cfg: EvalConfig, et: EvalTask, gen: Any, ed: EvalDir, progress: bool = True) -> dict[str, Any]:
    """Generate and score every problem of one task not yet in its samples file; returns throughput."""
    from esbatch.clock import progress as tqdm  # monotonic: a clock jump moves no ETA

    label = et.label or et.name
    task = TASKS.get(et.name)(et.data_path, **et.params)
    exs = task.eval_examples(et.limit, cfg.sampling.seed)
    if et.limit:
        exs = exs[: et.limit]
    demos = few_shot_demos(task, et.few_shot, exs, cfg.sampling.seed)
    from esbatch.backends.base import SamplingParams  # heavy: torch

    s = cfg.sampling
    max_new = et.max_new_tokens or s.max_new_tokens
    sampled = SamplingParams(s.temperature, s.top_p, max_new, n=s.n, entropy=True)
    greedy = SamplingParams(0.0, 1.0, max_new, n=1, entropy=True)
    per_chunk = max(1, s.batch_size // s.n) * 4  # fixed chunk boundaries keep resumed evals reproducible
    done = {r["i"] for r in ed.repair(label)}
    workers = cfg.score_workers or os.cpu_count() or 1
    tokens, gen_s = 0, 0.0
    bar = tqdm(total=len(exs), initial=len(done), desc=label, unit="prob", disable=not progress, dynamic_ncols=True)
    for start in range(0, len(exs), per_chunk):
        stop.check()  # a signal asked to stop: between chunks (every finished chunk is already on disk)
        idx = [i for i in range(start, min(start + per_chunk, len(exs))) if i not in done]
        if not idx:
            continue
        chunk = [exs[i] for i in idx]
        prompts = [gen.chat_prompt(task.messages(ex, demos, None)) for ex in chunk]
        t0 = time.perf_counter()
        gens = gen.generate(prompts, sampled, chunk_seed(s.seed, label, start))
        greedy_gens = gen.generate(prompts, greedy, 0) if s.greedy else []
        gen_s += time.perf_counter() - t0
        tokens += sum(g.n_tokens for g in gens) + sum(g.n_tokens for g in greedy_gens)
        texts = [g.text for g in gens] + [g.text for g in greedy_gens]
        owners = [ex for ex in chunk for _ in range(s.n)] + chunk[: len(greedy_gens)]
        verdicts, keys = score_responses(task, texts, owners, workers)
        f1 = [task.f1(t, ex) for t, ex in zip(texts, owners)] if hasattr(task, "f1") else None  # HotpotQA
        scored = [_sample(g, v, k) for g, v, k in zip([*gens, *greedy_gens], verdicts, keys)]
        for j, f in enumerate(f1[: len(gens)] if f1 is not None else []):
            scored[j]["f1"] = f
        rows = []
        for j, (i, ex) in enumerate(zip(idx, chunk)):
            row = {"i": i, "question": ex.question, "gold": ex.answer, "samples": scored[j * s.n : (j + 1) * s.n]}
            if greedy_gens:
                row["greedy"] = scored[len(gens) + j]
            rows.append(row)
        ed.append(label, rows)
        bar.update(len(idx))
        bar.set_postfix({"tok/s": f"{tokens / max(gen_s, 1e-9):.1f}"})
    bar.close()
    return {"tokens": tokens, "generation_s": gen_s}


def _sample(g: Any, verdict: str, key: str | None) -> dict[str, Any]:
    return {"text": g.text, "n_tokens": g.n_tokens, "entropy": g.entropy, "verdict": verdict, "key": key}


def rescore(cfg: EvalConfig, et: EvalTask, ed: EvalDir) -> list[dict[str, Any]]:
    """Re-run the verifier over saved responses (after a verifier fix); returns the re-scored rows.

    The samples file stays as generation left it: the new verdicts go into the tables only."""
    label = et.label or et.name
    task = TASKS.get(et.name)(et.data_path, **et.params)
    rows = ed.read_samples(label)
    by_i = {i: ex for i, ex in enumerate(task.eval_examples(et.limit, cfg.sampling.seed))}
    texts, owners, where = [], [], []
    for r in rows:
        ex = by_i.get(r["i"]) or Example(r["question"], r["gold"])
        for m, smp in enumerate(r["samples"]):
            texts.append(smp["text"]), owners.append(ex), where.append((r, m))
        if "greedy" in r:
            texts.append(r["greedy"]["text"]), owners.append(ex), where.append((r, -1))
    verdicts, keys = score_responses(task, texts, owners, cfg.score_workers or os.cpu_count() or 1)
    f1 = [task.f1(t, ex) for t, ex in zip(texts, owners)] if hasattr(task, "f1") else None
    for j, ((r, m), v, k) in enumerate(zip(where, verdicts, keys)):
        target = r["greedy"] if m == -1 else r["samples"][m]
        target["verdict"], target["key"] = v, k
        if f1 is not None and m != -1:
            target["f1"] = f1[j]
    return rows


# ----------------------------------------------------------------------------- metrics and tables


def passk_curve(rows: list[dict[str, Any]]) -> list[float]:
    """Mean unbiased Pass@K over problems for K = 1..n."""
    if not rows:
        return []
    n = len(rows[0]["samples"])
    cs = [sum(smp["verdict"] == "correct" for smp in r["samples"]) for r in rows]
    return [sum(pass_at_k(n, c, k) for c in cs) / len(cs) for k in range(1, n + 1)]


def columns(ks: list[int], n: int, greedy: bool) -> list[str]:
    cols = ["pass@1"] + [f"pass@{k}" for k in ks if 1 < k <= n] + [f"maj@{k}" for k in ks if 1 < k <= n]
    return cols + (["greedy"] if greedy else []) + ["entropy"]


def task_average(results: dict[str, dict[str, float]], cols: list[str]) -> tuple[dict[str, float], dict[str, int]]:
    """({column: mean over the tasks that have it}, {column: how many tasks that is}); a column no task has is
    left out. F1 exists only for HotpotQA: its average is HotpotQA's F1 (n=1), never F1 summed / every task."""
    avg, n = {}, {}
    for c in cols:
        vals = [r[c] for r in results.values() if c in r]
        if vals:
            avg[c], n[c] = sum(vals) / len(vals), len(vals)
    return avg, n


def write_tables(
    ed: EvalDir, results: dict[str, dict[str, float]], cols: list[str], title: str
) -> tuple[dict[str, float], dict[str, int]]:
    """table.csv / table.md: tasks x metrics (x100 except entropy), plus the average over tasks.

    The average of a column is over the tasks that have that column (:func:`task_average`). table.md labels
    the row "Average (N tasks)" and marks a cell averaged over fewer tasks "(n=k)"; table.csv follows the
    "Average" row with an "Average n" row holding each column's task count (and the problems summed).
    Returns the averages and counts."""

    avg, n_avg = task_average(results, cols)
    problems = sum(int(r.get("problems", 0)) for r in results.values())
    with durable.open_text(ed.path / "table.csv", newline="") as f:
        w = csv.writer(f)
        w.writerow(["task", *cols, "problems"])
        for name, r in [*results.items(), ("Average", avg)]:
            w.writerow([name, *(f"{r.get(c, float('nan')):.6f}" for c in cols), r.get("problems", "")])
        w.writerow(["Average n", *(n_avg.get(c, 0) for c in cols), problems])

    def fmt(c: str, v: float | None) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" if c == "entropy" else f"{100 * v:.1f}"

    head = [
        c.replace("pass@", "Pass@")
        .replace("maj@", "Maj@")
        .replace("greedy", "Greedy")
        .replace("entropy", "Entropy (nats)")
        .replace("f1", "F1")
        for c in cols
    ]
    lines = [f"# {title}", "", "| Task | " + " | ".join(head) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(fmt(c, r.get(c)) for c in cols) + " |")
    if results:
        cells = []
        for c in cols:
            cell = "-" if c not in avg else f"**{fmt(c, avg[c])}**"
            cells.append(cell + (f" (n={n_avg[c]})" if c in avg and n_avg[c] < len(results) else ""))
        label = f"**Average** ({len(results)} task{'s' if len(results) != 1 else ''})"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Values x100 (entropy in nats). Pass@K is the unbiased estimator; Maj@K votes over the first K "
        "responses' normalized answers (no answer = abstain; ties go to the answer seen first). "
        "Average: the mean over the tasks that have the column; (n=k) marks a column only k tasks have "
        "(F1: HotpotQA).",
    ]
    durable.write_text(ed.path / "table.md", "\n".join(lines) + "\n")
    return avg, n_avg


def summarize(
    cfg: EvalConfig, ed: EvalDir, source: str = "", rescored: dict[str, list[dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """Tables, Pass@K curve and metrics.json from the samples (or from ``rescored`` rows, by label)."""
    results, curves = {}, {}
    for et in cfg.task_list():
        label = et.label or et.name
        rows = rescored[label] if rescored is not None else ed.read_samples(label)
        if rows:
            results[label] = task_metrics(rows, cfg.ks)
            curves[label] = passk_curve(rows)
    cols = columns(cfg.ks, cfg.sampling.n, cfg.sampling.greedy)
    if any("f1" in r for r in results.values()):
        cols.insert(cols.index("entropy"), "f1")
    average, average_n = write_tables(ed, results, cols, f"{cfg.name}: {source or cfg.model.name}")
    with durable.open_text(ed.path / "passk.csv") as f:
        f.write("task,k,pass_at_k\n")
        for label, curve in curves.items():
            for k, v in enumerate(curve, 1):
                f.write(f"{label},{k},{v:.6f}\n")
    summary = {
        "tasks": results,
        "average": average,  # each column's mean over the tasks that have it
        "average_n": average_n,  # and how many tasks that is
        "columns": cols,
        "n": cfg.sampling.n,
        "name": cfg.name,
    }
    durable.write_text(ed.path / "metrics.json", json.dumps(summary, indent=1))
    return summary


def evaluate(cfg: EvalConfig, *, progress: bool = True, recompute: bool = False) -> dict[str, Any]:
    """Run (or continue, or only re-score) an eval; logs to MLflow; returns the summary."""
    src = resolve_weights(cfg)  # a missing or damaged checkpoint is named before anything is written
    ed = EvalDir(Path(cfg.output_dir) / cfg.name)
    with writer_lock(ed.path, "eval folder"):  # one writer: a second eval of this folder exits 2 naming the first
        return _evaluate(cfg, ed, src, progress, recompute)


def _evaluate(cfg: EvalConfig, ed: EvalDir, src: WeightsSource, progress: bool, recompute: bool) -> dict[str, Any]:
    if not recompute:  # --recompute reads the folder's own config and leaves its inputs as they are
        durable.write_text(ed.config, _yaml(cfg.to_dict()))
    throughput: dict[str, dict[str, float]] = {}
    rescored = None
    t0 = time.perf_counter()
    if recompute:
        rescored = {et.label or et.name: rescore(cfg, et, ed) for et in cfg.task_list()}
    else:
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        gen = build_generator(cfg, src)
        try:
            for et in cfg.task_list():
                throughput[et.label or et.name] = run_task(cfg, et, gen, ed, progress)
        finally:
            gen.close()  # vLLM: stop the engines before the tables (they would outlive the eval's logging)
    summary = summarize(cfg, ed, src.description, rescored)
    tok = sum(t["tokens"] for t in throughput.values())
    gs = sum(t["generation_s"] for t in throughput.values())
    summary.update(
        source=src.description,
        wall_s=time.perf_counter() - t0,
        tokens=tok,
        generation_s=gs,
        tokens_per_s=tok / gs if gs else None,
    )
    durable.write_text(ed.path / "metrics.json", json.dumps(summary, indent=1))
    plot_passk([ed.path], ed.path / "passk.png")
    summary["mlflow_run_id"] = log_to_mlflow(cfg, ed, src, summary)
    durable.write_text(ed.path / "metrics.json", json.dumps(summary, indent=1))
    return summary


def _yaml(d: dict[str, Any]) -> str:
    return yaml.safe_dump(d, sort_keys=False)


def _task_tags(cfg: EvalConfig) -> dict[str, str]:
    tags: dict[str, str] = {}
    for et in cfg.task_list():
        tags.update(TASKS.get(et.name)(et.data_path, **et.params).tracking_tags())
    return tags


def log_to_mlflow(cfg: EvalConfig, ed: EvalDir, src: WeightsSource, summary: dict[str, Any]) -> str:
    """One MLflow run per eval, nested under the training run when one was evaluated."""
    from mlflow.tracking import MlflowClient

    uri = src.parent_uri or cfg.tracking.uri or default_tracking_uri(cfg.output_dir)
    experiment = cfg.tracking.experiment
    tags = {**run_tags(), "esbatch.kind": "eval", "eval.source": src.description, **_task_tags(cfg)}
    parent_id = src.parent_run_id or cfg.tracking.parent_run_id  # a trained run, or a sweep (base models)
    if parent_id:
        parent = MlflowClient(tracking_uri=uri).get_run(parent_id)
        experiment = MlflowClient(tracking_uri=uri).get_experiment(parent.info.experiment_id).name
        tags["mlflow.parentRunId"] = parent_id
    tr = MLflowTracker(uri, experiment, Path(cfg.output_dir) / "mlartifacts")
    meta_path = ed.path / "mlflow.json"
    prev = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    labels = ",".join(t.label or t.name for t in cfg.task_list())
    run_id = tr.start(
        f"eval {cfg.name}",
        flatten({**cfg.to_dict(), "tasks": labels}),
        tags,
        run_id=prev.get("run_id") if prev.get("uri") == uri else None,
    )
    durable.write_text(meta_path, json.dumps({"uri": uri, "run_id": run_id}))

    def name(label: str, col: str) -> str:  # MLflow allows no '@': pass@16 -> GSM8K/pass_at_16
        return re.sub(r"[^\w\-. :/]", "_", f"{label}/{col.replace('@', '_at_')}")

    metrics = {}
    for label, r in summary["tasks"].items():
        for c in summary["columns"]:
            if c in r:
                metrics[name(label, c)] = r[c]
    for c, v in task_average(summary["tasks"], summary["columns"])[0].items():
        metrics[name("average", c)] = v
    if summary.get("tokens_per_s"):
        metrics["throughput/tokens_per_s"] = summary["tokens_per_s"]
    tr.log_metrics(metrics, step=0)
    for f in ("table.md", "table.csv", "metrics.json", "passk.csv", "passk.png", "config.yaml"):
        if (ed.path / f).exists():
            tr.log_artifact(ed.path / f)
    tr.log_artifacts(ed.samples, "samples")
    tr.end("FINISHED")
    return run_id
