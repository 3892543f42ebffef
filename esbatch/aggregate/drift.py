"""Paper Table 4 from a sweep's run folders: the ``drift`` analysis (esbatch/config/aggregate.py:DriftAnalysis).

Each finished run's final weights against its base model (esbatch/analyze/drift.py, tensor by tensor, in the run's
compute dtype unless ``as_dtype`` says otherwise): relative L2 distance, its ratio to the reference's, s_tau per
tau, the maximum |delta| and where the ``top_k`` largest updates are by parameter type. The reference is a method
of the sweep (its run in the same panel) or a run folder or model named directly (a released GRPO checkpoint).
The run folders are only read: the files go to the sweep's ``results/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from esbatch.aggregate.results import RunResult
from esbatch.aggregate.tables import Section, finish, md_table, write_csv
from esbatch.analyze.drift import DEFAULT_TAUS, TYPES, analyze_run, reference_stats, resolve_run, table4_rows
from esbatch.launch.state import SweepDir


def write_drift(runs: Sequence[RunResult], a: Any, out_dir: Path, sweep_dir: Path) -> Section:
    """Table 4 per panel (model): one row per finished run of ``runs`` (the analysis's ``select`` already applied,
    esbatch/aggregate/report.py), the reference's row first."""
    sd = SweepDir(sweep_dir)
    kw = {"taus": a.taus or DEFAULT_TAUS, "top_k": a.top_k, "as_dtype": a.as_dtype}
    methods = {r.params.get("method") for r in runs}
    panels: dict[Any, list[RunResult]] = {}
    for r in runs:
        panels.setdefault(r.params.get(a.panels) if a.panels else None, []).append(r)
    parts, csv_rows, notes = [], [], []
    header: list[str] = []
    for panel, members in panels.items():
        done = [r for r in members if r.status == "finished"]
        notes += [f"{r.label} ({r.key}): {r.status}, not analysed" for r in members if r.status != "finished"]
        if a.reference in methods:
            done = sorted(done, key=lambda r: r.params.get("method") != a.reference)  # the reference first
        stats = [analyze_run(resolve_run(sd.run_dir(r.key).path), **kw) for r in done]
        for r, s in zip(done, stats):
            s.label = r.label
        ref = None
        if a.reference in methods:
            ref = stats[0] if done and done[0].params.get("method") == a.reference else None
            if ref is None:
                notes.append(f"{panel}: no finished {a.reference} run, so no ratio")
        elif a.reference and done:
            _, ref = reference_stats(a.reference, resolve_run(sd.run_dir(done[0].key).path).model, **kw)
            stats.insert(0, ref)
        if not stats:
            continue
        rows = table4_rows(stats, ref)
        for s, row in zip(stats, rows):
            by_type = {t: 0 for t in TYPES}
            for c in s.top:
                by_type[c["type"]] += 1
            row["top_by_type"] = ", ".join(f"{t} {n}" for t, n in sorted(by_type.items(), key=lambda kv: -kv[1]) if n)
            row["delta_dtype"] = s.delta_dtype
        header = list(rows[0])
        csv_rows += [[panel, *(row[c] for c in header)] for row in rows]
        title = f"**{a.panels} = {panel}**" if a.panels else ""
        parts += [title, md_table(header, [[str(row[c]) for c in header] for row in rows])]
    csv_path = write_csv(out_dir / f"{a.name}.csv", ["panel", *header], csv_rows)
    ref_text = f"the reference ({a.reference})" if a.reference else "no reference"
    parts.append(
        f"*rel_l2 = ||theta_final - theta_0|| / ||theta_0|| (x 1e-2), ratio to {ref_text}; s_tau (%) = share of the "
        "nonzero updates with |delta| in (0, tau]; weights compared in delta_dtype (docs/diagnostics.md); "
        f"top_by_type = the {a.top_k} largest |delta| by parameter type.*"
    )
    if notes:
        parts.append("Not in the table: " + "; ".join(notes) + ".")
    return finish(a, out_dir, f"{a.name}: drift from theta_0 (Table 4)", "\n\n".join(p for p in parts if p), [csv_path])
