r"""Mathematical equivalence of final answers (MATH-500, AIME, AMC, DeepScaleR) through ``math-verify``.

Cheap cases stay in process: two plain numbers (``parse_number``: ``1,000``, ``\frac{1}{2}``, ``$5``,
``5 \text{ cm}``, ``x = 3``; bare letters outside ``\text{}`` make an answer not plain) compare exactly as fractions
(``0.333333 != 1/3``, ``50\%`` == 50); strings identical up to whitespace are equal; an answer longer than
``MAX_ANSWER_CHARS`` (no gold answer is) is compared as a string only. Everything else is
``verify(parse(gold), parse(pred))``, both wrapped in ``\boxed{}``, in persistent worker processes (sympy can run
unbounded; math-verify's signal-based limits need the main thread): a call waits at most ``timeout_s``, then kills
the worker and counts *not equal* (:func:`timeout_count`). Any number of threads may call at once; results
(timeouts included) are memoized per (pred, gold), since Maj@K repeats answers.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import resource
import select
import subprocess
import sys
import threading
import time
from enum import StrEnum
from fractions import Fraction
from pathlib import Path
from typing import Any

from esbatch.tasks.verify import Verdict, extract_boxed, parse_number

logger = logging.getLogger(__name__)

#: Address-space cap for a worker: a runaway sympy evaluation hits MemoryError instead of the host's OOM killer.
WORKER_MEMORY_LIMIT_BYTES = 4 << 30
#: A fresh worker imports sympy and math-verify; this is not charged to the caller's ``timeout_s``.
WORKER_STARTUP_TIMEOUT_S = 120.0
#: Idle workers kept for reuse (one per core: the evaluator scores with a thread per core); more concurrent
#: callers get extra workers that are closed afterwards.
MAX_IDLE_WORKERS = max(4, os.cpu_count() or 4)
#: Longer answers are compared as strings only (see the module docstring).
MAX_ANSWER_CHARS = 2000


class Match(StrEnum):
    EQUAL = "equal"
    UNEQUAL = "unequal"
    TIMEOUT = "timeout"  # gave up after timeout_s; counts as unequal


# ----------------------------------------------------------------------------- cheap in-process checks

# \text{...}-style groups hold units or words; \frac-style commands are part of a plain number.
_TEXT_GROUP = re.compile(r"\\(?:text|mathrm|textbf|mathbf|mbox)\{[^}]*\}")
_NUMBER_COMMANDS = re.compile(r"\\[dt]?frac")
_ASSIGNED = re.compile(r"^\s*[a-zA-Z]\s*=")


def plain_number(s: str) -> Fraction | None:
    r"""``parse_number(s)`` when ``s`` is a plain number (possibly with ``\text{}`` units), else None.

    ``parse_number`` also strips bare trailing letters as units (``5 cm`` -> 5), which would make ``3x`` equal
    to 3; here any ASCII letter outside ``\text{}`` groups, ``\frac`` and a leading ``x =`` means "not plain".
    """
    bare = _NUMBER_COMMANDS.sub("", _ASSIGNED.sub("", _TEXT_GROUP.sub(" ", s)))
    if re.search(r"[a-zA-Z]", bare):
        return None
    return parse_number(s)


def _squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


# ----------------------------------------------------------------------------- the worker side


def _mv_parse(s: str) -> list[Any]:
    from math_verify import parse

    return parse("\\boxed{" + s + "}", parsing_timeout=None)


def _op_equal(pred: str, gold: str) -> bool:
    from math_verify import verify

    g, p = _mv_parse(gold), _mv_parse(pred)
    return bool(g and p and verify(g, p, timeout_seconds=None))


def _op_key(s: str) -> str | None:
    """Canonical string of math-verify's parse: unevaluated products sorted (``\\pi \\cdot 2`` -> ``2*pi``),
    ``x = 3`` -> ``3``, rationals as ``p/q`` like ``Fraction``; None when nothing parses to sympy."""
    import sympy

    exprs = [e for e in _mv_parse(s) if isinstance(e, (sympy.Basic, sympy.MatrixBase))]
    if not exprs:
        return None
    e = exprs[0]
    if isinstance(e, sympy.Eq) and isinstance(e.lhs, sympy.Symbol):
        e = e.rhs
    try:
        e = e.doit()
    except Exception:
        pass
    if isinstance(e, sympy.Rational):
        return str(Fraction(int(e.p), int(e.q)))
    return str(e)


_OPS = {"equal": _op_equal, "key": _op_key}


def _serve() -> None:
    """Worker entry point: one JSON request per stdin line -> one JSON result per line on the original stdout."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol
    try:
        limit = int(os.environ.get("ESBATCH_MATH_WORKER_MEMORY", WORKER_MEMORY_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning is expected
    import math_verify  # noqa: F401  (import before saying ready, so the caller's timeout covers only the work)

    out.write(b'"ready"\n')
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            result = _OPS[req["op"]](*req["args"])
        except (Exception, MemoryError):  # unparseable input, sympy errors, the memory cap: "no result"
            result = None
        out.write(json.dumps(result).encode() + b"\n")


# ----------------------------------------------------------------------------- the caller side


class _Timeout(Exception):
    pass


class _WorkerGone(Exception):
    pass


class _Worker:
    """One worker process. A plain subprocess rather than multiprocessing: spawn re-imports the caller's
    ``__main__`` (breaks stdin scripts), fork is unsafe from a threaded evaluator, and daemonic processes may
    not have multiprocessing children."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the esbatch package
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        env["ESBATCH_MATH_WORKER_MEMORY"] = str(WORKER_MEMORY_LIMIT_BYTES)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from esbatch.tasks.verify_math import _serve; _serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        self.buf = b""
        try:
            ready = self.recv(WORKER_STARTUP_TIMEOUT_S)
        except (_Timeout, _WorkerGone) as e:
            self.kill()
            raise RuntimeError(f"math-verify worker did not start ({type(e).__name__})") from e
        if ready != "ready":
            self.kill()
            raise RuntimeError(f"math-verify worker said {ready!r} instead of 'ready'")

    def send(self, op: str, args: tuple[str, ...]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}).encode() + b"\n")
        except (BrokenPipeError, OSError) as e:
            raise _WorkerGone from e

    def recv(self, timeout_s: float) -> Any:
        """The next result line; _Timeout when none arrives within ``timeout_s``, _WorkerGone if the worker died."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Timeout
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _WorkerGone
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


_idle: list[_Worker] = []
_lock = threading.Lock()
_timeouts = 0


def _checkout() -> _Worker:
    with _lock:
        if _idle:
            return _idle.pop()
    return _Worker()


def _checkin(w: _Worker) -> None:
    with _lock:
        if len(_idle) < MAX_IDLE_WORKERS:
            _idle.append(w)
            return
    w.kill()


def _call(op: str, args: tuple[str, ...], timeout_s: float) -> Any:
    """Run one op in a worker; raises _Timeout (after killing the worker) when it takes over ``timeout_s``."""
    global _timeouts
    w = _checkout()
    try:
        w.send(op, args)
        result = w.recv(timeout_s)
    except _WorkerGone:  # it died (e.g. killed for memory): same as a failed check
        w.kill()
        return None
    except _Timeout:
        w.kill()  # the only way to stop sympy
        with _lock:
            _timeouts += 1
        raise
    _checkin(w)
    return result


def start_workers(n: int) -> None:
    """Start ``n`` idle workers now (in parallel), so the first ``n`` concurrent checks do not wait for start-up."""
    with _lock:
        need = max(0, min(n, MAX_IDLE_WORKERS) - len(_idle))
    threads = [threading.Thread(target=lambda: _checkin(_Worker())) for _ in range(need)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def shutdown_workers() -> None:
    """Stop the idle workers (busy ones are killed at their timeout or when this process exits)."""
    with _lock:
        workers = list(_idle)
        _idle.clear()
    for w in workers:
        w.kill()


atexit.register(shutdown_workers)


def timeout_count() -> int:
    """How many math-verify checks in this process were abandoned at their time limit."""
    return _timeouts


# ----------------------------------------------------------------------------- public API


@functools.lru_cache(maxsize=100_000)
def _compare_cached(pred: str, gold: str, timeout_s: float) -> Match:
    # Timeouts are cached too: Maj@32 often repeats one answer 32 times, and a pair that ran out of time
    # once would very likely do so again (and the same verdict every time keeps scores and keys consistent).
    try:
        return Match.EQUAL if _call("equal", (pred, gold), timeout_s) else Match.UNEQUAL
    except _Timeout:
        logger.warning(
            "math-verify gave up after %.1f s (counted as not equal): pred=%.80r gold=%.80r", timeout_s, pred, gold
        )
        return Match.TIMEOUT


def compare_math(pred: str, gold: str, timeout_s: float = 5.0) -> Match:
    """EQUAL / UNEQUAL / TIMEOUT for an extracted answer ``pred`` against the dataset answer ``gold``."""
    pred, gold = pred.strip(), gold.strip()
    if not pred or not gold:
        return Match.UNEQUAL
    a, b = plain_number(pred), plain_number(gold)
    if a is not None and b is not None:
        return Match.EQUAL if a == b else Match.UNEQUAL
    if _squash(pred) == _squash(gold):
        return Match.EQUAL
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return Match.UNEQUAL
    return _compare_cached(pred, gold, float(timeout_s))


def math_equal(pred: str, gold: str, timeout_s: float = 5.0) -> bool:
    r"""True iff ``pred`` (the content of the response's last ``\boxed{}``) equals ``gold`` mathematically.

    Safe from any thread; a check that runs over ``timeout_s`` seconds is abandoned and counts as False.
    """
    return compare_math(pred, gold, timeout_s) is Match.EQUAL


def check_boxed_math(response: str, gold: str, timeout_s: float = 5.0) -> Verdict:
    r"""MISSING without a ``\boxed{...}``; else CORRECT iff the *last* box's content equals ``gold``.

    The last box counts because reasoning traces often box intermediate results before the final one.
    An empty ``\boxed{}`` is WRONG (the format is there, the answer is not).
    """
    boxed = extract_boxed(response)
    if boxed is None:
        return Verdict.MISSING
    return Verdict.CORRECT if math_equal(boxed, gold, timeout_s) else Verdict.WRONG


@functools.lru_cache(maxsize=100_000)
def _key_cached(boxed: str, timeout_s: float) -> str | None:
    try:
        return _call("key", (boxed,), timeout_s)
    except _Timeout:
        logger.warning("math-verify gave up on an answer key after %.1f s: %.80r", timeout_s, boxed)
        return None


def math_answer_key(response: str, timeout_s: float = 5.0) -> str | None:
    r"""Canonical final answer of ``response`` for majority voting; None (abstain) without a ``\boxed{}``.

    Unified: plain numbers become the reduced fraction's string (``\frac{1}{2}``, ``0.5``, ``1/2``, ``\dfrac12``
    all -> ``1/2``; ``1,000``, ``007``, ``x = 3``, ``5 \text{ cm}`` -> ``1000``, ``7``, ``3``, ``5``); other
    answers become the ``str()`` of math-verify's sympy parse, which unifies ``\sqrt{2}/2`` and
    ``\frac{\sqrt2}{2}``, reorders products (``\pi \cdot 2`` = ``2\pi``) and sorts finite sets.
    Not unified: forms that need simplification (``(x+1)^2`` vs ``x^2+2x+1``), floats vs exact values
    (``0.333333`` vs ``\frac13``), percent vs fraction. Unparseable or timed-out answers fall back to the boxed
    text without whitespace.
    """
    boxed = extract_boxed(response)
    if boxed is None:
        return None
    boxed = boxed.strip()
    if not boxed:
        return None  # an empty box abstains
    if (num := plain_number(boxed)) is not None:
        return str(num)
    if len(boxed) > MAX_ANSWER_CHARS:
        return _squash(boxed)
    key = _key_cached(boxed, float(timeout_s))
    return key if key is not None else _squash(boxed)
