"""Hostile config and data files get a named error before any work is done (issue 44, deliverable 7).

A key given twice in one YAML mapping (PyYAML keeps the later value silently), an alias bomb ("billion laughs"),
a jsonl data file that is one huge line, and a key the chosen task never reads (``task.data_path`` for
``arithmetic``). Each check asserts the bounded work (nothing built, nothing parsed), not the wall time.
"""

from __future__ import annotations

import sys

import pytest
import yaml

from esbatch.config import loader
from esbatch.config.loader import load_yaml, parse_yaml, read_yaml
from esbatch.config.run import config_from_dict, parse_overrides
from esbatch.schema import ConfigError
from esbatch.tasks import gsm8k
from esbatch.tasks.base import DataFileError
from esbatch.tasks.gsm8k import check_row_sizes, load_rows

# ----------------------------------------------------------------------------- duplicate keys


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("es:\n  sigma: 0.001\n  updates: 3\n  sigma: 0.5\n")
    with pytest.raises(ConfigError) as e:
        read_yaml(f)
    assert e.value.source == str(f)
    assert e.value.errors == [
        "key 'sigma' is given twice in one mapping, at line 2 and line 4 (YAML would silently keep the later "
        "value); keep one of them"
    ]


@pytest.mark.parametrize(
    "text, first, second",
    [
        ("a: 1\na: 1\n", 1, 2),  # the same value twice is still refused: one of them is a slip
        ("a: 1\nb: {c: 1, c: 2}\n", 2, 2),  # flow mappings too
        ("1: x\n0x1: y\n", 1, 2),  # two spellings of one key
        ("- {a: 1}\n- {a: 2, b: 3, a: 4}\n", 2, 2),
    ],
)
def test_every_spelling_of_a_duplicate_is_refused(text, first, second):
    with pytest.raises(ConfigError, match=f"at line {first} and line {second} "):
        load_yaml(text, "f.yaml")


@pytest.mark.parametrize(
    "text, data",
    [
        ("a: {x: 1}\nb: {x: 2}\n", {"a": {"x": 1}, "b": {"x": 2}}),  # one key in two mappings
        ("base: &b {x: 1, y: 2}\nrun:\n  <<: *b\n  x: 3\n", {"base": {"x": 1, "y": 2}, "run": {"x": 3, "y": 2}}),
        ("a: &a [1, 2]\nb: *a\n", {"a": [1, 2], "b": [1, 2]}),  # a small alias is fine
    ],
)
def test_what_is_no_duplicate_still_loads(text, data):
    assert parse_yaml(text, "f.yaml") == data


def test_a_set_value_with_a_key_twice_is_refused():
    with pytest.raises(ConfigError, match=r"--set 'task.params=\{a: 1, a: 2\}'.*key 'a' is given twice"):
        parse_overrides(["task.params={a: 1, a: 2}"])


# ----------------------------------------------------------------------------- alias bombs


def bomb(levels: int, width: int = 10, at: str = "x") -> str:
    """A billion laughs: level k is ``width`` aliases of level k-1, so the last expands to width**levels values."""
    lines = [f"l0: &l0 {['lol'] * width}"]
    lines += [f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * width)}]" for k in range(1, levels)]
    return "\n".join(lines) + f"\n{at}: *l{levels - 1}\n"


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails a test that builds Python objects from the document (the refusal must come before)."""

    def refuse(self, node):
        raise AssertionError("the document was built")

    monkeypatch.setattr(loader._StrictLoader, "construct_document", refuse)


def test_an_alias_bomb_is_refused_before_it_is_expanded(monkeypatch, nothing_built):
    visits = []
    children = loader._children
    monkeypatch.setattr(loader, "_children", lambda node: visits.append(1) or children(node))
    text = bomb(30)  # 10**30 values: refused at all means refused without expanding
    with pytest.raises(ConfigError) as e:
        load_yaml(text, "bomb.yaml")
    assert e.value.source == "bomb.yaml"
    assert e.value.errors[0].startswith("l4: YAML aliases (*name) expand it to more than 100,000 values")
    distinct_nodes = 1 + 2 * 31 + 10 * 30  # the top mapping, 31 keys and values, the items of the 30 lists
    assert len(visits) <= distinct_nodes


def test_the_bomb_names_the_sweep_grid_key_it_is_in():
    grid = bomb(4, at="anchors") + "grid:\n  es.sigma: [{}]\n"  # *l3: 11,111 values
    assert len(load_yaml(grid.format(", ".join(["*l3"] * 6)), "s.yaml")["grid"]["es.sigma"]) == 6  # 90,000 in all
    text = grid.format(", ".join(["*l3"] * 10))  # the grid alone: 1 + 10 * 11,111
    with pytest.raises(ConfigError, match=r"^invalid config s.yaml:\n  - grid.es.sigma: YAML aliases"):
        load_yaml(text, "s.yaml")


def test_an_anchor_inside_itself_is_refused(nothing_built):
    with pytest.raises(ConfigError, match=r"  - a: YAML aliases .* an anchor that contains itself"):
        load_yaml("a: &a [1, *a]\n", "f.yaml")


def test_the_bound_counts_every_expanded_value_exactly(monkeypatch):
    monkeypatch.setattr(loader, "MAX_YAML_NODES", 25)
    # the top mapping, keys a and b, the list (1 + 10 items) and its alias (11 again): 1 + 2 + 22 = 25
    text = "a: &a [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]\nb: *a\n"
    assert load_yaml(text, "f.yaml") == {"a": list(range(10)), "b": list(range(10))}
    with pytest.raises(ConfigError, match="more than 25 values"):
        load_yaml(text.replace("9]", "9, 10]"), "f.yaml")  # 27


def test_nesting_too_deep_for_the_parser_is_a_named_error():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300)  # the composer recurses at least once per level: 600 levels are too deep
    try:
        with pytest.raises(ConfigError, match=r"^invalid config f.yaml:\n  - YAML nested too deeply to read$"):
            load_yaml("a: " + "[" * 600 + "]" * 600, "f.yaml")
    finally:
        sys.setrecursionlimit(limit)


# ----------------------------------------------------------------------------- a data row's size


def test_a_jsonl_line_over_the_bound_is_refused_naming_file_and_line(tmp_path, monkeypatch):
    monkeypatch.setattr(gsm8k, "MAX_ROW_BYTES", 64)
    f = tmp_path / "rows.jsonl"
    at = '{"question": "' + "q" * 33 + '", "answer": "1"}'
    assert len(at) == 64
    f.write_text(at + "\n" + at + "\r\n" + at)  # exactly at the bound, with each line ending: fine
    check_row_sizes(f)
    f.write_text(at + "\n" + at.replace("q", "qq", 1) + "\n")
    with pytest.raises(DataFileError, match=rf"^{f}: line 2 is over 64 bytes, the most one row"):
        check_row_sizes(f)


def test_a_jsonl_file_that_is_one_huge_line_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr(gsm8k, "MAX_ROW_BYTES", 1000)
    monkeypatch.setitem(sys.modules, "datasets", None)  # importing the parser would fail the test
    reads = []
    f = tmp_path / "one-line.jsonl"
    f.write_text("[" + "1, " * 100_000 + "1]")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda *a, **k: reads.append(a[0]) or real_open(*a, **k)
    )  # only check_row_sizes opens it
    with pytest.raises(DataFileError, match=r"line 1 is over 1,000 bytes"):
        load_rows(str(f), "train")
    assert reads == [f]


# ----------------------------------------------------------------------------- keys the task never reads


def test_a_data_path_for_a_task_that_generates_its_problems_is_refused():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"es": {"updates": 3}, "task": {"name": "arithmetic", "data_path": "rows.jsonl"}}, "c.yaml")
    assert e.value.source == "c.yaml"
    assert e.value.errors == [
        "task.data_path: ArithmeticTask generates its problems and never reads a data file, so 'rows.jsonl' would "
        "be ignored; remove it (or pick a task that reads one). Its params: min_terms, max_terms, min_digits, "
        "max_digits, operators, allow_negation, allow_parentheses"
    ]


def test_a_data_path_for_a_task_that_reads_one_is_accepted():
    cfg = config_from_dict({"es": {"updates": 3}, "task": {"name": "countdown", "data_path": "rows.jsonl"}})
    assert cfg.task.data_path == "rows.jsonl"


def test_an_eval_task_with_a_data_path_it_never_reads_is_refused(tmp_path):
    from esbatch.config.eval import load_eval_config

    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({"name": "e", "tasks": [{"name": "chain_sum", "data_path": "x.jsonl"}]}))
    with pytest.raises(ConfigError, match=r"tasks\[0\]\.data_path: ChainSumTask generates its problems"):
        load_eval_config(str(f))
