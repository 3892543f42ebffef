"""How close two different Countdown values can be: the evidence for ``COUNTDOWN_REL_TOL`` (issue 44, D4).

A rounded Countdown target (a float some other program computed, e.g. '2.833333333333334' for 17/6) is met by an
answer whose exact value lies within ``COUNTDOWN_REL_TOL`` (relative) of it (:func:`esbatch.tasks.verify.
check_countdown`). That is safe when no two different values reachable from one problem's numbers (each number
once, + - * /, any parentheses) lie within twice the tolerance of each other: then at most one of them is near the
target, and it is the one the target was computed from. This enumerates, for every multiset of ``--count``
numbers in 1..``--max`` (or a seeded sample of ``--sample`` of them), every reachable value as an exact fraction
(int64 numerator and denominator: at most 2**(n-1) * max**n = 8e8 for four numbers up to 100, so the cross
products that compare two of them, <= 6.4e17, are exact), and prints the smallest relative gap
``|v - w| / min(|v|, |w|)`` between two different ones, and where it occurs.

    .venv/bin/python benchmarks/countdown_tolerance.py --count 3 --max 100          # all 171,700 multisets
    .venv/bin/python benchmarks/countdown_tolerance.py --count 4 --max 100 --sample 20000 --seed 0
    .venv/bin/python benchmarks/countdown_tolerance.py --count 4 --min 80 --max 100   # the largest numbers
    .venv/bin/python benchmarks/countdown_tolerance.py --count 4 --max 100 --jobs 16  # all 4,421,275
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

_SHIFT = np.int64(1 << 31)  # key = P * 2**31 + Q (Q < 2**31): one int64 per normalized fraction
_memo: dict[tuple[int, ...], np.ndarray] = {}


def _normalize(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    keep = q != 0
    p, q = p[keep], q[keep]
    sign = np.where(q < 0, -1, 1)
    p, q = p * sign, q * sign
    g = np.gcd(p, q)
    p, q = p // g, q // g
    return np.unique(p * _SHIFT + q)


def _split(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = keys % _SHIFT
    return (keys - q) // _SHIFT, q


def _combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    pa, qa = _split(a)
    pb, qb = _split(b)
    pa, qa = np.repeat(pa, len(b)), np.repeat(qa, len(b))
    pb, qb = np.tile(pb, len(a)), np.tile(qb, len(a))
    p = np.concatenate([pa * qb + pb * qa, pa * qb - pb * qa, pb * qa - pa * qb, pa * pb, pa * qb, pb * qa])
    q = np.concatenate([qa * qb, qa * qb, qa * qb, qa * qb, qa * pb, qb * pa])
    return _normalize(p, q)


def reachable(nums: tuple[int, ...]) -> np.ndarray:
    """Every value of an expression using each of ``nums`` once (sorted tuple) as normalized fraction keys."""
    if len(nums) == 1:
        return np.array([nums[0] * _SHIFT + 1], dtype=np.int64)
    if nums in _memo:
        return _memo[nums]
    parts = []
    idx = range(len(nums))
    seen = set()
    for k in range(1, len(nums) // 2 + 1):
        for left in itertools.combinations(idx, k):
            lt = tuple(nums[i] for i in left)
            rt = tuple(nums[i] for i in idx if i not in left)
            if (min(lt, rt), max(lt, rt)) in seen:
                continue
            seen.add((min(lt, rt), max(lt, rt)))
            parts.append(_combine(reachable(lt), reachable(rt)))  # both orders of - and / are in _combine
    out = np.unique(np.concatenate(parts))
    if len(nums) < 4:
        _memo[nums] = out
    return out


def smallest_gap(nums: tuple[int, ...]) -> tuple[float, tuple[int, int], tuple[int, int]]:
    """The smallest relative gap between two different nonzero reachable values, and the two values."""
    p, q = _split(reachable(nums))
    nz = p != 0
    p, q = p[nz], q[nz]
    order = np.argsort(p / q, kind="stable")
    p, q = p[order], q[order]
    diff = np.abs(p[1:] * q[:-1] - p[:-1] * q[1:]).astype(np.float64)  # exact in int64, then a float
    scale = np.minimum(np.abs(p[1:]) * q[:-1], np.abs(p[:-1]) * q[1:]).astype(np.float64)
    rel = diff / scale
    i = int(np.argmin(rel))
    return float(rel[i]), (int(p[i]), int(q[i])), (int(p[i + 1]), int(q[i + 1]))


def _chunk(sets: list[tuple[int, ...]]) -> tuple[float, tuple[int, ...], tuple, tuple, int]:
    best: tuple[float, tuple[int, ...], tuple, tuple] = (math.inf, (), (), ())
    under = 0
    for s in sets:
        gap, v, w = smallest_gap(s)
        under += gap < 1e-9
        if gap < best[0]:
            best = (gap, s, v, w)
    return (*best, under)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=3, help="numbers per problem")
    ap.add_argument("--max", type=int, default=100, help="largest number")
    ap.add_argument("--min", type=int, default=1, help="smallest number")
    ap.add_argument("--sample", type=int, default=0, help="a seeded sample of this many multisets (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    sets = list(itertools.combinations_with_replacement(range(args.min, args.max + 1), args.count))
    if args.sample:
        sets = random.Random(args.seed).sample(sets, min(args.sample, len(sets)))
    start = time.monotonic()
    # chunks of consecutive multisets share sub-multisets, so each worker's memo is reused
    chunks = [sets[i : i + 2000] for i in range(0, len(sets), 2000)]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_chunk, chunks))
    else:
        results = [_chunk(c) for c in chunks]
    gap, s, v, w = min(r[:4] for r in results)
    under = sum(r[4] for r in results)
    print(
        f"{len(sets)} multisets of {args.count} numbers in {args.min}..{args.max}"
        f"{f' (sample, seed {args.seed})' if args.sample else ''}: smallest relative gap {gap:.3e} "
        f"between {v[0]}/{v[1]} and {w[0]}/{w[1]} from {s}; multisets with a gap under 1e-9: {under}; "
        f"{time.monotonic() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
