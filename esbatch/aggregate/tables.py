"""Output helpers every aggregate writer shares: Markdown tables, CSV cells, and an analysis's section."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from esbatch import durable


def md_escape(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: Iterable[int] = ()) -> str:
    right = set(right)
    lines = ["| " + " | ".join(md_escape(h) for h in header) + " |"]
    lines.append("|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|")
    lines.extend("| " + " | ".join(md_escape(c) for c in row) + " |" for row in rows)
    return "\n".join(lines)


def csv_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (float, np.floating)):
        return repr(float(v)) if math.isfinite(v) else ""
    if isinstance(v, np.integer):
        return str(int(v))
    return str(v)


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    with durable.open_text(path, newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows([csv_cell(c) for c in row] for row in rows)
    return path


@dataclass
class Section:
    """What one analysis produced: its files and the Markdown embedded in the report index."""

    analysis: Any  # the analysis spec (esbatch/config/aggregate.py)
    files: list[Path]
    markdown: str


def finish(a: Any, out_dir: Path, heading: str, body: str, files: list[Path]) -> Section:
    md_path = out_dir / f"{a.name}.md"
    durable.write_text(md_path, f"# {heading}\n\n{body}\n", encoding="utf-8")
    return Section(a, [*files, md_path], body)
