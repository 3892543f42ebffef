"""Hand-computed values for the corners mutation testing found unchecked in esbatch/grpo/core.py and
esbatch/metrics.py: defaults, boundaries of the clip, small-G / single-token edge cases, exact error texts."""

import math

import pytest
import torch

from esbatch.grpo.core import aggregate, clipped_surrogate, group_advantages, grpo_loss, token_entropy, token_logprobs
from esbatch.metrics import maj_at_k, problem_metrics

D = torch.float64


def test_group_advantages_defaults_to_group_scale_with_eps_1e4():
    r = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 5.0]], dtype=D)
    # group 0: mean 1/3, sample std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3); group 1: mean 3, std sqrt(3)
    s0, s1 = math.sqrt(1 / 3) + 1e-4, math.sqrt(3) + 1e-4
    want = torch.tensor([[(2 / 3) / s0, (-1 / 3) / s0, (-1 / 3) / s0], [-1 / s1, -1 / s1, 2 / s1]], dtype=D)
    torch.testing.assert_close(group_advantages(r), want, rtol=1e-12, atol=0)


def test_group_advantages_smallest_valid_shapes():
    # G = 2 is enough for a group std: std of (1, 0) is sqrt(1/2)
    a = group_advantages(torch.tensor([[1.0, 0.0]], dtype=D), "group")
    s = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert a[0].tolist() == pytest.approx([s, -s], rel=1e-12)
    # two rewards are enough for a batch std, even with G = 1 (each group centered on itself -> 0)
    a = group_advantages(torch.tensor([[1.0], [0.0]], dtype=D), "batch")
    assert a.tolist() == [[0.0], [0.0]]
    a = group_advantages(torch.tensor([[1.0, 0.0]], dtype=D), "batch")
    assert a[0].tolist() == pytest.approx([s, -s], rel=1e-12)


def test_group_advantages_error_texts():
    with pytest.raises(ValueError, match=r"^scale='group' needs G >= 2 responses per prompt for a std$"):
        group_advantages(torch.ones(2, 1), "group")
    with pytest.raises(ValueError, match=r"^scale='batch' needs at least 2 rewards for a std$"):
        group_advantages(torch.ones(1, 1), "batch")


def test_token_logprobs_and_entropy_default_temperature_is_one():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 2, 5, generator=g, dtype=D)
    tokens = torch.tensor([[3, 0]])
    logp = torch.log_softmax(logits, -1)
    assert token_logprobs(logits, tokens)[0].tolist() == pytest.approx([logp[0, 0, 3].item(), logp[0, 1, 0].item()])
    want = [-(logp[0, t].exp() * logp[0, t]).sum().item() for t in range(2)]
    assert token_entropy(logits)[0].tolist() == pytest.approx(want, rel=1e-12)


def _ratios(r):
    r = torch.tensor(r, dtype=D)
    return r.log(), torch.zeros_like(r)


def test_clipped_surrogate_with_per_token_advantages():
    logp, old = _ratios([[1.0, 1.5], [1.0, 0.5]])
    adv = torch.tensor([[1.0, 2.0], [-1.0, -3.0]], dtype=D)  # [B, T]: no broadcasting
    loss, clipped = clipped_surrogate(logp, old, adv, torch.ones(2, 2))
    want = torch.tensor([[-1.0, -2.4], [1.0, 3 * 0.8]], dtype=D)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert clipped.tolist() == [[False, True], [False, True]]


def test_clip_marks_only_strictly_outside_the_band_and_only_for_the_matching_sign():
    logp, old = _ratios([[1.5, 1.5, 0.5, 0.5, 0.5]])
    r_hi = float(torch.exp(logp - old)[0, 0])
    r_lo = float(torch.exp(logp - old)[0, 2])
    adv = torch.tensor([[0.0, 0.5, 0.0, 0.5, -0.5]], dtype=D)
    _, clipped = clipped_surrogate(logp, old, adv, torch.ones(1, 5))
    # A = 0 is never clipped; A > 0 is clipped above 1.2 only; A < 0 below 0.8 only
    assert clipped.tolist() == [[False, True, False, False, True]]
    # exactly on the band's edges: not clipped (strict inequalities)
    edge = torch.tensor([[0.5, -0.5]], dtype=D)
    lp, o = _ratios([[r_hi, r_lo]])
    _, on_edge = clipped_surrogate(lp, o, edge, torch.ones(1, 2), eps_low=1 - r_lo, eps_high=r_hi - 1)
    assert on_edge.tolist() == [[False, False]]


def test_aggregate_defaults_to_token_mean():
    per_token = torch.tensor([[1.0, 2.0], [3.0, 10.0]], dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    assert aggregate(per_token, mask).item() == pytest.approx(6 / 3)


def test_grpo_loss_passes_eps_high_beta_and_max_len_through():
    logp, old = _ratios([[1.25, 1.0]])
    adv, mask = torch.tensor([1.0], dtype=D), torch.tensor([[1, 1]])
    loss, _ = grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert loss.item() == pytest.approx(-(1.25 + 1.0) / 2, rel=1e-12)  # 1.25 < 1.28: not clipped
    loss, _ = grpo_loss(logp, old, adv, mask, aggregation="seq_mean_token_sum_norm", max_len=10)
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 10, rel=1e-12)
    ref = torch.tensor([[0.5, -0.5]], dtype=D)
    k3 = [math.exp(d) - d - 1 for d in (0.5 - math.log(1.25), -0.5)]
    loss, stats = grpo_loss(logp, old, adv, mask, beta=1.0, ref_logp=ref)
    assert loss.item() == pytest.approx((-1.2 + k3[0] - 1.0 + k3[1]) / 2, rel=1e-12)
    assert stats["kl"] == pytest.approx(sum(k3) / 2, rel=1e-12)
    with pytest.raises(ValueError, match=r"^beta > 0 needs ref_logp from the reference model$"):
        grpo_loss(logp, old, adv, mask, beta=0.1)


def test_grpo_loss_stats_over_a_single_valid_token():
    logp, old = _ratios([[1.5, 1.1]])
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0], dtype=D), torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(-1.2)
    assert stats["ratio"] == pytest.approx(1.5) and stats["clip_fraction"] == 1.0


def test_problem_metrics_by_hand():
    correct = [True, False, False, True]
    keys = ["7", "3", "3", "7"]
    out = problem_metrics(correct, keys, [1, 2, 4, 8])
    # pass@2 = 1 - C(2,2)/C(4,2) = 5/6; maj@2 over ("7", "3"): tie -> first, "7", correct; maj@4: 2-2 tie -> "7"
    assert out == pytest.approx(
        {"pass@1": 0.5, "maj@1": 1.0, "pass@2": 5 / 6, "maj@2": 1.0, "pass@4": 1.0, "maj@4": 1.0}
    )
    assert problem_metrics([], [], [1]) == {"pass@1": 0.0}
    assert problem_metrics(correct, keys, [2]) == pytest.approx({"pass@1": 0.5, "pass@2": 5 / 6, "maj@2": 1.0})
    assert problem_metrics([False, True], ["1", "2"], [1], [0.5, None, 1.5])["entropy"] == 1.0


def test_maj_at_k_error_text():
    with pytest.raises(ValueError, match=r"^maj_at_k needs 1 <= k <= 2 responses, got k=3$"):
        maj_at_k(["a", "b"], [True, False], 3)


def test_normalize_defaults_and_dtype():
    from esbatch.es.core import normalize

    # zscore of (1, 0): mean 0.5, population std 0.5, default eps_num 1e-8
    z = 0.5 / (0.5 + 1e-8)
    assert normalize([1, 0], "zscore").tolist() == pytest.approx([z, -z], rel=1e-15)
    # integer rewards come back as float64 scores in every mode
    for method in ("zscore", "none", "centered_rank"):
        assert normalize([3, 1, 2], method).dtype == "float64", method
    assert normalize([3, 1, 2], "centered_rank").tolist() == [0.5, -0.5, 0.0]


def test_seq_mean_token_mean_with_a_one_token_sequence_and_the_error_text():
    per_token = torch.tensor([[4.0, 9.0], [1.0, 3.0]], dtype=D)
    mask = torch.tensor([[1, 0], [1, 1]])
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == pytest.approx((4.0 + 2.0) / 2)
    with pytest.raises(ValueError, match=r"valid: token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_tok"):
        aggregate(per_token, mask, "sum")
