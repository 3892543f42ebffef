"""`esbatch analyze drift RUN...`: how far and where a run's weights moved from theta_0 (paper Table 4, Section 4.2).

delta = theta_final - theta_0 elementwise, both in the run's compute dtype by default: theta_0 is the base model
named by the run's config.yaml rounded to the dtype the trainer loaded it in (``model.dtype``), the theta_0 the
trainer held, and theta_final the run's center.safetensors (fp32) rounded to the same dtype, the weights a bf16 model
deploys (the paper's maxima such as 0.015625 are bf16 steps; an fp32 center differs from theta_0 in ~every
coordinate). ``as_dtype: float32`` compares the fp32 center itself. The difference is taken in fp32. Per run:

- relative L2 distance ||delta|| / ||theta_0|| (x 1e-2 in the table) and its ratio to a reference run's (GRPO);
- s_tau: the share of NONZERO coordinates with |delta| in (0, tau], for each tau;
- a histogram of nonzero |delta| on log-spaced bins (lo, hi], per parameter type (``param_type``);
- the maximum |delta|, how many coordinates reach it and in which tensors;
- the top-k coordinates by |delta|, counted by parameter type and layer (a heatmap).

The center and the base model are read tensor by tensor (``safe_open``) and each tensor in chunks, so the memory
beyond Python's is about one tensor's worth, for any model size. Files go to ``<run>/analysis/drift/``.
"""

from __future__ import annotations

import csv
import json
import math
import re
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from esbatch import durable
from esbatch.config import load_config
from esbatch.eval.center import newest_center, newest_t
from esbatch.models import ModelNotFoundError, SafetensorsReader, weight_files
from esbatch.tracking import log_artifacts_to
from esbatch.train.rundir import RunDir, RunFolderError

TYPES = ("norm", "attn_q", "attn_k", "attn_v", "attn_o", "attn_bias", "mlp", "embed", "lm_head", "other")
# s_tau's thresholds: 1.5e-3 is the paper's (issue 31 reads it in Table 4's head; the table body is missing from
# our text), the decades below it are ours
DEFAULT_TAUS = (1e-6, 1e-5, 1e-4, 1e-3, 1.5e-3)
CHUNK = 1 << 22  # elements per chunk: bounds the temporaries (bucket indices are int64) to ~32 MB
OUT = Path("analysis") / "drift"

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_o", "out_proj": "attn_o"}


def param_type(name: str) -> tuple[str, int | None]:
    """(type, layer index or None) of an HF parameter name (Llama, Qwen2, SmolLM2, Mistral naming).

    Types: norm (any LayerNorm/RMSNorm weight or bias), attn_q/k/v/o (projection weights), attn_bias (biases of
    the attention projections, e.g. Qwen2's q/k/v biases), mlp, embed (token/position embeddings), lm_head, other.
    """
    m = _LAYER.search(name)
    layer = int(m.group(1)) if m else None
    parts = name.lower().split(".")
    module = parts[-2] if len(parts) > 1 else ""
    if "lm_head" in parts:
        return "lm_head", layer
    if any("embed" in p for p in parts) or module in ("wte", "wpe"):
        return "embed", layer
    if any("norm" in p for p in parts) or module.startswith("ln_"):
        return "norm", layer
    if module in _ATTN:
        return ("attn_bias" if parts[-1] == "bias" else _ATTN[module]), layer
    if "mlp" in parts or module in ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "c_fc"):
        return "mlp", layer
    return "other", layer


def log_edges(per_decade: int = 4, low_exp: int = -12, high_exp: int = 0) -> list[float]:
    """Bin edges 10^(k / per_decade) from 10^low_exp to 10^high_exp: bin 0 is (0, first edge], bin i is
    (edge[i-1], edge[i]], the last bin (last edge, inf)."""
    return [10 ** (k / per_decade) for k in range(low_exp * per_decade, high_exp * per_decade + 1)]


class Tensors(Protocol):
    """What the analysis reads: tensor names and one tensor at a time (esbatch.models.SafetensorsReader)."""

    def keys(self) -> list[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> Any: ...


@dataclass
class DriftStats:
    """Everything the analysis of one run measures (counts are exact; sums are float64)."""

    label: str
    algorithm: str = ""
    t: int | None = None
    delta_dtype: str = "float32"  # the dtype theta_final and theta_0 are compared in (module docstring)
    taus: list[float] = field(default_factory=lambda: list(DEFAULT_TAUS))
    edges: list[float] = field(default_factory=log_edges)
    n_total: int = 0
    n_nonzero: int = 0
    sq_delta: float = 0.0
    sq_theta0: float = 0.0
    below: list[int] = field(default_factory=list)  # per tau: nonzero coordinates with |delta| <= tau
    hist: dict[str, list[int]] = field(default_factory=dict)  # type -> counts per bin (len(edges) + 1)
    n_by_type: dict[str, int] = field(default_factory=dict)  # coordinates per type
    max_abs: float = 0.0
    max_count: int = 0
    max_tensors: dict[str, int] = field(default_factory=dict)
    top: list[dict[str, Any]] = field(default_factory=list)  # rank-ordered: value, tensor, index, type, layer

    @property
    def rel_l2(self) -> float:
        return math.sqrt(self.sq_delta / self.sq_theta0) if self.sq_theta0 else float("nan")

    def s_tau(self) -> list[float]:
        return [b / self.n_nonzero if self.n_nonzero else float("nan") for b in self.below]

    def top_by_type_layer(self) -> dict[tuple[str, int | None], int]:
        out: dict[tuple[str, int | None], int] = {}
        for r in self.top:
            key = (r["type"], r["layer"])
            out[key] = out.get(key, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rel_l2": self.rel_l2, "s_tau": self.s_tau()}


def drift_stats(
    center: Tensors,
    base: Tensors,
    *,
    label: str = "",
    base_dtype: str = "float32",
    taus: list[float] | tuple[float, ...] = DEFAULT_TAUS,
    top_k: int = 100,
    edges: list[float] | None = None,
    as_dtype: str | None = None,
) -> DriftStats:
    """Stream ``center`` (theta_final) against ``base`` (theta_0, rounded to ``base_dtype``) tensor by tensor.

    ``as_dtype``: round theta_final to this dtype first (None: ``base_dtype``, the compute dtype: module
    docstring); the difference is taken in fp32."""
    import torch

    as_dtype = as_dtype or base_dtype
    st = DriftStats(label, taus=sorted(float(t) for t in taus), edges=list(edges or log_edges()), delta_dtype=as_dtype)
    st.below = [0] * len(st.taus)
    edges_t = torch.tensor(st.edges, dtype=torch.float32)
    top: tuple[Any, list[tuple[str, int]]] = (torch.empty(0, dtype=torch.float32), [])
    for name in center.keys():
        absd = _abs_delta(st, name, center, base, base_dtype, as_dtype)
        kind, _ = param_type(name)
        hist = st.hist.setdefault(kind, [0] * (len(st.edges) + 1))
        st.n_by_type[kind] = st.n_by_type.get(kind, 0) + absd.numel()
        top = _scan(st, name, absd, hist, edges_t, top, top_k)
        del absd  # the only reference left to this tensor's memory: one tensor at a time
    top_vals, top_src = top
    st.top = [
        {
            "rank": r + 1,
            "abs_delta": float(v),
            "tensor": n,
            "index": i,
            "type": param_type(n)[0],
            "layer": param_type(n)[1],
        }
        for r, (v, (n, i)) in enumerate(zip(top_vals.tolist(), top_src))
    ]
    return st


def _abs_delta(st: DriftStats, name: str, center: Tensors, base: Tensors, base_dtype: str, as_dtype: str | None) -> Any:
    """|theta_final - theta_0| of tensor ``name``, flattened, in fp32 (in theta_final's buffer); adds ||theta_0||^2."""
    import torch

    if name not in base:
        raise KeyError(f"tensor {name} of the center is not in the base model's files: not the run's base model?")
    # a copy: the tensor safe_open hands out is its file mapping, which one handle shares between reads
    final = center.get(name).to(torch.float32, copy=True)
    if as_dtype:
        final = final.to(getattr(torch, as_dtype)).to(torch.float32)
    theta0 = base.get(name).to(getattr(torch, base_dtype)).to(torch.float32)
    if theta0.shape != final.shape:
        raise KeyError(f"tensor {name}: shape {tuple(final.shape)} in the center, {tuple(theta0.shape)} in theta_0")
    with torch.no_grad():
        flat0 = theta0.reshape(-1)
        for start in range(0, flat0.numel(), CHUNK):
            st.sq_theta0 += float(flat0[start : start + CHUNK].double().square().sum())
        return final.reshape(-1).sub_(flat0).abs_()


def _scan(
    st: DriftStats, name: str, absd: Any, hist: list[int], edges_t: Any, top: tuple[Any, list], top_k: int
) -> tuple[Any, list[tuple[str, int]]]:
    """Count one tensor's |delta| chunk by chunk; returns the running top-k (values, (tensor, index)) merged with
    it (a stable sort: among equal values the earlier tensor and index come first; which of the values tied at
    the k-th place are kept is topk's choice)."""
    import torch

    top_vals, top_src = top
    with torch.no_grad():
        for start in range(0, absd.numel(), CHUNK):
            c = absd[start : start + CHUNK]
            _chunk(st, c, hist, edges_t, name)
            v, i = torch.topk(c, min(top_k, c.numel()))
            by_index = torch.argsort(i)  # among equal values the lower index first (topk leaves ties unordered)
            v, i = v[by_index], i[by_index]
            cand = torch.cat([top_vals, v])
            src = top_src + [(name, start + j) for j in i.tolist()]
            order = torch.sort(cand, descending=True, stable=True).indices[:top_k]
            top_vals, top_src = cand[order], [src[j] for j in order.tolist()]
    return top_vals, top_src


def fp32_at_most(tau: float) -> float:
    """The largest float32 value <= tau (tau >= 0). A float32 |delta| is <= tau exactly when it is <= this; torch
    compares a float32 tensor with a Python float after rounding the float to float32, which can round past tau
    (float32(1e-3) = 1.00000005e-3 would count as "at most 1e-3")."""
    t = struct.unpack("<f", struct.pack("<f", tau))[0]
    if t > tau:  # rounded up: the float32 just below (positive floats order as their bit patterns)
        t = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", t))[0] - 1))[0]
    return t


def _chunk(st: DriftStats, c: Any, hist: list[int], edges_t: Any, name: str) -> None:
    """Add one chunk of |delta| of tensor ``name`` to the counts, the sums and the maximum."""
    import torch

    st.n_total += c.numel()
    nonzero = c > 0
    nz = int(nonzero.sum())
    st.n_nonzero += nz
    st.sq_delta += float(c.double().square().sum())
    zeros = c.numel() - nz
    for j, tau in enumerate(st.taus):
        st.below[j] += int((c <= fp32_at_most(tau)).sum()) - zeros
    if nz:
        counts = torch.bincount(torch.bucketize(c[nonzero], edges_t), minlength=len(hist))
        for b, n in enumerate(counts.tolist()):
            hist[b] += n
        m = float(c.max())
        if m > st.max_abs:
            st.max_abs, st.max_count, st.max_tensors = m, 0, {}
        if m == st.max_abs:
            n = int((c == m).sum())
            st.max_count += n
            st.max_tensors[name] = st.max_tensors.get(name, 0) + n


# ----------------------------------------------------------------------------- run folders


@dataclass
class RunWeights:
    """A run folder's final weights and the base model they started from."""

    rd: RunDir
    label: str
    algorithm: str
    model: Any  # the config's model section (name, gguf_file, revision, dtype)
    t: int
    meta: dict[str, Any]

    @property
    def base_dtype(self) -> str:
        return self.model.dtype


def resolve_run(path: str | Path) -> RunWeights:
    """The run folder at ``path`` (an ES or GRPO run, a pipeline or one of its stage<k>-<algo>/ folders), checked
    to hold a config and a readable center; errors name the file and what to do."""
    rd = RunDir(path)
    if not rd.path.is_dir():
        raise FileNotFoundError(f"{rd.path}: no such run folder (give the folder `esbatch train` printed)")
    if not rd.exists():
        raise RunFolderError(
            f"{rd.path}: not a run folder (no {RunDir.CONFIG}); give a run or a stage<k>-<algo> folder"
        )
    cfg = load_config(str(rd.config))
    t = newest_t(rd, cfg.algorithm)  # center.safetensors, or (ES, checkpoint.center: final | none) the log
    label = f"{rd.path.parent.name}/{rd.path.name}" if rd.path.name.startswith("stage") else rd.path.name
    return RunWeights(rd, label, cfg.algorithm, cfg.model, t, rd.read_meta())


def analyze_run(run: RunWeights, **kw: Any) -> DriftStats:
    """Drift of the run's newest center from its base model (``kw``: drift_stats's taus, top_k, edges,
    base_dtype, as_dtype)."""
    with newest_center(run.rd, run.algorithm) as (path, _):
        st = _against_base(SafetensorsReader([path]), run.model, run.label, str(path), **kw)
    st.algorithm, st.t = run.algorithm, run.t
    return st


def analyze_model(name: str, base_model: Any, **kw: Any) -> DriftStats:
    """Drift of a model that is not a run here (a released checkpoint: alias, hub id, ``hf://`` folder or local
    folder) from ``base_model`` (the runs' config model section): the reference of a Table 4 whose GRPO side was
    trained elsewhere (the Hard setting's released SofT-GRPO checkpoint)."""
    try:
        files = weight_files(name)
    except ModelNotFoundError as e:
        raise RunFolderError(
            f"reference {name}: neither a run folder (no {RunDir.CONFIG}) nor a model whose weights can be read: "
            f"{str(e).removeprefix('model.name: ')}"
        ) from None
    try:
        center = SafetensorsReader(files)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a damaged header
        raise RunFolderError(
            f"reference {name}: its weights cannot be read ({', '.join(map(str, files))}: {e}); copy or download "
            "the model again"
        ) from None
    st = _against_base(center, base_model, name, f"model {name}", **kw)
    st.algorithm = "reference model"
    return st


def _against_base(center: Tensors, m: Any, label: str, what: str, base_dtype: str | None = None, **kw: Any) -> Any:
    """drift_stats of ``center`` against the weights of model section ``m`` (theta_0 in its dtype by default);
    a tensor that does not match names ``what``."""
    base = SafetensorsReader(weight_files(m.name, m.gguf_file, m.revision))
    try:
        return drift_stats(center, base, label=label, base_dtype=base_dtype or m.dtype, **kw)
    except KeyError as e:
        raise RunFolderError(f"{what} against base model {m.name}: {e.args[0]}") from None


def reference_stats(reference: str | Path, base_model: Any, **kw: Any) -> tuple[RunWeights | None, DriftStats]:
    """The reference of Table 4's ratio: a run folder (its RunWeights and stats), else a model (None, stats)."""
    if RunDir(reference).exists():
        ref = resolve_run(reference)
        return ref, analyze_run(ref, **kw)
    return None, analyze_model(str(reference), base_model, **kw)


# ----------------------------------------------------------------------------- outputs


def table4_rows(stats: list[DriftStats], reference: DriftStats | None) -> list[dict[str, Any]]:
    """Table 4: relative L2 (x 1e-2), its ratio to the reference's, s_tau (%) per tau, the maximum and its count."""
    rows = []
    for s in stats:
        row: dict[str, Any] = {"run": s.label, "algorithm": s.algorithm, "updates": s.t}
        row["rel_l2_x1e-2"] = round(100 * s.rel_l2, 6)
        row["ratio_to_reference"] = round(s.rel_l2 / reference.rel_l2, 4) if reference and reference.rel_l2 else ""
        for tau, v in zip(s.taus, s.s_tau()):
            row[f"s_tau@{tau:g} (%)"] = round(100 * v, 4)
        row["nonzero_share (%)"] = round(100 * s.n_nonzero / s.n_total, 4) if s.n_total else ""
        row["max_abs_delta"] = s.max_abs
        row["n_at_max"] = s.max_count
        rows.append(row)
    return rows


def _md(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with durable.open_text(path, newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def histogram_rows(s: DriftStats) -> list[dict[str, Any]]:
    lows = [0.0, *s.edges]
    highs = [*s.edges, float("inf")]
    return [
        {"type": kind, "bin_low": lo, "bin_high": hi, "count": n}
        for kind in TYPES
        if kind in s.hist
        for lo, hi, n in zip(lows, highs, s.hist[kind])
    ]


def write_outputs(s: DriftStats, folder: Path, all_stats: list[DriftStats], reference: DriftStats | None) -> list[Path]:
    """CSV, Markdown and PNG files of run ``s`` (with the other analysed runs for comparison) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = table4_rows(all_stats, reference)
    _csv(folder / "table4.csv", rows)
    durable.write_text(folder / "table4.md", _md(rows))
    _csv(folder / "histogram.csv", histogram_rows(s))
    _csv(folder / "topk.csv", s.top)
    grouped = sorted(s.top_by_type_layer().items(), key=lambda kv: (-kv[1], kv[0][0], kv[0][1] or -1))
    _csv(folder / "topk_by_type_layer.csv", [{"type": k, "layer": lay, "count": n} for (k, lay), n in grouped])
    durable.write_text(folder / "drift.json", json.dumps(s.to_json(), indent=1))
    by_type: dict[str, int] = {}
    for r in s.top:
        by_type[r["type"]] = by_type.get(r["type"], 0) + 1
    where = ", ".join(f"{n} ({c})" for n, c in sorted(s.max_tensors.items(), key=lambda kv: -kv[1]))
    md = [
        f"# Drift of {s.label} from theta_0 ({s.algorithm}, after update {s.t})\n",
        f"delta = theta_final - theta_0 elementwise, both rounded to {s.delta_dtype} (docs/diagnostics.md). "
        "rel_l2 = ||delta|| / ||theta_0||; "
        "s_tau = share of nonzero coordinates with |delta| in (0, tau].\n",
        _md(rows),
        f"Maximum |delta| = {s.max_abs:.8g}, reached by {s.max_count} coordinate(s): {where or 'none'}.\n",
        f"Top {len(s.top)} coordinates by |delta|, by parameter type: "
        + ", ".join(f"{k} {n}" for k, n in sorted(by_type.items(), key=lambda kv: -kv[1]))
        + " (by type and layer: topk_by_type_layer.csv, topk_heatmap.png).\n",
        "Files: table4.csv/.md, histogram.csv (nonzero |delta| per type, bins (low, high]), topk.csv, drift.json, "
        "histogram.png, topk_heatmap.png, compare.png.\n",
    ]
    durable.write_text(folder / "summary.md", "\n".join(md))
    _plot_histograms(s, folder / "histogram.png")
    _plot_heatmap(s, folder / "topk_heatmap.png")
    _plot_compare(all_stats, folder / "compare.png")
    return sorted(p for p in folder.iterdir() if p.is_file())


def _centers(edges: list[float]) -> list[float]:
    """A point per bin for log-scale plots: geometric bin centres (bin 0 drawn one step below the first edge)."""
    step = edges[1] / edges[0] if len(edges) > 1 else 10.0
    lows = [edges[0] / step, *edges]
    highs = [*edges, edges[-1] * step]
    return [math.sqrt(lo * hi) for lo, hi in zip(lows, highs)]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_histograms(s: DriftStats, out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = _centers(s.edges)
    for kind in TYPES:
        if kind in s.hist and sum(s.hist[kind]):
            ax.plot(xs, s.hist[kind], marker="o", ms=2.5, label=kind)
    for tau in s.taus:
        ax.axvline(tau, color="gray", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)  # empty bins (0) stay visible; counts are never negative
    ax.set_ylim(bottom=0)
    ax.set_xlabel("|delta| (log bins)")
    ax.set_ylabel("nonzero coordinates")
    ax.set_title(f"{s.label}: |theta_final - theta_0| by parameter type")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_heatmap(s: DriftStats, out: Path) -> None:
    plt = _pyplot()
    grouped = s.top_by_type_layer()
    kinds = [k for k in TYPES if any(t == k for t, _ in grouped)] or ["none"]
    layers = sorted({lay for _, lay in grouped if lay is not None})
    rows = ["-", *[str(x) for x in layers]]  # "-": parameters outside the layers (embeddings, final norm, head)
    grid = [[grouped.get((k, None if r == "-" else int(r)), 0) for k in kinds] for r in rows]
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(kinds), 1.2 + 0.25 * len(rows)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(kinds)), kinds, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_ylabel("layer")
    ax.set_title(f"top {len(s.top)} |delta|: {s.label}", fontsize=9)
    fig.colorbar(im, ax=ax, label="coordinates")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _plot_compare(stats: list[DriftStats], out: Path) -> None:
    """Whole-model nonzero |delta| histograms of every analysed run, as shares of each run's nonzero updates."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in stats:
        totals = [sum(col) for col in zip(*s.hist.values())] if s.hist else []
        if not totals or not s.n_nonzero:
            continue
        ax.plot(
            _centers(s.edges),
            [100 * n / s.n_nonzero for n in totals],
            marker="o",
            ms=2.5,
            label=f"{s.label} ({s.algorithm}, rel L2 {100 * s.rel_l2:.3g}e-2)",
        )
    ax.set_xscale("log")
    ax.set_xlabel("|delta| (log bins)")
    ax.set_ylabel("share of nonzero updates (%)")
    ax.set_title("|theta_final - theta_0|: runs compared")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run that did not move has no nonzero update to draw
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def log_to_run(run: RunWeights, folder: Path, artifact_path: str) -> str | None:
    """Log ``folder``'s files as artifacts of the run's MLflow run (run.json names it); a warning, not an error,
    when there is none or the store cannot be reached: the files stay in the run folder either way."""
    uri, run_id = run.meta.get("tracking_uri"), run.meta.get("mlflow_run_id")
    if not (uri and run_id):
        return None
    try:
        log_artifacts_to(uri, run_id, folder, artifact_path)
    except Exception as e:  # noqa: BLE001 - MLflow raises many kinds (network, store, permissions)
        print(
            f"warning: not logged to MLflow run {run_id} in {uri} ({type(e).__name__}: {e}); files: {folder}",
            file=sys.stderr,
        )
        return None
    return run_id


def analyze_drift(
    runs: list[str | Path],
    reference: str | Path | None = None,
    *,
    taus: list[float] | tuple[float, ...] = DEFAULT_TAUS,
    top_k: int = 100,
    per_decade: int = 4,
    base_dtype: str | None = None,
    as_dtype: str | None = None,
    mlflow: bool = True,
) -> list[tuple[RunWeights | None, DriftStats, Path | None]]:
    """Analyse every run (and the reference: a run folder, or a model such as a released GRPO checkpoint, from
    the first run's base model), write each run's files, log them to its MLflow run. Returns (run, stats,
    folder) per run, the reference first; a model reference as (None, stats, None)."""
    check_taus(taus)
    if top_k < 1:
        raise ValueError(f"--top-k {top_k}: give a count >= 1")
    targets = [resolve_run(r) for r in runs]  # every folder is checked before the first model is read
    ref = resolve_run(reference) if reference is not None and RunDir(reference).exists() else None
    seen = {ref.rd.path.resolve()} if ref else set()
    unique = []
    for rw in targets:  # a run given twice (or also as --reference) is read and tabulated once
        if rw.rd.path.resolve() not in seen:
            seen.add(rw.rd.path.resolve())
            unique.append(rw)
    targets = unique
    kw = dict(taus=taus, top_k=top_k, edges=log_edges(per_decade), base_dtype=base_dtype, as_dtype=as_dtype)
    model_ref = analyze_model(str(reference), targets[0].model, **kw) if reference is not None and not ref else None
    done = [(rw, analyze_run(rw, **kw)) for rw in ([ref] if ref else []) + targets]
    ref_stats = done[0][1] if ref else model_ref
    everything = ([model_ref] if model_ref else []) + [s for _, s in done]
    out = []
    for rw, st in done:
        folder = rw.rd.path / OUT
        write_outputs(st, folder, everything, ref_stats)
        if mlflow:
            log_to_run(rw, folder, OUT.as_posix())
        out.append((rw, st, folder))
    return [(None, model_ref, None), *out] if model_ref else out


def check_taus(taus: list[float] | tuple[float, ...]) -> None:
    bad = [t for t in taus if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0)]
    if bad or not taus:
        raise ValueError(f"--tau {bad[0] if bad else '(none)'}: thresholds must be finite numbers > 0, e.g. 1e-6 1e-5")
