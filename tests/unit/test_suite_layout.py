"""The test tree has no __init__.py files (pytest's rootdir import mode), so two test files with one basename
abort collection of the whole suite in CI ("import file mismatch") even though each folder passes alone."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_basename_is_unique_across_the_test_tree() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts:
            seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1 and name != "conftest.py"}
    assert not clashes, f"rename one of each: {clashes}"
