"""The drift and threshold analyses at their boundaries: s_tau counts 0 < |delta| <= tau and a thresholded
checkpoint zeroes exactly those coordinates, for a float32 |delta| exactly at tau, the float32 just above it,
float32(tau) where that rounds up past tau (1e-3, 1e-5, ...), and delta = 0."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from esbatch.analyze.drift import drift_stats, fp32_at_most
from esbatch.analyze.threshold import threshold_tensors


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def next_up(x: float) -> float:
    return struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", x))[0] + 1))[0]


@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_fp32_at_most_is_the_largest_float32_not_above_tau(tau):
    t = fp32_at_most(tau)
    assert f32(t) == t and t <= tau < next_up(t)


TAUS = [1e-6, 1e-5, 1e-4, 1e-3, 2.0**-10]


@pytest.mark.parametrize("tau", TAUS)
def test_s_tau_and_thresholding_count_exactly_the_coordinates_at_most_tau(tau):
    at, above, rounded = fp32_at_most(tau), next_up(fp32_at_most(tau)), f32(tau)
    # |delta| values (theta_0 = 0, so delta is the value itself, exact): at tau, just above, float32(tau), 0,
    # and negative deltas of the same sizes
    deltas = [at, above, rounded, 0.0, -at, -above]
    inside = [abs(d) <= tau and d != 0 for d in deltas]
    assert inside[0] and not inside[1] and inside[2] == (rounded <= tau)  # 1e-3: float32(tau) > tau
    center = {"model.layers.0.mlp.up_proj.weight": torch.tensor(deltas, dtype=torch.float32)}
    base = {"model.layers.0.mlp.up_proj.weight": torch.zeros(len(deltas))}
    s = drift_stats(center, base, taus=[tau], top_k=3)
    assert s.n_nonzero == 5 and s.below == [sum(inside)]
    assert s.s_tau() == [sum(inside) / 5]

    class Keep:
        def write(self, name, t):
            self.t = t.clone()

    w = Keep()
    (counts,) = threshold_tensors(center, base, [tau], "float32", [w])
    assert counts == {"zeroed": sum(inside), "nonzero": 5, "total": len(deltas)}
    assert w.t.tolist() == [0.0 if z else d for d, z in zip(torch.tensor(deltas).tolist(), inside)]


def test_float32_of_1e_3_is_above_1e_3_and_not_counted():
    """The case that was wrong: torch rounded tau to float32 before comparing."""
    d = f32(1e-3)
    assert d > 1e-3
    center, base = {"w": torch.tensor([d])}, {"w": torch.zeros(1)}
    assert drift_stats(center, base, taus=[1e-3]).below == [0]
    assert drift_stats(center, base, taus=[d]).below == [1]
