"""Magnitude-thresholded checkpoints (paper Section 4.2) and Figure 4's curve of their evaluations.

`esbatch threshold RUN --tau T...`: for each tau, delta_i := 0 where 0 < |delta_i| <= tau, i.e. theta_i := theta0_i
there, every other coordinate the run's center rounded to the compared dtype (delta, theta_0 and that dtype as in
esbatch/analyze/drift.py, the same rule: s_tau here is drift's s_tau).
Each checkpoint is a folder ``<run>/thresholded/tau-<tau>/`` that `esbatch eval --checkpoint` takes like a run:
center.safetensors (fp32, metadata ``t`` = the run's update count, plus ``tau``), a copy of the run's config.yaml
(its base model), run.json (the run's MLflow run, so the eval nests under it) and s_tau.json (the update sparsity).
The files are written tensor by tensor (one pass over the run for every tau), never a whole model in memory.

`esbatch analyze threshold-curve EVAL_DIR...`: target-task Pass@1 against update sparsity s_tau, one line per
model (Figure 4), from eval folders of thresholded checkpoints (and of the unthresholded runs: s_tau = 0).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from esbatch import durable
from esbatch.analyze.drift import check_taus, fp32_at_most, resolve_run
from esbatch.config import load_config
from esbatch.eval.center import newest_center
from esbatch.models import SafetensorsReader, weight_files
from esbatch.train.lock import writer_lock
from esbatch.train.rundir import RunDir, RunFolderError

FOLDER = "thresholded"
S_TAU = "s_tau.json"


def tau_dir(run: str | Path, tau: float) -> Path:
    return Path(run) / FOLDER / f"tau-{tau:g}"


class StreamingSafetensors:
    """A safetensors file written one tensor at a time: the header (names, dtypes, shapes, offsets) is known from
    the source file up front, so no tensor has to wait in memory for the others."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], metadata: dict[str, str]) -> None:
        self.path, self.order = path, list(shapes)
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, shape in shapes.items():
            n = 4
            for d in shape:
                n *= d
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
        self.tmp = path.with_suffix(f".tmp{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f: BinaryIO = open(self.tmp, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.next = 0

    def write(self, name: str, tensor: Any) -> None:
        import torch

        if name != self.order[self.next]:
            raise ValueError(f"{self.path}: tensor {name} written out of order (expected {self.order[self.next]})")
        self.next += 1
        arr = tensor.detach().to(torch.float32).contiguous().numpy()
        self.f.write(memoryview(arr).cast("B"))

    def close(self) -> None:
        if self.next != len(self.order):
            raise ValueError(f"{self.path}: {len(self.order) - self.next} tensor(s) never written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def threshold_tensors(
    center: Any, base: Any, taus: list[float], base_dtype: str, writers: list[Any], as_dtype: str | None = None
) -> list[dict]:
    """Stream ``center`` against ``base``: writer j gets theta_final (rounded to ``as_dtype``, default
    ``base_dtype``) with theta_0 where 0 < |delta| <= taus[j]; returns per tau {zeroed, nonzero, total} (exact)."""
    import torch

    counts = [{"zeroed": 0, "nonzero": 0, "total": 0} for _ in taus]
    for name in center.keys():
        if name not in base:
            raise KeyError(f"tensor {name} of the center is not in the base model's files: not the run's base model?")
        final = center.get(name).to(getattr(torch, as_dtype or base_dtype)).to(torch.float32)
        theta0 = base.get(name).to(getattr(torch, base_dtype)).to(torch.float32)
        if theta0.shape != final.shape:
            raise KeyError(
                f"tensor {name}: shape {tuple(final.shape)} in the center, {tuple(theta0.shape)} in the base"
            )
        with torch.no_grad():
            absd = (final - theta0).abs_()
            nonzero = absd > 0
            nz = int(nonzero.sum())
            for j, tau in enumerate(taus):
                mask = nonzero & (absd <= fp32_at_most(tau))  # |delta| <= tau exactly, not after rounding tau
                counts[j]["zeroed"] += int(mask.sum())
                counts[j]["nonzero"] += nz
                counts[j]["total"] += final.numel()
                writers[j].write(name, torch.where(mask, theta0, final))
                del mask
        del final, theta0, absd, nonzero
    return counts


def threshold_run(
    run: str | Path, taus: list[float], base_dtype: str | None = None, as_dtype: str | None = None
) -> list[Path]:
    """Write ``<run>/thresholded/tau-<tau>/`` for every tau (see the module docstring); returns the folders."""
    check_taus(taus)
    rw = resolve_run(run)
    if rw.rd.path.parent.name == FOLDER:
        raise RunFolderError(f"{rw.rd.path} is itself a thresholded checkpoint; threshold the run it came from")
    with writer_lock(rw.rd.path):  # <run>/thresholded/ is written into the run folder: one writer
        return _threshold_run(rw, taus, base_dtype or rw.base_dtype, as_dtype or base_dtype or rw.base_dtype)


def _threshold_run(rw: Any, taus: list[float], base_dtype: str, as_dtype: str) -> list[Path]:
    taus = sorted(set(float(t) for t in taus))
    m = rw.model
    base = SafetensorsReader(weight_files(m.name, m.gguf_file, m.revision))
    folders = [tau_dir(rw.rd.path, tau) for tau in taus]
    writers = []
    with newest_center(rw.rd, rw.algorithm) as (path, _):  # ES without a center file: rebuilt from its log
        center = SafetensorsReader([path])
        shapes = {k: center.shape(k) for k in center.keys()}
        source = str(path.resolve()) if path == rw.rd.center else f"{rw.rd.path.resolve()} (rebuilt from its log)"
        try:
            for tau, folder in zip(taus, folders):
                meta = {"t": str(rw.t), "tau": f"{tau:g}", "thresholded_from": source}
                writers.append(StreamingSafetensors(folder / RunDir.CENTER, shapes, meta))
            counts = threshold_tensors(center, base, taus, base_dtype, writers, as_dtype)
            for w in writers:
                w.close()
        except KeyError as e:
            for w in writers:
                w.abort()
            raise RunFolderError(f"{path} against base model {m.name}: {e.args[0]}") from None
        except BaseException:
            for w in writers:
                w.abort()
            raise
    for tau, folder, c in zip(taus, folders, counts):
        s = {
            "tau": tau,
            "s_tau": c["zeroed"] / c["nonzero"] if c["nonzero"] else 0.0,  # share of nonzero updates zeroed
            "kept_share_of_all": (c["nonzero"] - c["zeroed"]) / c["total"] if c["total"] else 0.0,
            **c,
            "updates": rw.t,
            "algorithm": rw.algorithm,
            "source_run": str(rw.rd.path.resolve()),
            "base_dtype": base_dtype,
            "delta_dtype": as_dtype,
        }
        durable.write_text(folder / S_TAU, json.dumps(s, indent=1))
        durable.write_bytes(folder / RunDir.CONFIG, rw.rd.config.read_bytes())
        keep = {k: rw.meta[k] for k in ("mlflow_run_id", "tracking_uri") if k in rw.meta}
        RunDir(folder).write_meta(**keep, algorithm=rw.algorithm, status="thresholded", tau=tau, done=rw.t)
    return folders


def _center_header(path: Path) -> dict[str, Any] | None:
    """The safetensors header of ``path`` if the file is whole (its size is the header's plus the data the header
    promises), else None."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return header if path.stat().st_size == 8 + n + end else None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def thresholded_intact(folder: str | Path, tau: float, t: int, base_dtype: str, as_dtype: str | None = None) -> bool:
    """Whether ``folder`` is a whole thresholded checkpoint of the run's center after update ``t`` at ``tau`` with
    theta_0 in ``base_dtype``, compared in ``as_dtype`` (default ``base_dtype``): every file written (s_tau.json
    last but for the copies), the center complete."""
    folder = Path(folder)
    try:
        s = json.loads((folder / S_TAU).read_text())
        meta = RunDir(folder).read_meta()
    except (OSError, ValueError, RunFolderError):
        return False
    same = (s.get("tau"), s.get("updates"), s.get("base_dtype"), s.get("delta_dtype"))
    if same != (tau, t, base_dtype, as_dtype or base_dtype):
        return False
    if meta.get("status") != "thresholded" or not (folder / RunDir.CONFIG).exists():
        return False
    header = _center_header(folder / RunDir.CENTER)
    md = (header or {}).get("__metadata__") or {}
    return md.get("t") == str(t) and md.get("tau") == f"{tau:g}"


def ensure_thresholded(
    run: str | Path, tau: float, base_dtype: str | None = None, as_dtype: str | None = None
) -> tuple[Path, bool]:
    """``<run>/thresholded/tau-<tau>/`` for the run's current center: reused when it is intact and of that center
    (a sweep's re-run), else (re)written. Returns (folder, whether it was written now)."""
    rw = resolve_run(run)
    folder = tau_dir(rw.rd.path, tau)
    if thresholded_intact(folder, float(tau), rw.t, base_dtype or rw.base_dtype, as_dtype or base_dtype):
        return folder, False
    (written,) = threshold_run(rw.rd.path, [tau], base_dtype=base_dtype, as_dtype=as_dtype)
    return written, True


# ----------------------------------------------------------------------------- Figure 4


def curve_points(eval_dirs: list[str | Path], task: str | None = None) -> list[dict[str, Any]]:
    """One point per eval folder: (model, tau, s_tau, Pass@1 on the target task). The target task is ``task``, else
    the training task of the evaluated run when the eval has it, else the eval's only task."""
    points = []
    for d in map(Path, eval_dirs):
        mfile = d / "metrics.json"
        if not mfile.exists():
            raise FileNotFoundError(f"{d}: not a finished eval folder (no metrics.json); run esbatch eval first")
        tasks = json.loads(mfile.read_text()).get("tasks", {})
        ecfg = yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").exists() else {}
        ck = (ecfg or {}).get("checkpoint")
        if not ck or not RunDir(ck).exists():
            raise RunFolderError(
                f"{d}: its config.yaml names no run folder as checkpoint ({ck!r}); the curve needs evals of "
                "thresholded checkpoints (esbatch eval --checkpoint RUN/thresholded/tau-T) or of the runs themselves"
            )
        train_cfg = load_config(str(RunDir(ck).config))
        sfile = Path(ck) / S_TAU
        s = json.loads(sfile.read_text()) if sfile.exists() else {"tau": 0.0, "s_tau": 0.0}
        label = task or (train_cfg.task.name if train_cfg.task.name in tasks else None)
        if label is None and len(tasks) == 1:
            label = next(iter(tasks))
        if label not in tasks or "pass@1" not in tasks[label]:
            raise ValueError(
                f"{d}: no Pass@1 for task {label or train_cfg.task.name!r}; it has {', '.join(tasks) or 'no tasks'} "
                "(choose one with --task)"
            )
        points.append(
            {
                "model": train_cfg.model.name,
                "tau": s["tau"],
                "s_tau": s["s_tau"],
                "task": label,
                "pass@1": tasks[label]["pass@1"],
                "eval_dir": str(d),
            }
        )
    return points


def plot_threshold_curve(eval_dirs: list[str | Path], out: str | Path, task: str | None = None) -> tuple[Path, Path]:
    """Figure 4: Pass@1 (x100) against update sparsity s_tau (%), one line per model; the PNG and a CSV beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = curve_points(eval_dirs, task)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = out.with_suffix(".csv")
    with durable.open_text(table, newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(points[0]))
        w.writeheader()
        w.writerows(sorted(points, key=lambda p: (p["model"], p["s_tau"])))
    fig, ax = plt.subplots(figsize=(5.8, 4.2))
    for model in sorted({p["model"] for p in points}):
        mine = sorted((p for p in points if p["model"] == model), key=lambda p: p["s_tau"])
        ax.plot([100 * p["s_tau"] for p in mine], [100 * p["pass@1"] for p in mine], marker="o", label=model)
    ax.set_xlabel("update sparsity s_tau (% of nonzero updates zeroed)")
    ax.set_ylabel(f"Pass@1 (x100), {points[0]['task']}" if len({p["task"] for p in points}) == 1 else "Pass@1 (x100)")
    ax.set_title("Target-task Pass@1 vs update sparsity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out, table
