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


def _eval_countdown(node: ast.AST, used: list[int]) -> Fraction:
    """Evaluate + - * / over integer literals and parentheses only; anything else is invalid."""
    if isinstance(node, ast.Expression):
        return _eval_countdown(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
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


def exact_target(target: int | float | str | Fraction) -> Fraction:
    """A Countdown target as an exact fraction: ``1.5``, ``"1.5"`` and ``"3/2"`` are all 3/2. A float means the
    decimal it is written as (``0.1`` -> 1/10, not the binary double just above it), so no tolerance is needed."""
    if isinstance(target, bool):
        raise ValueError(f"Countdown target {target!r} is not a number")
    if isinstance(target, float):
        return Fraction(repr(target))  # the shortest decimal that round-trips: 0.1 -> "0.1" -> 1/10
    if isinstance(target, (int, Fraction)):
        return Fraction(target)
    value = parse_number(str(target))
    if value is None:
        raise ValueError(f"Countdown target {target!r} is not a number")
    return value


def check_countdown(response: str, numbers: list[int], target: int | float | str | Fraction) -> Verdict:
    """Countdown: the <answer> expression uses each given number exactly once and equals ``target`` exactly
    (rational arithmetic: ``3 / 2`` equals a target of 1.5). A trailing ``= <target>`` is allowed."""
    want = exact_target(target)
    expr = extract_answer_tag(response)
    if expr is None:
        return Verdict.MISSING
    if expr.count("=") == 1 and len(expr) <= 200:
        lhs, rhs = expr.split("=")
        if parse_number(rhs) == want:
            expr = lhs
    expr = expr.replace("×", "*").replace("÷", "/").replace("−", "-")
    if len(expr) > 200:
        return Verdict.WRONG
    try:
        used: list[int] = []
        value = _eval_countdown(ast.parse(expr.strip(), mode="eval"), used)
    except (SyntaxError, _Invalid, ValueError):
        return Verdict.WRONG
    if Counter(used) != Counter(numbers):
        return Verdict.WRONG
    return Verdict.CORRECT if value == want else Verdict.WRONG


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
