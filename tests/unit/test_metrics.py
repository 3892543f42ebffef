"""Pass@K against exact enumeration, Maj@K ties and abstentions, per-problem aggregation."""

import itertools
import math
import random

import pytest

from esbatch.metrics import maj_at_k, majority_vote, mean_metrics, pass_at_k, problem_metrics


def enumerate_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n responses (c correct) that contain a correct one."""
    responses = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(responses[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_exact_enumeration_on_random_cases():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(enumerate_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    for n, c, k in [(32, 1, 16), (32, 5, 32), (200, 3, 100), (1000, 1, 1), (1000, 999, 2)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-15)
    assert pass_at_k(32, 0, 32) == 0.0 and pass_at_k(32, 1, 32) == 1.0 and pass_at_k(32, 4, 1) == 4 / 32


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_majority_vote_plurality_ties_and_abstentions():
    assert majority_vote(["3", "5", "5", "3", "5"]) == (1, 3)  # plurality
    assert majority_vote(["3", "5", "5", "3"]) == (0, 2)  # tie: the answer seen first wins
    assert majority_vote(["5", "3", "3", "5"]) == (0, 2)
    assert majority_vote([None, None, "7"]) == (2, 1)  # abstentions do not vote
    assert majority_vote([None, None]) == (None, 0)
    assert majority_vote([None, "a", None, "b", "b"]) == (3, 2)


def test_maj_at_k_uses_the_first_k_responses():
    keys = ["1", "2", "2", "1", "1"]
    ok = [True, False, False, True, True]
    assert maj_at_k(keys, ok, 1) == 1.0
    assert maj_at_k(keys, ok, 3) == 0.0  # "2" wins 2-1
    assert maj_at_k(keys, ok, 4) == 1.0  # 2-2 tie: "1" came first
    assert maj_at_k(keys, ok, 5) == 1.0
    assert maj_at_k([None, None, None], [False] * 3, 3) == 0.0  # nobody answered
    with pytest.raises(ValueError):
        maj_at_k(keys, ok, 6)


def test_problem_and_task_means():
    m = problem_metrics([True, False, False, False], ["1", "2", "2", None], ks=[1, 2, 4, 16], entropies=[1.0, 3.0])
    assert m["pass@1"] == 0.25 and m["pass@2"] == pytest.approx(0.5) and m["pass@4"] == 1.0
    assert m["maj@4"] == 0.0 and m["maj@1"] == 1.0 and "pass@16" not in m and m["entropy"] == 2.0
    t = mean_metrics([m, problem_metrics([True] * 4, ["1"] * 4, ks=[1, 2, 4])])
    assert t["pass@1"] == pytest.approx(0.625) and t["maj@4"] == 0.5 and t["entropy"] == 2.0
