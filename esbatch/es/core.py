"""The ES math of paper App. G.1, in the order an update runs it (trainer.py:es_step strings it together):

1. population and seeds: N members theta + sign_i * sigma * eps(s_i), drawn from (run seed, t)  draw_population
2. reward normalization:  R_i (mean reward over the B prompts) -> z_i                          normalize
3. the estimator:         each direction's weight w_j = sum_{i: s_i = j} sign_i * z_i          direction_weights
4. the update:            theta <- theta + alpha/N * sum_j w_j * eps(s_j), in fp32, applied by the backend
                          holding the weights (esbatch/perturb/update.py:es_update)
5. its replay:            theta_T from theta_0 and the logged (s_j, w_j) of every update         replay.py

eps(s) is a fixed function of the seed and the tensor's name (esbatch/perturb/noise.py), so a member and an
update are described by integers and floats alone: that is what log.jsonl keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Member:
    """One evaluation of the population: center + sign * sigma * eps(seed), sampled with gen_seed."""

    seed: int
    sign: int
    gen_seed: int


def draw_population(run_seed: int, t: int, n: int, estimator: str, generation_seeds: str) -> list[Member]:
    """The N members of update ``t``; a pure function of (run seed, t) so a resumed run draws the same.

    one_point:  s_1..s_N independent 32-bit direction seeds, member i = theta + sigma * eps(s_i).
    antithetic: s_1..s_{N/2}, each evaluated at theta + sigma * eps(s_j) then theta - sigma * eps(s_j).
    Sampling seeds (es.generation_seeds): one per member, shared by an antithetic pair, or one per update.
    """
    n_dirs = n // 2 if estimator == "antithetic" else n
    seeds = np.random.default_rng([run_seed, t, 0xE5]).integers(0, 2**32, size=n_dirs, dtype=np.uint64)
    gens = np.random.default_rng([run_seed, t, 0x6E]).integers(0, 2**31, size=n, dtype=np.uint64)
    signs = [1, -1] if estimator == "antithetic" else [1]
    members = []
    for _i, s in enumerate(seeds):
        for k, sign in enumerate(signs):
            j = len(members)
            g = {"independent": gens[j], "antithetic_pairs": gens[j - k], "population": gens[0]}[generation_seeds]
            members.append(Member(int(s), sign, int(g)))
    return members


def normalize(rewards: Sequence[float], method: str, eps_num: float = 1e-8) -> np.ndarray:
    """Population reward shaping.

    zscore:        z_i = (R_i - mean R) / (sqrt(1/N sum_j (R_j - mean R)^2) + eps_num)   (App. G.1)
    none:          z_i = R_i
    centered_rank: z_i = rank(R_i) / (N - 1) - 1/2, ties share their mean rank (Salimans et al., 2017)
    """
    r = np.asarray(rewards, dtype=np.float64)
    if method == "zscore":
        return (r - r.mean()) / (r.std() + eps_num)
    if method == "none":
        return r.copy()
    if method == "centered_rank":
        order = np.argsort(r, kind="stable")
        ranks = np.empty(len(r))
        ranks[order] = np.arange(len(r), dtype=np.float64)
        for v in np.unique(r):  # average the ranks of ties
            tie = r == v
            ranks[tie] = ranks[tie].mean()
        return ranks / (len(r) - 1) - 0.5
    raise ValueError(f"unknown normalization {method!r}; valid: zscore, none, centered_rank")


def direction_weights(members: Sequence[Member], z: Sequence[float]) -> tuple[list[int], list[float]]:
    """The estimator: collapse member scores onto distinct directions, w_j = sum_{i: s_i = j} sign_i * z_i.

    one_point: w_j = z_j, so the update is alpha/N sum_i z_i eps_i (App. G.1). antithetic: w_j = z_j(+) - z_j(-),
    the difference of the pair.
    """
    w: dict[int, float] = {}
    for m, zi in zip(members, z):
        w[m.seed] = w.get(m.seed, 0.0) + m.sign * float(zi)
    return list(w), list(w.values())
