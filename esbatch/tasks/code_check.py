"""Checking model-written code against dataset asserts without letting the code see or grade its own tests.

Running ``solution + asserts`` and reading the exit code rewards faking it (early exit, patched ``builtins`` or
``AssertionError``, an ``__eq__`` that is always True), so the asserts are split in three steps:
1. Plan (trusted): each assert is parsed with ``ast``; each outermost call of a solution name, and each other bare
   solution name (not bound by the setup, not a builtin unless the reference solution defines it), becomes ``__v[i]``.
2. Harness (sandbox): run setup and solution, evaluate only the placeholders, and write their values, as tagged JSON
   of plain built-ins with exact types, on one marked line of a private stdout (fd 1 is /dev/null).
3. Judge (sandbox runs over a batch's values, trusted code only): decode them and evaluate each rewritten assert; a
   response passes iff all are truthy. A forged line only claims return values; the expected ones are never seen.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import secrets
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from esbatch.sandbox import SandboxResult, run_many, run_python

PLACEHOLDER = "__v"
#: encoded JSON kept per solution (the sandbox captures this much of stdout, plus slack)
MAX_RESULT_CHARS = 1 << 20
#: responses' encoded values per judge run; a larger batch is judged in several runs
JUDGE_CHUNK_CHARS = 32 << 20
_BUILTINS = frozenset(dir(builtins))
_MODULES = frozenset(sys.stdlib_module_names)


@dataclass(frozen=True)
class TestPlan:
    """A problem's test list split into what runs beside the solution and what the judge evaluates."""

    __test__ = False  # not a pytest class

    calls: tuple[str, ...]  # placeholder expressions, evaluated in the solution's namespace
    asserts: tuple[tuple[str, tuple[int, ...]], ...]  # rewritten assert expression, the placeholders it uses
    setup: tuple[str, ...]  # test setup (+ imports of stdlib modules the tests use): harness and judge


# ----------------------------------------------------------------------------- planning (trusted)


def _binders(tree: ast.AST) -> Iterator[tuple[str, bool]]:
    """(name, bound by an import) for the names a module binds at its top level (not inside functions)."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, False
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from ((a.asname or a.name.split(".")[0], True) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.id, False
        elif not isinstance(node, ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))


def _parse(src: str) -> ast.Module | None:
    try:
        return ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class _Lifter(ast.NodeTransformer):
    """Replaces each outermost expression rooted at a solution name by ``__v[i]``."""

    def __init__(self, solution: set[str], local: set[str], calls: list[str]) -> None:
        self.solution, self.local, self.calls, self.used = solution, local, calls, []

    def _rooted(self, node: ast.AST) -> bool:
        while isinstance(node, (ast.Call, ast.Attribute)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return isinstance(node, ast.Name) and node.id in self.solution

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and self._rooted(node):
            read, inner, _ = _test_names(node)  # a lambda/comprehension inside the call is self-contained
            if read & (self.local - inner):
                raise ValueError(f"{ast.unparse(node)!r} uses a name bound elsewhere in the assert")
            self.used.append(len(self.calls))
            self.calls.append(ast.unparse(node))
            return ast.Subscript(ast.Name(PLACEHOLDER, ast.Load()), ast.Constant(self.used[-1]), ast.Load())
        return super().visit(node)


def _test_names(test: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """(names read, names bound inside the test, names read other than as the base of ``name.attr``)."""
    read, local, bare = set(), set(), set()
    bases = {id(n.value) for n in ast.walk(test) if isinstance(n, ast.Attribute)}
    for n in ast.walk(test):
        if isinstance(n, ast.Name):
            (read if isinstance(n.ctx, ast.Load) else local).add(n.id)
            if id(n) not in bases:
                bare.add(n.id)
        elif isinstance(n, ast.arg):
            local.add(n.arg)
    return read, local, bare


def plan_tests(tests: Sequence[str], setup: Sequence[str], reference: str = "") -> TestPlan:
    """Split ``tests`` (assert statements) into placeholder calls and judge expressions; ValueError if a test is
    not made of asserts or needs a solution value inside a comprehension/lambda of its own."""
    bound = {name for s in setup if (t := _parse(s)) for name, _ in _binders(t)}
    ref = _parse(reference) if reference else None
    redefined = {n for n, imported in (_binders(ref) if ref else ()) if not imported and n in _BUILTINS}
    calls: list[str] = []
    asserts: list[tuple[str, tuple[int, ...]]] = []
    modules: set[str] = set()
    for test in tests:
        tree = _parse(test)
        if tree is None or not tree.body or not all(isinstance(s, ast.Assert) for s in tree.body):
            raise ValueError(f"not an assert statement: {test[:200]!r}")
        for stmt in tree.body:
            read, local, bare = _test_names(stmt.test)
            free = read - local - bound - {PLACEHOLDER}
            mods = {n for n in free - bare - redefined if n in _MODULES}
            solution = {n for n in free - mods if n not in _BUILTINS or n in redefined}
            lifter = _Lifter(solution, local, calls)
            expr = lifter.visit(stmt.test)
            asserts.append((ast.unparse(expr), tuple(lifter.used)))
            modules |= mods
    imports = tuple(f"import {m}" for m in sorted(modules))
    return TestPlan(tuple(calls), tuple(asserts), tuple(setup) + imports)


# ----------------------------------------------------------------------------- the harness (sandbox, untrusted)

_HARNESS = r"""
import builtins as _B, collections as _C, itertools as _IT, json as _J, os as _OS, re as _RE, sys as _SYS

globals().update({k: v for k, v in vars(_B).items() if not k.startswith("__")})  # immune to patched builtins
_OUT = _OS.dup(1)  # the result channel; the solution's prints go to /dev/null
_OS.dup2(_OS.open(_OS.devnull, _OS.O_WRONLY), 1)
_type, _len, _dumps, _exec, _eval, _compile = type, len, _J.dumps, exec, eval, compile
_frepr, _bits, _digits = float.__repr__, int.bit_length, _SYS.set_int_max_str_digits
_write, _exit = _OS.write, _OS._exit
_ditems, _dqiter = dict.items, _C.deque.__iter__
_PLAIN = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_MAPS = {dict: "d", _C.OrderedDict: "od", _C.Counter: "ctr", _C.defaultdict: "dd"}
_VIEWS = {type({}.keys()): "kv", type({}.values()): "vv", type({}.items()): "iv"}
_ITERS = {map, filter, zip, enumerate, reversed, _type((lambda: (yield))()), _type(iter(int, 1))}
_ITERS |= {_type(iter(x)) for x in ([], (), "", b"", bytearray(), set(), {}, {}.values(), {}.items(), range(0),
                                     range(1 << 70), _C.deque())}
_ITERS |= {_type(reversed(x)) for x in ([], range(0), range(1 << 70), {}, {}.values(), {}.items(), _C.deque())}
_ITERS |= {t for t in vars(_IT).values() if _type(t) is type}
_MAX_ITEMS, _MAX_BITS, _MAX_DEPTH = 100_000, 332_200, 100


class _Bad(Exception):
    pass


def _enc(v, n, d=0):
    n[0] -= 1
    if d > _MAX_DEPTH or n[0] < 0:
        raise _Bad("too large or too deep")
    t = _type(v)
    if v is None:
        return None
    if t is bool:
        return ["b", v]
    if t is int:
        if _bits(v) > _MAX_BITS:
            raise _Bad("int too large")
        _digits(0)
        return ["i", int.__repr__(v)]
    if t is float:
        return ["f", _frepr(v)]
    if t is complex:
        return ["c", _frepr(v.real), _frepr(v.imag)]
    if t is str:
        return ["s", v]
    if t is bytes or t is bytearray:
        return ["y" if t is bytes else "ba", v.hex()]
    if t is range:
        return ["r", _enc(v.start, n, d + 1), _enc(v.stop, n, d + 1), _enc(v.step, n, d + 1)]
    if t in _PLAIN:
        return [_PLAIN[t], [_enc(x, n, d + 1) for x in v]]
    if t in _MAPS:
        return [_MAPS[t], [[_enc(k, n, d + 1), _enc(x, n, d + 1)] for k, x in _ditems(v)]]
    if t is _RE.Match:
        return ["m", _enc(v.string, n, d + 1), _enc(v.start(), n, d + 1), _enc(v.end(), n, d + 1)]
    if t is _C.deque:
        return ["dq", [_enc(x, n, d + 1) for x in _dqiter(v)], _enc(v.maxlen, n, d + 1)]
    if t in _VIEWS or t in _ITERS:
        items = []
        for x in v:
            if _len(items) >= _MAX_ITEMS:
                raise _Bad("iterator too long")
            items.append(x)
        return [_VIEWS.get(t, "it"), [_enc(x, n, d + 1) for x in items]]
    raise _Bad("unsupported type " + str(t.__name__)[:80])


def _main(setup, solution, calls, marker):
    ns = {"__name__": "__main__", "__builtins__": _B}
    failed = None
    try:
        for s in setup:
            _exec(_compile(s, "<setup>", "exec", dont_inherit=True), ns)
        _exec(_compile(solution, "<solution>", "exec", dont_inherit=True), ns)
    except BaseException as e:
        failed = ["e", "solution raised " + _type(e).__name__]
    out, size = [], 0
    for expr in calls:
        value = failed
        if value is None:
            try:
                value = _enc(_eval(_compile(expr, "<test>", "eval", dont_inherit=True), ns), [_MAX_ITEMS])
            except BaseException as e:
                value = ["e", e.args[0] if _type(e) is _Bad else str(_type(e).__name__)[:80]]
        try:
            text = _dumps(value)
        except BaseException as e:
            text = _dumps(["e", "unencodable " + _type(e).__name__])
        size += _len(text)
        out.append(text if size <= MAX_RESULT_CHARS else '["e", "result too large"]')
    data = (marker + "[" + ", ".join(out) + "]\n").encode()
    while data:
        data = data[_write(_OUT, data):]
    _exit(0)

"""


def harness_program(plan: TestPlan, code: str, marker: str) -> str:
    """The sandboxed program for one solution: prints ``marker`` + the encoded placeholder values."""
    args = ", ".join(repr(x) for x in (list(plan.setup), code, list(plan.calls), marker))
    return f"{_HARNESS}\nMAX_RESULT_CHARS = {MAX_RESULT_CHARS}\n_main({args})\n"


def result_payload(stdout: str, marker: str) -> str | None:
    """The JSON after ``marker`` when stdout holds exactly one marked line (else None: missing or forged twice)."""
    lines = [line for line in stdout.split("\n") if line.startswith(marker)]
    return lines[0][len(marker) :] if len(lines) == 1 else None


# ----------------------------------------------------------------------------- the judge (sandbox, trusted code)

_JUDGE = r'''
import collections as _C, json as _J, re as _RE, sys as _SYS

_SYS.set_int_max_str_digits(0)


class _Err:
    """An errored placeholder (the solution raised, or returned something that is not a plain value)."""


def _str(a):
    if len(a) != 1 or type(a[0]) is not str:
        raise ValueError("malformed")
    return a[0]


def _items(a, d):
    if len(a) != 1 or type(a[0]) is not list:
        raise ValueError("malformed")
    return [_dec(x, d + 1) for x in a[0]]


def _pairs(a, d):
    if len(a) != 1 or type(a[0]) is not list or any(type(p) is not list or len(p) != 2 for p in a[0]):
        raise ValueError("malformed")
    return [(_dec(k, d + 1), _dec(v, d + 1)) for k, v in a[0]]


_SEQ = {"l": list, "t": tuple, "S": set, "F": frozenset, "it": iter, "kv": lambda xs: dict.fromkeys(xs).keys(),
        "vv": lambda xs: dict(enumerate(xs)).values()}
_MAP = {"d": dict, "od": _C.OrderedDict, "ctr": lambda p: _C.Counter(dict(p)), "dd": lambda p: _C.defaultdict(None, p),
        "iv": lambda p: dict(p).items()}


def _dec(x, d=0):
    if x is None:
        return None
    if d > 120 or type(x) is not list or not x or type(x[0]) is not str:
        raise ValueError("malformed")
    tag, a = x[0], x[1:]
    if tag == "b" and len(a) == 1 and type(a[0]) is bool:
        return a[0]
    if tag == "i":
        s = _str(a)
        if len(s) > 110_000 or not s.lstrip("-").isdigit() or not s.isascii():
            raise ValueError("malformed int")
        return int(s)
    if tag == "f":
        return float(_str(a))
    if tag == "c" and len(a) == 2 and all(type(p) is str for p in a):
        return complex(float(a[0]), float(a[1]))
    if tag == "s":
        return _str(a)
    if tag in ("y", "ba"):
        return (bytes if tag == "y" else bytearray).fromhex(_str(a))
    if tag in _SEQ:
        return _SEQ[tag](_items(a, d))
    if tag in _MAP:
        return _MAP[tag](_pairs(a, d))
    if tag == "r" and len(a) == 3:
        return range(*(_int(_dec(p, d + 1)) for p in a))
    if tag == "m" and len(a) == 3:
        return _match(_dec(a[0], d + 1), _int(_dec(a[1], d + 1)), _int(_dec(a[2], d + 1)))
    if tag == "dq" and len(a) == 2:
        maxlen = _dec(a[1], d + 1)
        return _C.deque(_items(a[:1], d), None if maxlen is None else _int(maxlen))
    raise ValueError("malformed")


def _int(v):
    if type(v) is not int:
        raise ValueError("malformed")
    return v


def _match(s, start, end):
    """A real ``re.Match`` over the same string and span (what truthiness, ``.span()`` and ``[0]`` see)."""
    if type(s) not in (str, bytes) or not 0 <= start <= end <= len(s):
        raise ValueError("malformed match")
    pattern = "(?s).{%d}" % (end - start)
    return _RE.compile(pattern if type(s) is str else pattern.encode()).match(s, start)


def _values(payload, n):
    raw = _J.loads(payload)
    if type(raw) is not list or len(raw) != n:
        raise ValueError("wrong number of values")
    return [_Err if type(x) is list and x[:1] == ["e"] else _dec(x) for x in raw]


def _base(setup):
    ns = {"__name__": "__judge__"}
    for s in setup:
        exec(compile(s, "<setup>", "exec", dont_inherit=True), ns)
    return ns


def _judge(plan, base, payload):
    values = _values(payload, plan["n"])
    ns = dict(base, **{PLACEHOLDER: values})
    for code, used in plan["asserts"]:
        if any(values[i] is _Err for i in used) or not eval(code, ns):
            return False
    return True


def _run(plans, items, marker):
    bases, verdicts = {}, []
    for p in plans:
        p["asserts"] = [(compile(e, "<assert>", "eval", dont_inherit=True), u) for e, u in p["asserts"]]
    for pi, payload in items:
        try:
            if pi not in bases:
                bases[pi] = _base(plans[pi]["setup"])
            ok = payload is not None and _judge(plans[pi], bases[pi], payload) is True
        except BaseException:
            ok = False
        verdicts.append(ok)
    print(marker + _J.dumps(verdicts), flush=True)

'''


def judge_program(plans: Sequence[TestPlan], items: Sequence[tuple[int, str | None]], marker: str) -> str:
    """The judge for ``items`` = (index into ``plans``, encoded values or None); prints marker + [bool, ...]."""
    spec = [{"setup": list(p.setup), "asserts": [list(a) for a in p.asserts], "n": len(p.calls)} for p in plans]
    data = json.dumps([spec, [list(i) for i in items]])
    return f"{_JUDGE}\nPLACEHOLDER = {PLACEHOLDER!r}\n_run(*_J.loads({data!r}), {marker!r})\n"


# ----------------------------------------------------------------------------- orchestration


@dataclass(frozen=True)
class Limits:
    """Sandbox limits of one solution run; the judge gets more (it evaluates a whole batch)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    workers: int | None = None
    allow_unconfined: bool = False  # run even where the sandbox's namespaces are refused (rlimits only)


def _judge_chunks(items: list[tuple[int, str | None]]) -> Iterator[list[int]]:
    """Indices of ``items``, grouped so no judge program holds more than JUDGE_CHUNK_CHARS of values."""
    group: list[int] = []
    size = 0
    for i, (_, payload) in enumerate(items):
        n = len(payload or "")
        if group and size + n > JUDGE_CHUNK_CHARS:
            yield group
            group, size = [], 0
        group.append(i)
        size += n
    if group:
        yield group


JudgeRun = tuple["list[bool] | None", "BaseException | None"]


def _run_judge(plans: Sequence[TestPlan], items: list[tuple[int, str | None]], limits: Limits) -> JudgeRun:
    """(verdicts, None) of one judge run; (None, None) when it did not finish (a timeout, a crash); (None, the
    exception) when the sandbox raised (``judge`` tells a sandbox that cannot start from a response breaking it)."""
    marker = f"@@judge-{secrets.token_hex(16)}@@"
    timeout = max(10.0, 2 * limits.timeout_s) + 0.05 * len(items)
    size_mb = sum(len(p or "") for _, p in items) >> 20
    try:
        r = run_python(
            judge_program(plans, items, marker),
            timeout_s=timeout,
            cpu_s=math.ceil(timeout),
            memory_mb=max(1024, limits.memory_mb) + 16 * size_mb,
            max_output=64_000 + 8 * len(items),
            allow_unconfined=limits.allow_unconfined,
        )
    except Exception as e:  # the sandbox could not run it: these responses fail, unless it never runs (judge)
        print(f"warning: MBPP judge did not run ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
        return None, e
    lines = [line for line in r.stdout.split("\n") if line.startswith(marker)]
    try:
        verdicts = json.loads(lines[-1][len(marker) :]) if lines and r.ok else None
    except ValueError:
        verdicts = None
    ok = isinstance(verdicts, list) and len(verdicts) == len(items) and all(type(v) is bool for v in verdicts)
    return (verdicts if ok else None), None


class SandboxUnavailable(RuntimeError):
    """The sandbox raised for every judge run of a batch, one response at a time too: it cannot start here, so
    no response can be judged (raised, so a training run stops instead of scoring every response WRONG)."""


def judge(plans: Sequence[TestPlan], items: list[tuple[int, str | None]], limits: Limits) -> list[bool]:
    """Run the judge over ``items``; a run that does not finish is repeated one response at a time, so one
    pathological value fails only its own response. When the sandbox raised for every one of those single runs
    too, it cannot start: SandboxUnavailable."""
    verdicts = [False] * len(items)
    for group in _judge_chunks(items):
        sub = [items[i] for i in group]
        got, error = _run_judge(plans, sub, limits)
        errors = [error]
        if got is None and len(sub) > 1:
            print(f"warning: MBPP judge failed on {len(sub)} responses; judging them one by one", file=sys.stderr)
            each = _judge_each(plans, sub, limits)
            got, errors = [bool(v and v[0]) for v, _ in each], [e for _, e in each]
        if got is None or not any(got):
            if all(e is not None for e in errors):
                e = errors[0]
                raise SandboxUnavailable(
                    f"the code sandbox could not run any of {len(sub)} judge programs ({type(e).__name__}: "
                    f"{str(e)[:300]}); see docs/evaluation.md for what it needs (user namespaces or "
                    "allow_unconfined, a cgroup)"
                ) from e
        for i, ok in zip(group, got or [False] * len(sub)):
            verdicts[i] = ok
    return verdicts


def _run_each(programs: list[str], workers: int | None, limits_kw: dict) -> list:
    """``run_python`` per program, None where the sandbox raised; raises only when it raised for every one."""

    def one(code: str) -> SandboxResult | Exception:
        try:
            return run_python(code, **limits_kw)
        except Exception as e:
            return e

    with ThreadPoolExecutor(max_workers=workers or None) as pool:
        results = list(pool.map(one, programs))
    errors = [r for r in results if isinstance(r, Exception)]
    if len(errors) == len(results):
        raise errors[0]
    if errors:
        print(
            f"warning: the sandbox failed on {len(errors)} MBPP programs ({type(errors[0]).__name__}: "
            f"{str(errors[0])[:200]}); they score WRONG",
            file=sys.stderr,
        )
    return [None if isinstance(r, Exception) else r for r in results]


def _judge_each(plans: Sequence[TestPlan], items: list[tuple[int, str | None]], limits: Limits) -> list[JudgeRun]:
    with ThreadPoolExecutor(max_workers=limits.workers or None) as pool:
        return list(pool.map(lambda item: _run_judge(plans, [item], limits), items))


def check_solutions(codes: Sequence[str], plans: Sequence[TestPlan], limits: Limits) -> list[bool]:
    """Whether each code passes its plan's asserts: the solutions run in parallel sandboxes, then one judge."""
    if len(codes) != len(plans):
        raise ValueError(f"{len(codes)} programs for {len(plans)} test plans")
    if not codes:
        return []
    marker = f"@@values-{secrets.token_hex(16)}@@"
    programs = [harness_program(p, c, marker) for c, p in zip(codes, plans)]
    limits_kw = dict(timeout_s=limits.timeout_s, cpu_s=max(1, math.ceil(limits.timeout_s)),
                     memory_mb=limits.memory_mb, max_output=MAX_RESULT_CHARS + 64_000,
                     allow_unconfined=limits.allow_unconfined)  # fmt: skip
    try:
        results = run_many(programs, workers=limits.workers, **limits_kw)
    except Exception:  # one program made the sandbox itself fail: run them one by one, that one fails
        results = _run_each(programs, limits.workers, limits_kw)
    where: dict[TestPlan, int] = {}
    for p in plans:
        where.setdefault(p, len(where))
    items = [(where[p], r and result_payload(r.stdout, marker)) for p, r in zip(plans, results)]
    return judge(list(where), items, limits)
