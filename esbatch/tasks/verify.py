"""Answer extraction and checking for training rewards.

Pure functions with no model or dataset dependency, so the truth tables in tests/unit/test_verify.py
pin their behaviour on nasty inputs. Numbers are compared as exact fractions (0.5 == 1/2 == \\frac{1}{2}).

The model's text is an adversary's input (ES and GRPO optimise against these functions), so none of them may
raise or take more than linear time on any text: a number longer than ``MAX_NUMBER_CHARS`` is not a number
(Python refuses int() past 4,300 digits), and extraction scans each character a bounded number of times
(tests/unit/test_verify_fuzz.py). :func:`guarded_score` turns an exception in any task's scoring into WRONG.
"""

from __future__ import annotations

import ast
import math
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable
from enum import StrEnum
from fractions import Fraction
from typing import Any


class Verdict(StrEnum):
    """What a verifier says of one response; the reward config maps it to a number."""

    CORRECT = "correct"
    WRONG = "wrong"  # the required format is there, the answer is not right
    MISSING = "missing"  # the required answer format is absent


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (braces balanced), or None.

    A box whose brace never closes cannot contain an earlier box's closing brace either, so the scan of an
    earlier box stops where the last unclosed one starts: linear time even for ``\boxed{`` repeated."""
    start, limit = text.rfind("\\boxed"), len(text)
    while start != -1:
        i = start + len("\\boxed")
        while i < limit and text[i] == " ":
            i += 1
        if i < limit and text[i] == "{":
            depth = 0
            for j in range(i, limit):
                c = text[j]
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
            limit = i
        start = text.rfind("\\boxed", 0, start)
    return None


_FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH = re.compile(r"^(-?\d+)\s*/\s*(-?\d+)$")
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(\D|$))")
#: Longer answers are not plain numbers: no gold answer is this long, int() refuses 4,300+ digits, and the
#: unit-stripping regex below is quadratic in the worst case.
MAX_NUMBER_CHARS = 1000


def parse_number(s: str) -> Fraction | None:
    r"""Parse a final answer like ``1,000``, ``$18``, ``\frac{1}{2}``, ``0.50``, ``72\%`` or ``18 \text{ apples}``."""
    s = s.strip()
    if len(s) > MAX_NUMBER_CHARS:
        return None
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(mathrm|textbf|mathbf)\{([^}]*)\}", r"\2", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    s = s.replace("\\%", "").replace("%", "").replace("−", "-").strip()
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5"
    s = re.sub(r"(?<=[\d.}])\s*[a-zA-Z][a-zA-Z .]*$", "", s).strip()  # trailing units
    s = _THOUSANDS.sub("", s).rstrip(".").strip()
    if m := _FRAC.match(s) or _SLASH.match(s):
        num, den = int(m.group(1)), int(m.group(2))
        return Fraction(num, den) if den else None
    if _NUMBER.match(s):
        return Fraction(s)
    return None


def check_boxed_number(response: str, gold: str) -> Verdict:
    """Math tasks: correct iff the last \\boxed{} holds a number equal to ``gold``."""
    boxed = extract_boxed(response)
    if boxed is None:
        return Verdict.MISSING
    got, want = parse_number(boxed), parse_number(gold)
    if want is None:
        raise ValueError(f"gold answer {gold!r} is not a number")
    return Verdict.CORRECT if got is not None and got == want else Verdict.WRONG


def extract_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` (the last of the non-overlapping, leftmost, shortest
    matches, as ``re.findall(r"<answer>(.*?)</answer>")`` finds them, in linear time), or None."""
    found, pos = None, 0
    while (start := text.find("<answer>", pos)) != -1 and (end := text.find("</answer>", start + 8)) != -1:
        found, pos = text[start + 8 : end], end + 9
    return found.strip() if found is not None else None


class _Invalid(Exception):
    pass


def _negative_literal(node: ast.AST) -> int | None:
    """The integer of a minus written directly against an integer literal (``-3``: no space, no parenthesis
    between them), else None. ``- 3``, ``-(3)``, ``--3`` and ``+3`` are signs, not literals."""
    if not (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)):
        return None
    num = node.operand
    if isinstance(num, ast.Constant) and type(num.value) is int and num.lineno == node.lineno:
        if num.col_offset == node.col_offset + 1:  # offsets count bytes: one byte apart is the '-' itself
            return -num.value
    return None


def _eval_countdown(node: ast.AST, used: list[int]) -> Fraction:
    """Evaluate + - * / over integer literals and parentheses only; anything else is invalid, a sign included
    (see :func:`check_countdown`; a negative literal ``-3`` is the number -3)."""
    if isinstance(node, ast.Expression):
        return _eval_countdown(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if (negative := _negative_literal(node)) is not None:
        used.append(negative)
        return Fraction(negative)
    if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
        a, b = _eval_countdown(node.left, used), _eval_countdown(node.right, used)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0:
            raise _Invalid("division by zero")
        return a / b
    raise _Invalid(f"{type(node).__name__} is not allowed")


#: The largest denominator a rounded Countdown target is read back to (see :func:`exact_target`).
TARGET_MAX_DENOMINATOR = 10**6
#: A fraction with denominator q is read from a rounded target only where q**2 times the width of its rounding
#: interval is at most this: the chance of a misread, about (see :func:`exact_target`).
TARGET_MISREAD = Fraction(1, 10**3)
#: A target that is a printed double no simple fraction explains (another program's float result, a few ulps from
#: the closest double of the exact value: '2.833333333333334' for 17/6) is met by an answer whose exact value lies
#: within this relative distance of it (see :func:`check_countdown`; benchmarks/countdown_tolerance.py).
COUNTDOWN_REL_TOL = Fraction(1, 10**12)
_DECIMAL = re.compile(r"[-+]?\d*\.(\d+)")


def _simplest_in(lo: Fraction, hi: Fraction, max_den: int) -> Fraction | None:
    """The fraction with the smallest denominator in ``[lo, hi]`` (``0 < lo <= hi``), or None where that
    denominator is over ``max_den``: the continued fraction both ends share, then the smallest integer that fits
    (the Stern-Brocot descent). Denominators only grow on the way down, so it stops once one passes ``max_den``."""
    h0, k0, h1, k1 = 0, 1, 1, 0  # the last two convergents: value = (h1 * rest + h0) / (k1 * rest + k0)
    while True:
        a = lo.numerator // lo.denominator
        if a == lo or a + 1 <= hi:  # an integer fits: the smallest one ends the expansion
            term = a if a == lo else a + 1
            k = term * k1 + k0
            return Fraction(term * h1 + h0, k) if k <= max_den else None
        h0, k0, h1, k1 = h1, k1, a * h1 + h0, a * k1 + k0
        if k1 > max_den:
            return None
        lo, hi = 1 / (hi - a), 1 / (lo - a)  # both ends lie in (a, a + 1): go on with 1 / (x - a)


def _recover(value: Fraction, lo: Fraction, hi: Fraction) -> Fraction | None:
    """The smallest-denominator fraction in the rounding interval ``[lo, hi]`` of ``value`` (same sign), if its
    denominator q passes the bound of :func:`exact_target`; else None."""
    if value < 0:
        found = _recover(-value, -hi, -lo)
        return None if found is None else -found
    cap = min(TARGET_MAX_DENOMINATOR, math.isqrt(math.floor(TARGET_MISREAD / (hi - lo))))
    return _simplest_in(lo, hi, cap) if cap >= 1 else None


def _float_interval(x: float) -> tuple[Fraction, Fraction]:
    """The reals that round to the finite float ``x``: from the midpoint to its lower neighbour to the one above."""
    exact = Fraction(x)
    return (exact + Fraction(math.nextafter(x, -math.inf))) / 2, (exact + Fraction(math.nextafter(x, math.inf))) / 2


def exact_target(target: int | float | str | Fraction) -> Fraction:
    """A Countdown target as an exact fraction. Integers, fractions (``Fraction``, ``"3/2"``) and whole values are
    exact. A float or a plain decimal string with a fractional part is a rounded value: it means the fraction with
    the smallest denominator that rounds to it, where one is simple enough to be trusted, else exactly the decimal
    it is written as (the float's shortest ``repr``, the string as written; this was the only rule before).

    Rounds to it: for a float x, ``float(f) == x`` (f lies between the midpoints to x's neighbours); for a string
    with d decimals, ``|f - value| <= 0.5 * 10**-d`` or, if it has at most 17 significant digits (it may be a
    printed double: ``repr(-7/3)`` is ``-2.3333333333333335``, 1.7e-16 from -7/3), ``float(f) == float(value)``.
    Call the width of that interval w. Trusted: denominator q <= 10**6 and ``q**2 * w <= 10**-3``
    (``TARGET_MAX_DENOMINATOR``, ``TARGET_MISREAD``). About 0.3 Q**2 fractions with denominator <= Q lie in each
    unit interval, so a value that is no such fraction is misread with chance about 3e-4, and no two of them fit
    one interval (they differ by >= 1/Q**2 >= 1000 w): the result is the only candidate, not a pick among several.
    For a float p/q that admits q * |p| up to about 2e12, e.g. every fraction of six numbers up to 100; 10**6
    only caps the search where w is tiny. Hence:

    * ``266.6666666666667`` (``repr(800/3)``), as a float or that string, is 800/3; ``repr(2/3)`` is 2/3;
      ``repr(-7/3)`` is -7/3.
    * ``0.1``, ``1.5``, ``266.67`` as floats are 1/10, 3/2, 26667/100: a short decimal is itself the simplest
      fraction its float stands for (others differ from it by far more than the float's rounding interval).
    * The strings ``"0.1"``, ``"0.3"``, ``"1.5"``, ``"266.67"`` are exact (1/10, 3/10, 3/2, 26667/100): a string
      with few decimals admits many simple fractions (800/3 and 21067/79 both round to 266.67; 1/3 to 0.3), so it
      is taken as written. A string needs four decimals before 1/3 is read back (``"0.3333"``, not ``"0.333"``).
    * A denominator over the bound (``repr(1/3000000)``, or ``1e15 + 1/6``, whose float is 1e15 + 0.125) is not
      read back: the target is that decimal.

    The answer must then equal this fraction exactly, except for a printed double read as written (see
    :func:`check_countdown`: ``COUNTDOWN_REL_TOL``). A bool, NaN, an
    infinity, or a string that is no number raises ValueError naming the target."""
    return _read_target(target)[0]


def _read_target(target: int | float | str | Fraction) -> tuple[Fraction, bool]:
    """:func:`exact_target`, and whether the target is a printed double that no simple fraction explains (a
    non-whole float or a decimal string of at most 17 significant digits, read as written)."""
    if isinstance(target, bool) or (isinstance(target, float) and not math.isfinite(target)):
        raise ValueError(f"Countdown target {target!r} is not a number")
    if isinstance(target, float):
        decimal = Fraction(repr(target))  # the shortest decimal that round-trips: 0.1 -> "0.1" -> 1/10
        if target.is_integer():
            return decimal, False
        found = _recover(Fraction(target), *_float_interval(target))
        return (found, False) if found is not None and float(found) == target else (decimal, True)
    if isinstance(target, (int, Fraction)):
        return Fraction(target), False
    text = str(target).strip()
    value = parse_number(text)
    if value is None:
        raise ValueError(f"Countdown target {target!r} is not a number")
    if (m := _DECIMAL.fullmatch(text)) and value.denominator != 1:
        half = Fraction(1, 2 * 10 ** len(m.group(1)))
        lo, hi = value - half, value + half
        printed = len(text.lstrip("+-").replace(".", "").lstrip("0")) <= 17  # it may be a printed double
        if printed:
            flo, fhi = _float_interval(float(value))
            lo, hi = min(lo, flo), max(hi, fhi)
        found = _recover(value, lo, hi)
        if found is not None:
            return found, False
        return value, printed and _read_target(float(value))[1]  # '1.5' is no float result: 3/2 explains it
    return value, False


def _meets(value: Fraction, want: Fraction, printed: Fraction | None) -> bool:
    """``value`` equals the target, or lies within ``COUNTDOWN_REL_TOL`` of a printed double (see above)."""
    return value == want or (printed is not None and abs(value - printed) <= COUNTDOWN_REL_TOL * abs(printed))


def _target_text(text: str) -> Fraction | None:
    """The number after an answer's ``=``, read by the rule of a target, or None where it is no number."""
    try:
        return exact_target(text)
    except ValueError:
        return None


def check_countdown(response: str, numbers: list[int], target: int | float | str | Fraction) -> Verdict:
    """Countdown: the <answer> expression uses each given number exactly once and equals ``target`` exactly
    (rational arithmetic: ``3 / 2`` equals a target of 1.5; a rounded target such as 266.6666666666667 means the
    fraction it stands for, 800/3, by :func:`exact_target`). A trailing ``= <target>`` is allowed when it reads as
    the target by the same rule (the target as printed may be echoed); a false one (``= 61``) makes it WRONG.

    Signs: the game combines numbers with the binary ``+ - * /`` and parentheses only, so a unary sign is WRONG:
    ``-48 + 92 + 54``, ``+48``, ``--48``, ``-(5 - 25) * 3``, ``- 48``. The exception is a minus written directly
    against an integer, ``-3``: the negative number -3, which like every literal must be one of the given numbers
    (so a given 48 cannot be written ``-48``). No positive target is lost: with positive numbers, every expression
    with signs equals plus or minus a sign-free one over the same numbers, and a negative sign-free value has a
    sign-free negation (``-48 + 92 + 54`` is ``92 + 54 - 48``; ``-(a - b)`` is ``b - a``).

    Another program's float result: a target that may be a printed double (a non-whole float, or a decimal string
    of at most 17 significant digits) and that no simple fraction explains, such as '2.833333333333334' (17/6
    computed in floating point, one double past the closest one), is met by an answer whose exact value is within
    ``COUNTDOWN_REL_TOL`` (1e-12, about 4,500 ulps) of it, relative; so is a trailing ``= <number>`` echo. Every
    other target is met exactly. Why that admits no other answer: two answers within the tolerance are at most
    2e-12 apart, relative, and two different values of one problem's numbers are farther apart than that: by brute
    force (benchmarks/countdown_tolerance.py), at least 1.0e-6 over all 171,700 problems of 3 numbers in 1..100
    (9800/99 vs 9899/100), and 1.04e-8 over every problem of 4 numbers in 1..30 or in 80..100 and a sample of
    50,000 in 1..100 (-9801/9800 vs -9802/9801, from 98, 99, 99, 100). Residual risk: the four-number problems
    not enumerated, and larger ones (more numbers, larger numbers); a target computed with a cancellation that
    cost it more than 1e-12 is missed."""
    want, unexplained = _read_target(target)
    printed = want if unexplained else None
    expr = extract_answer_tag(response)
    if expr is None:
        return Verdict.MISSING
    if expr.count("=") == 1 and len(expr) <= 200:
        lhs, rhs = expr.split("=")
        if (echo := _target_text(rhs)) is not None and _meets(echo, want, printed):
            expr = lhs
    expr = expr.replace("×", "*").replace("÷", "/").replace("−", "-")
    if len(expr) > 200:
        return Verdict.WRONG
    try:
        used: list[int] = []
        with _parse_lock:  # responses are scored in threads: see _parse_lock
            tree = ast.parse(expr.strip(), mode="eval")
        value = _eval_countdown(tree, used)
    except (SyntaxError, _Invalid, ValueError):
        return Verdict.WRONG
    if Counter(used) != Counter(numbers):
        return Verdict.WRONG
    return Verdict.CORRECT if _meets(value, want, printed) else Verdict.WRONG


def number_key(response: str) -> str | None:
    """Maj@K vote key of a boxed numeric answer: the exact reduced fraction ('1/2' for 0.5 and \\frac{1}{2})."""
    box = extract_boxed(response)
    value = parse_number(box) if box is not None else None
    return None if value is None else str(value)


def countdown_key(response: str) -> str | None:
    """Maj@K vote key of a Countdown answer: the <answer> expression without spaces (identical equations
    vote together; different correct equations are different answers)."""
    ans = extract_answer_tag(response)
    return None if ans is None else "".join(ans.split()) or None


_warned: dict[tuple[str, str], int] = {}
_warn_lock = threading.Lock()
# Python 3.11's parser keeps its AST recursion depth per interpreter: two threads parsing at once can raise
# "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905), and a scorer that raises scores WRONG.
_parse_lock = threading.Lock()
#: warnings per (task, exception type) before they are only counted; then one every WARN_EVERY
WARN_FIRST, WARN_EVERY = 3, 1000


def scoring_warning(source: str, kind: str, detail: str) -> None:
    """One stderr line per failure, the first WARN_FIRST times per (source, kind), then one every WARN_EVERY
    with the running count, so a task that fails on every response cannot flood the log."""
    with _warn_lock:
        n = _warned[(source, kind)] = _warned.get((source, kind), 0) + 1
    if n <= WARN_FIRST or n % WARN_EVERY == 0:
        count = f" ({n} so far)" if n > WARN_FIRST else ""
        print(f"warning: {source}: {detail}{count}", file=sys.stderr, flush=True)


def _warn(task: Any, method: str, e: BaseException) -> None:
    kind, outcome = type(e).__name__, "no answer key" if method == "answer_key" else "counted as WRONG"
    scoring_warning(f"{type(task).__name__}.{method}", kind, f"raised {kind}, {outcome}: {str(e)[:160]!r}")


class ScoringError(RuntimeError):
    """The verifier raised on too many responses of an update for its rewards to be trusted."""


def guarded(
    task: Any, method: str, fallback: Any, on_error: Callable[[BaseException], None] | None = None
) -> Callable[..., Any]:
    """``task.<method>`` as it is now, made safe: an exception returns ``fallback`` with a warning line (and is
    passed to ``on_error``: training counts them, esbatch/train/problems.py)."""
    call = getattr(task, method)

    def safe(*args: Any) -> Any:
        try:
            return call(*args)
        except Exception as e:
            _warn(task, method, e)
            if on_error is not None:
                on_error(e)
            return fallback

    return safe


def guarded_score(task: Any, response: str, ex: Any) -> Verdict:
    """``task.score(response, ex)``; an exception becomes WRONG with a warning, never a dead run."""
    return guarded(task, "score", Verdict.WRONG)(response, ex)


def guarded_answer_key(task: Any, response: str, ex: Any) -> str | None:
    """``task.answer_key(response, ex)``; an exception becomes None (abstain) with a warning."""
    return guarded(task, "answer_key", None)(response, ex)


def guarded_score_many(task: Any, responses: list[str], examples: list[Any]) -> list[Verdict]:
    """``task.score_many`` when the task has it (else ``score`` one by one); an exception in the batch call
    falls back to guarded single scoring, so one bad response costs only its own verdict."""
    if hasattr(task, "score_many"):
        try:
            return list(task.score_many(responses, examples))
        except Exception as e:
            _warn(task, "score_many", e)
    return [guarded_score(task, r, ex) for r, ex in zip(responses, examples)]
