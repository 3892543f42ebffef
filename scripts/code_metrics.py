"""Print the code-shape figures the redesign issue (28) reports, for the tree this script sits in.

cfg: Any            annotations `cfg: Any` / `config: Any` in esbatch/ (untyped whole-config arguments)
function imports    import statements not at module level (inside a def; `if TYPE_CHECKING:` blocks excluded)
longest function    the longest def in esbatch/ (lines, decorators excluded)
largest module      the longest .py file in esbatch/
es/ lines           every line of esbatch/es/*.py
docs                bytes of docs/**/*.md, of the figures next to them, and of README.md

Usage: python scripts/code_metrics.py [--imports-by-file]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def function_imports(tree: ast.AST) -> int:
    count = 0

    def visit(node: ast.AST, in_def: bool) -> None:
        nonlocal count
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_def:
                count += 1
            visit(child, in_def or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return count


def main() -> None:
    files = sorted((ROOT / "esbatch").rglob("*.py"))
    cfg_any = imports = 0
    longest = (0, "")
    largest = (0, "")
    per_file: dict[str, int] = {}
    for p in files:
        text = p.read_text()
        rel = str(p.relative_to(ROOT))
        cfg_any += len(re.findall(r"\b(?:cfg|config): Any\b", text))
        tree = ast.parse(text)
        n = function_imports(tree)
        imports += n
        per_file[rel] = n
        lines = text.count("\n")
        largest = max(largest, (lines, rel))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                longest = max(longest, (node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    es_lines = sum(p.read_text().count("\n") for p in (ROOT / "esbatch" / "es").glob("*.py"))
    files_in_docs = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    text = sum(p.stat().st_size for p in files_in_docs if p.suffix == ".md")
    images = sum(p.stat().st_size for p in files_in_docs if p.suffix != ".md")
    readme = (ROOT / "README.md").stat().st_size
    print(f"cfg: Any annotations     {cfg_any}")
    print(f"function-level imports   {imports}")
    print(f"longest function         {longest[0]} lines ({longest[1]})")
    print(f"largest module           {largest[0]} lines ({largest[1]})")
    print(f"es/ lines                {es_lines}")
    print(f"docs/*.md                {text / 1000:.1f} KB (+ {images / 1000:.0f} KB of figures)")
    print(f"README.md                {readme / 1000:.1f} KB")
    if "--imports-by-file" in sys.argv:
        for rel, n in sorted(per_file.items(), key=lambda kv: -kv[1]):
            if n:
                print(f"  {n:4d} {rel}")


if __name__ == "__main__":
    main()
