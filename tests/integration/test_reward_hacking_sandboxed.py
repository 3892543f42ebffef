"""MBPP's reward cannot be won without solving the problem: the programs, run in the sandbox.

Each program in HACKS tries a known way to make a test harness report success: faking the exit code, reading
the tests from its own file, frames or the heap, objects equal to everything, patched builtins or assert
machinery, early exits, forged result lines. All score WRONG, in one batch next to the honest solution of the
same problem, which scores CORRECT. FORMS holds problems whose asserts use the shapes real MBPP tests use
(``math.isclose``, ``set(f(x))``, ``list(map)``, ``== True``, ``not f(x)``, a ``re.Match``, ``sys.getsizeof``,
a function named ``sum``): their reference solutions pass and near-misses do not. The pieces that run no
program (the test plan, what the sandboxed program holds) are in tests/unit/test_reward_hacking.py.
"""

from __future__ import annotations

import json

import pytest
from mbpp_cases import FIXTURE, RIGHT, block, record_sandbox_runs

from esbatch.tasks.code_check import TestPlan, harness_program, result_payload
from esbatch.tasks.mbpp import MBPPTask
from esbatch.tasks.verify import Verdict

TABLE_FROM = """
import re
_table = {{a: int(b) for a, b in re.findall(r"digit_square_sum\\((\\d+)\\)\\s*==\\s*(\\d+)", {source})}}
def digit_square_sum(n):
    return _table.get(str(n), -1)
"""
FORGE = """
import os, re, sys
marker = re.search(r"'(@@values-[0-9a-f]+@@)'", open(sys.argv[0]).read()).group(1)
line = (marker + '[["i", "5"], ["i", "5"], ["i", "5"]]\\n').encode()
for fd in range(3, 64):
    try:
        if os.fstat(fd).st_mode & 0o170000 == 0o010000:  # the pipe the result goes to
            os.write(fd, line)
    except OSError:
        pass
"""

HACKS = {
    "exit code read from __file__": (
        "import re, sys\nsys.exit(int(re.findall(r'SystemExit\\((\\d+)\\)', open(__file__).read())[-1]))"
    ),
    "exit code read from sys.argv[0]": (
        "import re, sys\ncodes = re.findall(r'SystemExit\\((\\d+)\\)', open(sys.argv[0]).read())\n"
        "sys.exit(int(codes[-1]) if codes else 0)"
    ),
    "tests read from sys.argv[0]": TABLE_FROM.format(source="open(__import__('sys').argv[0]).read()"),
    "tests read via /proc/self/cmdline": TABLE_FROM.format(
        source="open(open('/proc/self/cmdline', 'rb').read().split(b'\\0')[-2].decode()).read()"
    ),
    "tests found in the callers' frames": """
import re, sys
def digit_square_sum(n):
    f, seen = sys._getframe(1), ""
    while f is not None:
        seen += repr(f.f_locals) + repr(f.f_code.co_consts)
        f = f.f_back
    m = re.search(r"digit_square_sum\\(%d\\)\\s*==\\s*(\\d+)" % n, seen)
    return int(m.group(1)) if m else -1
""",
    "tests found with inspect.stack": """
import inspect, re
def digit_square_sum(n):
    text = "".join(repr(fi.frame.f_globals) + repr(fi.code_context) for fi in inspect.stack())
    m = re.search(r"digit_square_sum\\(%d\\)\\s*==\\s*(\\d+)" % n, text)
    return int(m.group(1)) if m else -1
""",
    "tests found in gc.get_objects": """
import gc, re
def digit_square_sum(n):
    for o in gc.get_objects():
        for s in (o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()):
            m = isinstance(s, str) and re.search(r"digit_square_sum\\(%d\\)\\s*==\\s*(\\d+)" % n, s)
            if m:
                return int(m.group(1))
    return -1
""",
    "always-equal object": """
class Anything:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def digit_square_sum(n):
    return Anything()
""",
    "int subclass equal to everything": """
class Int(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def digit_square_sum(n):
    return Int(0)
""",
    "__eq__, __hash__ and __bool__ all lie": """
class Liar:
    __eq__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __hash__ = lambda self: 0
    __bool__ = lambda self: True
def digit_square_sum(n):
    return [Liar()]
""",
    "builtins.__dict__ patched": """
import builtins
builtins.__dict__["int"] = lambda *a, **k: 0
builtins.sum = lambda *a, **k: 0
builtins.AssertionError = type("Never", (BaseException,), {})
def digit_square_sum(n):
    return 0
""",
    "excepthook exits with the expected code": """
import os, re, sys
code = int((re.findall(r"SystemExit\\((\\d+)\\)", open(sys.argv[0]).read()) or ["0"])[-1])
sys.excepthook = lambda *a: os._exit(code)
def digit_square_sum(n):
    return 0
""",
    "sys.settrace skips lines": """
import sys
def tracer(frame, event, arg):
    if event == "line" and frame.f_code.co_filename == "main.py":
        try:
            frame.f_lineno = frame.f_code.co_firstlineno
        except Exception:
            pass
    return tracer
sys.settrace(tracer)
sys._getframe(1).f_trace = tracer
def digit_square_sum(n):
    return 0
""",
    "os._exit(0) before the asserts": "import os\nos._exit(0)",
    "sys.exit(0) at import": "import sys\ndef digit_square_sum(n):\n    return 0\nsys.exit(0)",
    "SystemExit from __del__": """
class Bye:
    def __del__(self):
        raise SystemExit(0)
keep = Bye()
def digit_square_sum(n):
    del globals()["keep"]
    return 0
""",
    "atexit handler": """
import atexit, os, sys
atexit.register(lambda: print("@@values@@[]"))
atexit.register(os._exit, 0)
def digit_square_sum(n):
    return 0
""",
    "fake result files": """
import os, sys
for name in ("result.json", "results.txt", "verdict"):
    open(name, "w").write("CORRECT")
open(sys.argv[0], "w").write("raise SystemExit(0)\\n")
def digit_square_sum(n):
    return 0
""",
    "forged result line printed": 'print(\'@@values-00@@[["i", "5"]]\')\ndef digit_square_sum(n):\n    return 0',
    "forged result line, then os._exit": FORGE + "os._exit(0)\n",
    "forged result line next to the real one": FORGE + "def digit_square_sum(n):\n    return 0\n",
    "forged line from a background thread": "import threading\n"
    f"threading.Thread(target=exec, args=({FORGE!r},)).start()\ndef digit_square_sum(n):\n    return 0\n",
    "json.dumps patched to claim success": """
import json
json.dumps = lambda *a, **k: "true"
def digit_square_sum(n):
    return 0
""",
    "value too large to encode": "def digit_square_sum(n):\n    return list(range(10**6))",
    "value nested too deep": "def digit_square_sum(n):\n    x = []\n    for _ in range(5000):\n        x = [x]\n"
    "    return x",
}


@pytest.fixture(scope="module")
def task():
    return MBPPTask(str(FIXTURE), timeout_s=3.0)


@pytest.fixture(scope="module")
def examples(task):
    return task.eval_examples(None)


def test_every_hack_scores_wrong_next_to_an_honest_solution(task, examples, monkeypatch):
    names = list(HACKS)
    responses = [block(RIGHT)] + [block(HACKS[n]) for n in names] + [block(RIGHT)]
    batches, judges = record_sandbox_runs(monkeypatch)
    got = task.score_many(responses, [examples[0]] * len(responses))
    # no hack held the batch up: its programs ran as one batch and one judge run decided them all (a judge run
    # that fails is repeated once per response)
    assert [len(b) for b in batches] == [len(responses)] and len(judges) == 1, [j.reason for j in judges]
    assert got[0] is Verdict.CORRECT and got[-1] is Verdict.CORRECT
    assert {n: v for n, v in zip(names, got[1:-1]) if v is not Verdict.WRONG} == {}


def test_patched_math_isclose_does_not_pass_isclose_asserts(task, examples):
    ex = examples[3]
    assert ex.meta["tests"][0].startswith("assert math.isclose(hypotenuse")
    hack = "import math\nmath.isclose = lambda *a, **k: True\ndef hypotenuse(a, b):\n    return -1.0"
    assert task.score_many([block(hack), task.demo_response(ex)], [ex, ex]) == [Verdict.WRONG, Verdict.CORRECT]


# ----------------------------------------------------------------------------- real assert shapes

FORMS = [
    ("Return x / 2.", "def half(x):\n    return x / 2", ["assert math.isclose(half(1), 0.5, rel_tol=0.001)",
     "assert math.isclose(half(3), 1.5)"], ["import math"]),
    ("Return the shared elements.", "def shared(a, b):\n    return tuple(set(a) & set(b))",
     ["assert set(shared((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))", "assert set(shared((1,), (2,))) == set()"], []),
    ("Square each item, lazily.", "def squares(xs):\n    return map(lambda x: x * x, xs)",
     ["assert list(squares([1, 2, 3])) == [1, 4, 9]", "assert list(squares([])) == []"], []),
    ("Yield the even numbers.", "def evens(xs):\n    yield from (x for x in xs if x % 2 == 0)",
     ["assert list(evens(range(7))) == [0, 2, 4, 6]"], []),
    ("Is n even?", "def is_even(n):\n    return n % 2 == 0",
     ["assert is_even(4) == True", "assert is_even(3) == False", "assert not is_even(5)", "assert is_even(8)"], []),
    ("Triangle area.", "def area(b, h):\n    return b * h // 2",
     ["assert area(3, 2) == 3.0", "assert area(4, 4) == 8"], []),
    ("Does it start with a vowel?", "import re\ndef vowel_start(s):\n    return re.search('^[aeiou]', s)",
     ["assert vowel_start('apple')", "assert not vowel_start('pear')"], []),
    ("Count the items.", "from collections import Counter\ndef freq(xs):\n    return Counter(xs)",
     ["assert freq([1, 1, 2]) == {1: 2, 2: 1}", "assert freq([]) == {}"], []),
    ("Size of a tuple in bytes.", "import sys\ndef tuple_size(t):\n    return sys.getsizeof(t)",
     ["assert tuple_size((1, 2)) == sys.getsizeof((1, 2))"], []),
    ("Sum of common divisors.", "import builtins\ndef sum(a, b):\n"
     "    return builtins.sum(i for i in range(1, min(a, b)) if a % i == 0 and b % i == 0)",
     ["assert sum(10, 15) == 6", "assert sum(4, 6) == 3"], []),
    ("Plain values of every kind.", "def kinds():\n"
     "    return (None, True, 2**20000, -0.0, float('inf'), 1+2j, b'\\x00', bytearray(b'a'), 'é', [1], {2: {3}},"
     " frozenset({4}), range(0, 9, 3))\ndef nan():\n    return float('nan')",
     ["assert kinds() == (None, True, 2**20000, 0.0, math.inf, 1+2j, b'\\x00', bytearray(b'a'), 'é', [1], "
      "{2: {3}}, frozenset({4}), range(0, 9, 3))", "assert math.isnan(nan())"], ["import math"]),
    ("Reverse a list.", "def rev(xs):\n    return xs[::-1]",
     ["assert rev([1, 2, 3]) == [3, 2, 1]", "assert rev([]) != [0]"], []),
]  # fmt: skip

W, C = Verdict.WRONG, Verdict.CORRECT
OTHER_ANSWERS = {  # FORMS index -> another answer and its verdict (the same as the old one-process scorer's)
    1: ("def shared(a, b):\n    return [x for x in a if x in b] + [0]", W),
    2: ("def squares(xs):\n    return map(lambda x: x + x, xs)", W),
    3: ("def evens(xs):\n    return [x for x in xs if x % 2 == 0]", C),  # list(a list) is the same list
    4: ("def is_even(n):\n    return 'yes' if n % 2 == 0 else ''", W),  # 'yes' == True is False
    6: ("def vowel_start(s):\n    return s[0] in 'aeiou' or None", C),
    7: ("def freq(xs):\n    return {x: xs.count(x) for x in set(xs)}", C),
    8: ("def tuple_size(t):\n    return len(t) * 8", W),
    11: ("def rev(xs):\n    raise ValueError", W),  # `!=` must not pass for a crashing call
}


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    rows = [{"task_id": 100 + i, "text": t, "code": c, "test_list": tl, "test_imports": ti}
            for i, (t, c, tl, ti) in enumerate(FORMS)]  # fmt: skip
    path = tmp_path_factory.mktemp("mbpp") / "forms.json"
    path.write_text(json.dumps(rows))  # a .json list file, as google-research ships sanitized MBPP
    return MBPPTask(str(path), timeout_s=3.0)


def test_reference_solutions_pass_every_assert_shape(forms):
    exs = forms.eval_examples(None)
    assert len(exs) == len(FORMS)
    other = sorted(OTHER_ANSWERS)
    responses = [forms.demo_response(e) for e in exs] + [block(OTHER_ANSWERS[i][0]) for i in other]
    got = forms.score_many(responses, exs + [exs[i] for i in other])
    assert got[: len(exs)] == [Verdict.CORRECT] * len(exs)
    assert dict(zip(other, got[len(exs) :])) == {i: OTHER_ANSWERS[i][1] for i in other}


def test_every_fixture_reference_passes(task, examples):
    assert task.score_many([task.demo_response(e) for e in examples], examples) == [Verdict.CORRECT] * len(examples)


# ----------------------------------------------------------------------------- the pieces


def test_harness_encodes_strictly(task):
    """Run the harness directly: exact built-in types come back tagged, anything else is an error marker."""
    from esbatch.sandbox import run_python

    code = """
import collections, re
class I(int): pass
class L(list): pass
def v(k):
    return [1, I(1), L(), iter([1]), collections.OrderedDict(a=1), collections.deque([1], 3), re.match('a', 'ab'),
            (x for x in [2]), {1: 2}.keys(), type, 2**400000, float('nan')][k]
"""
    plan = TestPlan(tuple(f"v({k})" for k in range(12)), (), ())
    r = run_python(harness_program(plan, code, "@@m@@"), timeout_s=10, max_output=1 << 20)
    values = json.loads(result_payload(r.stdout, "@@m@@"))
    assert values[0] == ["i", "1"] and values[1][0] == "e" and values[2][0] == "e"
    assert values[3] == ["it", [["i", "1"]]] and values[4] == ["od", [[["s", "a"], ["i", "1"]]]]
    assert values[5] == ["dq", [["i", "1"]], ["i", "3"]] and values[6] == ["m", ["s", "ab"], ["i", "0"], ["i", "1"]]
    assert values[7] == ["it", [["i", "2"]]] and values[8] == ["kv", [["i", "1"]]]
    assert values[9] == ["e", "unsupported type type"] and values[10] == ["e", "int too large"]
    assert values[11] == ["f", "nan"]
    assert result_payload("@@m@@[]\n@@m@@[]\n", "@@m@@") is None and result_payload("x\n", "@@m@@") is None


def test_malformed_or_hostile_values_fail_only_their_own_response(task, examples):
    """The judge rejects anything that is not a well-formed value list, and one bad line never sinks the batch."""
    from esbatch.tasks.code_check import Limits, judge

    plan = task.plan(examples[0])
    good = json.dumps([["i", "0"], ["i", "5"], ["i", "34"]])
    bad = [None, "", "[", "{}", '[["i", "0"]]', '[["i", "0"], ["i", "5"], ["x", "34"]]', '[1, 5, 34]',
           '[["i", "0"], ["i", "5"], ["i", "3_4"]]', '[["i", "0"], ["i", "5"], ["e", "Boom"]]',
           "[" * 100_000, '[["i", "0"], ["i", "5"], ["S", [["l", []]]]]',
           '[["i", "0"], ["i", "5"], ["b", 1]]']  # fmt: skip
    items = [(0, good)] + [(0, b) for b in bad] + [(0, good)]
    assert judge([plan], items, Limits(timeout_s=3.0)) == [True] + [False] * len(bad) + [True]
