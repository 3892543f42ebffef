"""The docs stay true to the code: the config reference is generated from the schemas, the README stays short,
and CI runs the README's test command."""

from pathlib import Path

from esbatch.config.reference import markdown

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_is_up_to_date():
    got = (ROOT / "docs" / "config-reference.md").read_text()
    assert got == markdown(), "regenerate it: python -m esbatch.config.reference > docs/config-reference.md"


def test_every_schema_key_is_in_the_reference_with_its_help():
    text = markdown()
    for key in ("`es.sigma`", "`grid`", "`container.image`", "`tasks[].limit`", "`tolerance`", "`backend.engines`"):
        assert key in text, key
    assert "| `es.sigma` | float | `0.001` | Perturbation scale sigma. |" in text


def test_readme_is_short_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 12 * 1024
    test_line = next(line for line in readme.splitlines() if line.rstrip().endswith("# tests"))
    command = test_line.split("#")[0].strip()
    assert command in (ROOT / ".ci" / "run").read_text()
    assert "{{MEASURE" not in readme


def test_the_algorithm_example_of_extending_is_the_one_the_tests_run():
    doc = (ROOT / "docs" / "extending.md").read_text()
    code = doc[doc.index("# mypkg/baseline.py\n") :].split("```")[0].removeprefix("# mypkg/baseline.py\n")
    ran = (ROOT / "tests" / "baseline_algo.py").read_text().split("# ruff: noqa\n", 1)[1]
    assert ran == code, "copy the example of docs/extending.md into tests/baseline_algo.py"
