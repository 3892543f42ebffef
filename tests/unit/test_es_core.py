"""The ES math against explicit, independent computations."""

import numpy as np
import pytest
import torch
from noise_reference import eps_tensor

from esbatch.es.core import Member, direction_weights, draw_population, normalize
from esbatch.perturb.update import UpdateSpec, es_update


def _eps64(seed, name, shape):
    """The default generator's direction (es.noise: philox-gauss), from the independent numpy reference."""
    return eps_tensor(seed, name, tuple(shape)).double()


def test_zscore_matches_formula_with_population_std():
    r = [0.1, 1.0, 0.0, 0.1]
    mean = sum(r) / 4
    std = (sum((x - mean) ** 2 for x in r) / 4) ** 0.5  # 1/N, not 1/(N-1)
    np.testing.assert_allclose(normalize(r, "zscore", 1e-8), [(x - mean) / (std + 1e-8) for x in r], rtol=1e-12)


def test_zscore_of_equal_rewards_is_zero_not_nan():
    assert normalize([0.3, 0.3, 0.3], "zscore", 1e-8).tolist() == [0.0, 0.0, 0.0]


def test_none_keeps_raw_rewards():
    assert normalize([0.1, 1.0], "none").tolist() == [0.1, 1.0]


def test_centered_rank_with_ties():
    # ranks 0,1,2,3 -> ties at 0.1 share 0.5; /3 - 0.5
    z = normalize([0.1, 1.0, 0.0, 0.1], "centered_rank")
    np.testing.assert_allclose(z, [1.5 / 3 - 0.5, 0.5, -0.5, 1.5 / 3 - 0.5])


def test_unknown_normalization_is_an_error():
    with pytest.raises(ValueError, match="zscore"):
        normalize([1, 2], "minmax")


def test_one_point_population_layout_and_determinism():
    m = draw_population(0, 3, 6, "one_point", "independent")
    assert len(m) == 6 and all(x.sign == 1 for x in m)
    assert len({x.seed for x in m}) == 6 and all(0 <= x.seed < 2**32 for x in m)
    assert len({x.gen_seed for x in m}) == 6
    assert m == draw_population(0, 3, 6, "one_point", "independent")
    assert m != draw_population(0, 4, 6, "one_point", "independent")
    assert len({x.gen_seed for x in draw_population(0, 3, 6, "one_point", "population")}) == 1


def test_antithetic_population_pairs_and_common_random_numbers():
    m = draw_population(1, 0, 8, "antithetic", "antithetic_pairs")
    assert [x.sign for x in m] == [1, -1] * 4
    for a, b in zip(m[::2], m[1::2]):
        assert a.seed == b.seed and a.gen_seed == b.gen_seed
    assert len({x.seed for x in m}) == 4
    ind = draw_population(1, 0, 8, "antithetic", "independent")
    assert all(a.gen_seed != b.gen_seed for a, b in zip(ind[::2], ind[1::2]))


def test_antithetic_weights_are_the_pair_difference():
    members = [Member(11, 1, 0), Member(11, -1, 0), Member(22, 1, 0), Member(22, -1, 0)]
    seeds, w = direction_weights(members, [0.5, -1.0, 2.0, 2.0])
    assert seeds == [11, 22] and w == [1.5, 0.0]


def test_update_equals_explicit_sum():
    shapes = {"a.weight": (7, 5), "b.bias": (5,), "c": (3, 2, 2)}
    torch.manual_seed(0)
    center = {n: torch.randn(s) for n, s in shapes.items()}
    theta0 = {n: t.double().clone() for n, t in center.items()}
    seeds, z, alpha, n = [3, 99, 2**32 - 1], [0.7, -1.2, 0.5], 0.01, 3
    l2 = es_update(center, UpdateSpec(seeds, z, alpha, n))
    sq = 0.0
    for name, shape in shapes.items():
        delta = alpha / n * sum(zi * _eps64(s, name, shape) for s, zi in zip(seeds, z))
        torch.testing.assert_close(center[name].double(), theta0[name] + delta, rtol=0, atol=1e-6)
        sq += float(delta.square().sum())
    assert l2 == pytest.approx(sq**0.5, rel=1e-6)


def test_antithetic_update_equals_mirrored_one_point_sum():
    """alpha/N sum_j z_j s_j eps_j over the N members == the collapsed pair-difference update."""
    members = draw_population(4, 0, 4, "antithetic", "independent")
    z = normalize([0.2, 0.9, 0.4, 0.4], "zscore")
    seeds, w = direction_weights(members, z)
    center = {"w": torch.zeros(16, 8)}
    es_update(center, UpdateSpec(seeds, w, 0.1, 4))
    expect = 0.1 / 4 * sum(zj * m.sign * _eps64(m.seed, "w", (16, 8)) for m, zj in zip(members, z))
    torch.testing.assert_close(center["w"].double(), expect, rtol=0, atol=1e-7)


def test_update_rejects_low_precision_center():
    with pytest.raises(TypeError, match="fp32"):
        es_update({"w": torch.zeros(3, dtype=torch.bfloat16)}, UpdateSpec([1], [1.0], 0.1, 2))


def test_zero_weights_leave_center_bit_identical():
    c = {"w": torch.randn(10)}
    before = c["w"].clone()
    assert es_update(c, UpdateSpec([1, 2], [0.0, 0.0], 1.0, 2)) == 0.0
    assert torch.equal(c["w"], before)
