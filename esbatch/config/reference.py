"""The config reference, generated from the schemas: `esbatch validate --schema` and docs/config-reference.md.

tests/unit/test_docs.py fails when the checked-in reference differs from what ``markdown()`` writes, so the
reference can never fall behind the code.
"""

from __future__ import annotations

from typing import Any

from esbatch.config.aggregate import KINDS as ANALYSES
from esbatch.config.eval import EvalConfig
from esbatch.config.launcher import LauncherProfile
from esbatch.config.run import Config
from esbatch.config.sweep import SweepFile
from esbatch.schema import describe

TITLES = {
    "config": "Run config (`esbatch train CONFIG`)",
    "sweep": "Sweep file (`esbatch sweep SWEEP`)",
    "launcher": "Launcher profile (`launcher:` in a sweep, `--launcher NAME`)",
    "eval": "Eval config (`esbatch eval CONFIG`)",
    "aggregate": "Aggregate analyses (a sweep's `aggregate:` list)",
}


def schemas() -> dict[str, list[tuple[str, type]]]:
    """kind -> [(heading, schema class)]."""

    return {
        "config": [("", Config)],
        "sweep": [("", SweepFile)],
        "launcher": [("", LauncherProfile)],
        "eval": [("", EvalConfig)],
        "aggregate": [(f"kind: {k}", cls) for k, cls in sorted(ANALYSES.items())],
    }


def _fmt(v: Any) -> str:
    return "(required)" if v == "(required)" else repr(v)


def schema_text(kind: str) -> str:
    lines = []
    for heading, cls in schemas()[kind]:
        if heading:
            lines.append(f"[{heading}]")
        for key, tp, default, help_ in describe(cls):
            lines.append(f"{key:28s} {tp:16s} default={_fmt(default)}\n    {help_}")
    return "\n".join(lines)


def _sections(shared: list[str], keys: list[str]) -> list[str]:
    """`model.*` for a section all of whose keys are shared, the keys themselves otherwise."""
    out: list[str] = []
    for key in shared:
        section = key.split(".")[0]
        whole = "." in key and all(k in shared for k in keys if k.split(".")[0] == section)
        name = f"`{section}.*`" if whole else f"`{key}`"
        if name not in out:
            out.append(name)
    return out


def markdown() -> str:
    out = [
        "# Config reference",
        "",
        "Generated from the schemas (run configs: `esbatch/train/sections.py` and each algorithm's section, "
        "`esbatch/es/config.py`, `esbatch/grpo/config.py`, `esbatch/pipeline.py`; the other kinds: `esbatch/config/`) "
        "by `python -m esbatch.config.reference > "
        "docs/config-reference.md`; a test fails when it is out of date. `esbatch validate --schema [--kind K]` "
        "prints the same.",
    ]
    run_rows = {repr(row) for row in describe(Config)}
    for kind, parts in schemas().items():
        out += ["", f"## {TITLES[kind]}"]
        for heading, cls in parts:
            if heading:
                out += ["", f"### {heading}"]
            out += ["", "| key | type | default | what it does |", "|---|---|---|---|"]
            shared: list[str] = []  # keys whose row is the run config's, word for word: named once, not repeated
            for row in describe(cls):
                key, tp, default, help_ = row
                if kind != "config" and repr(row) in run_rows:
                    shared.append(key)
                    continue
                cell = _fmt(default).replace("|", "\\|")
                out.append(f"| `{key}` | {tp.replace('|', 'or')} | `{cell}` | {help_.replace('|', '/')} |")
            if shared:
                names = ", ".join(_sections(shared, [r[0] for r in describe(cls)]))
                out.append(f"| {names} | | | as in the run config |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
