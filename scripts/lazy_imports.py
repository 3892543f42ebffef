"""Every function-level import in esbatch/ and what it keeps out of its module's import: the heavy or optional
packages it would add (torch, vllm, mlflow, matplotlib, ...) and the new module count, measured by importing the
module and then the target in a fresh interpreter. Rows that keep nothing heavy out are listed last: each should
either move to the top or say why it stays (CLI start-up: `python -X importtime -m esbatch.cli`).

Usage: python scripts/lazy_imports.py   (about 3 minutes: one interpreter per import)
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

HEAVY = (
    "torch vllm deepspeed mlflow matplotlib math_verify transformers submitit huggingface_hub gguf reasoning_gym "
    "psutil safetensors numpy datasets sympy tqdm"
).split()
PROBE = r"""
import importlib, json, sys
importlib.import_module(sys.argv[1])
before = set(sys.modules)
target, _, names = sys.argv[2].partition(":")
try:
    mod = importlib.import_module(target)
    for name in filter(None, names.split(",")):  # `from package import submodule` imports the submodule too
        if not hasattr(mod, name):
            importlib.import_module(f"{target}.{name}")
except ImportError as e:  # an optional package that is not installed here (vllm in the main venv)
    print(json.dumps({"missing": str(e)}))
    raise SystemExit
new = set(sys.modules) - before
print(json.dumps({"heavy": sorted({m.split(".")[0] for m in new} & set(sys.argv[3].split(","))), "new": len(new)}))
"""


def function_imports(node: ast.AST, in_def: bool = False) -> list[tuple[int, str]]:
    """(line, imported module) of each import inside a def."""
    out = []
    for c in ast.iter_child_nodes(node):
        if in_def and isinstance(c, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in c.names]
            out.append((c.lineno, names[0] if isinstance(c, ast.Import) else f"{c.module}:{','.join(names)}"))
        out += function_imports(c, in_def or isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return out


def rows() -> list[tuple[str, int, str, str]]:
    out = []
    for p in sorted(Path("esbatch").rglob("*.py")):
        mod = ".".join(p.with_suffix("").parts).removesuffix(".__init__")
        out += [(str(p), line, mod, target) for line, target in function_imports(ast.parse(p.read_text()))]
    return out


def main() -> None:
    light = []
    found = rows()
    for path, line, mod, target in found:
        r = subprocess.run([sys.executable, "-c", PROBE, mod, target, ",".join(HEAVY)], capture_output=True, text=True)
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {}
        what = "optional, not installed" if "missing" in got else ", ".join(got.get("heavy", [])) or "-"
        row = f"{path}:{line}  {target}  keeps out: {what} ({got.get('new', '?')} modules)"
        if what == "-":
            light.append(row)
        else:
            print(row)
    print(f"\n{len(found)} function-level imports; {len(light)} keep nothing heavy out:")
    print("\n".join(light))


if __name__ == "__main__":
    main()
