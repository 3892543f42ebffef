"""Answer extraction and checking for training rewards.

Pure functions with no model or dataset dependency, so the truth tables in tests/unit/test_verify.py
pin their behaviour on nasty inputs. Numbers are compared as exact fractions (0.5 == 1/2 == \\frac{1}{2}).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from enum import StrEnum
from fractions import Fraction


class Verdict(StrEnum):
    """What a verifier says of one response; the reward config maps it to a number."""

    CORRECT = "correct"
    WRONG = "wrong"  # the required format is there, the answer is not right
    MISSING = "missing"  # the required answer format is absent


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
                j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


_FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH = re.compile(r"^(-?\d+)\s*/\s*(-?\d+)$")
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(\D|$))")


def parse_number(s: str) -> Fraction | None:
    r"""Parse a final answer like ``1,000``, ``$18``, ``\frac{1}{2}``, ``0.50``, ``72\%`` or ``18 \text{ apples}``."""
    s = s.strip()
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
    """Content of the last ``<answer>...</answer>``, or None."""
    found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


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


def check_countdown(response: str, numbers: list[int], target: int) -> Verdict:
    """Countdown: the <answer> expression uses each given number exactly once and equals ``target``."""
    expr = extract_answer_tag(response)
    if expr is None:
        return Verdict.MISSING
    expr = expr.split("=")[0] if expr.count("=") == 1 and expr.split("=")[1].strip() == str(target) else expr
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
    return Verdict.CORRECT if value == target else Verdict.WRONG


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
