"""The GRPO math against hand-computed values and explicit, independent computations."""

import math

import pytest
import torch

from esbatch.grpo.core import (
    aggregate,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    kl_k3,
    token_entropy,
    token_logprobs,
)

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)


def test_group_advantages_group_scale_uses_unbiased_group_std():
    # group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 1: all equal -> exactly 0
    a = group_advantages(REWARDS, "group")
    s = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(a[0], torch.tensor([s, -s, -s, s], dtype=torch.float64), rtol=1e-12, atol=0)
    assert a[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert abs(s - 0.86588) < 1e-5


def test_group_advantages_batch_scale_divides_by_one_std_over_all_rewards():
    # mean 0.75 over 8 rewards; squared deviations 6 * 0.0625 + 2 * 0.5625 = 1.5; sample std sqrt(1.5 / 7)
    a = group_advantages(REWARDS, "batch")
    s = 0.5 / (math.sqrt(1.5 / 7) + 1e-4)
    torch.testing.assert_close(a[0], torch.tensor([s, -s, -s, s], dtype=torch.float64), rtol=1e-12, atol=0)
    assert a[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_group_advantages_none_only_centers():
    a = group_advantages(REWARDS, "none")
    assert a.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    assert not torch.isnan(group_advantages(torch.ones(3, 1), "none")).any()


def test_group_advantages_validation():
    with pytest.raises(ValueError, match="prompts, G"):
        group_advantages(torch.zeros(8))
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(REWARDS, "zscore")
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(4, 1), "group")
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.ones(1, 1), "batch")


def test_token_logprobs_match_manual_gather_with_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    tokens = torch.tensor([[0, 4, 2], [1, 1, 3]])
    for temp in (1.0, 0.6):
        ref = torch.log_softmax(logits / temp, dim=-1)
        expected = torch.tensor(
            [[ref[b, t, tokens[b, t]].item() for t in range(3)] for b in range(2)], dtype=torch.float64
        )
        torch.testing.assert_close(token_logprobs(logits, tokens, temp), expected, rtol=1e-12, atol=1e-12)
    assert token_logprobs(logits.to(torch.bfloat16), tokens).dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, 0.0)


def test_token_entropy_matches_explicit_loop_with_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 6, generator=g, dtype=torch.float64) * 3
    for temp in (1.0, 0.7):
        expected = torch.empty(2, 3, dtype=torch.float64)
        for b in range(2):
            for t in range(3):
                z = [float(v) / temp for v in logits[b, t]]
                zmax = max(z)
                ez = [math.exp(v - zmax) for v in z]
                p = [e / sum(ez) for e in ez]
                expected[b, t] = -sum(pi * math.log(pi) for pi in p)
        torch.testing.assert_close(token_entropy(logits, temp), expected, rtol=1e-12, atol=1e-12)
    # uniform over V: log V; a lower temperature sharpens, so entropy drops
    assert abs(token_entropy(torch.zeros(1, 1, 8)).item() - math.log(8)) < 1e-6
    assert (token_entropy(logits, 0.5) < token_entropy(logits, 1.0)).all()


def test_token_entropy_of_masked_vocab_is_finite_with_finite_grad():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    h = token_entropy(logits)
    assert abs(h.item() - math.log(2)) < 1e-6
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_k3_expectation_is_the_exact_kl_and_nonnegative():
    pi = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    ref = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact_kl = sum(p * math.log(p / q) for p, q in zip(pi.tolist(), ref.tolist()))
    expectation = float((pi * kl_k3(pi.log(), ref.log())).sum())  # sum over the support, y ~ pi
    assert abs(expectation - exact_kl) < 1e-6
    assert abs(exact_kl - 0.0945819) < 1e-6  # 0.2 ln 0.5 + 0.5 ln 1.25 + 0.3 ln 1.5
    g = torch.Generator().manual_seed(2)
    logp, ref_logp = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_k3(logp, ref_logp) >= 0).all()
    assert kl_k3(logp, logp).abs().max() == 0


def _ratios(r):
    """(logp, old_logp) with exp(logp - old_logp) = r."""
    r = torch.tensor(r, dtype=torch.float64)
    return r.log(), torch.zeros_like(r)


def test_clipped_surrogate_symmetric_hand_values():
    logp, old = _ratios([[0.5, 0.9, 1.1, 1.5], [0.5, 0.9, 1.1, 1.5]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, clipped = clipped_surrogate(logp, old, adv, torch.ones(2, 4), eps_low=0.2)
    # A=+1: -min(r, clip(r)); A=-2: -min(-2r, -2clip(r)) = 2 max(r, clip(r))
    expected = torch.tensor([[-0.5, -0.9, -1.1, -1.2], [1.6, 1.8, 2.2, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert clipped.tolist() == [[False, False, False, True], [True, False, False, False]]


def test_clipped_surrogate_asymmetric_clip_higher():
    logp, old = _ratios([[0.75, 1.25, 1.5], [0.75, 1.25, 1.5]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, clipped = clipped_surrogate(logp, old, adv, torch.ones(2, 3), eps_low=0.2, eps_high=0.28)
    expected = torch.tensor([[-0.75, -1.25, -1.28], [0.8, 1.25, 1.5]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert clipped.tolist() == [[False, False, True], [True, False, False]]
    # the same 1.25 is clipped under the symmetric 0.2
    assert clipped_surrogate(logp, old, adv, torch.ones(2, 3))[1][0, 1]


def test_clip_mask_ignores_padding():
    logp, old = _ratios([[1.5, 1.5]])
    _, clipped = clipped_surrogate(logp, old, torch.tensor([1.0]), torch.tensor([[1, 0]]))
    assert clipped.tolist() == [[True, False]]


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 100.0, 100.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    "mode, max_len, expected",
    [
        ("token_mean", None, 21 / 6),  # (1+2+3+4+5+6) / 6 valid tokens
        ("seq_mean_token_mean", None, (10 / 4 + 11 / 2) / 2),  # 4.0
        ("seq_mean_token_sum", None, (10 + 11) / 2),  # 10.5
        ("seq_mean_token_sum_norm", 8, 21 / (2 * 8)),  # 1.3125
        ("seq_mean_token_sum_norm", None, 21 / (2 * 4)),  # L defaults to the padded width T = 4
    ],
)
def test_aggregation_modes_on_ragged_mask(mode, max_len, expected):
    assert aggregate(PER_TOKEN, MASK, mode, max_len).item() == pytest.approx(expected, rel=1e-12)


def test_aggregation_of_empty_rows_is_zero_not_nan():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    assert aggregate(PER_TOKEN, mask, "seq_mean_token_mean").item() == pytest.approx(1.5 / 2)
    assert aggregate(PER_TOKEN, torch.zeros(2, 4), "token_mean").item() == 0.0
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(PER_TOKEN, MASK, "sum")


def test_grpo_loss_gradient_sign_and_zero_on_clipped_tokens():
    logp0, old = _ratios([[1.0, 1.5, 0.9, 0.5]])
    logp = logp0.clone().requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask)
    assert loss.item() == pytest.approx(-(1.0 + 1.2 + 0.9) / 3)
    loss.backward()
    # d/dlogp (-r A / n) = -r A / n on unclipped valid tokens; 0 where clipped (r=1.5 > 1.2) or padded
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 3, 0.0, -0.9 / 3, 0.0]], dtype=torch.float64))
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    assert stats["ratio"] == pytest.approx((1.0 + 1.5 + 0.9) / 3)
    assert stats["kl"] == 0.0

    logp = logp0.clone().requires_grad_(True)
    grpo_loss(logp, old, torch.tensor([-1.0], dtype=torch.float64), mask)[0].backward()
    assert logp.grad[0, 0] > 0 and logp.grad[0, 1] > 0 and logp.grad[0, 3] == 0  # r=1.5 unclipped for A<0


def test_grpo_loss_on_policy_and_kl_penalty():
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(2, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.randn(2, 3, generator=g, dtype=torch.float64)
    adv = torch.tensor([0.5, -1.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = grpo_loss(logp, None, adv, mask)  # rho = 1: loss = -mean over tokens of A
    assert loss.item() == pytest.approx(-(3 * 0.5 - 2 * 1.5) / 5)
    assert stats["ratio"] == pytest.approx(1.0) and stats["clip_fraction"] == 0.0

    k3 = torch.exp(ref - logp.detach()) - (ref - logp.detach()) - 1
    m = mask.double()
    loss, stats = grpo_loss(logp, None, adv, mask, beta=0.04, ref_logp=ref)
    expected = ((-adv[:, None] + 0.04 * k3) * m).sum() / 5
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert stats["kl"] == pytest.approx(((k3 * m).sum() / 5).item(), rel=1e-12)
    assert grpo_loss(logp, None, adv, mask, ref_logp=ref)[1]["kl"] == pytest.approx(stats["kl"])  # logged at beta=0
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, None, adv, mask, beta=0.04)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregate_over_micro_batches_sums_to_the_whole_batch(mode):
    """Micro-batches of 3, 3, 2 of 8 ragged sequences, each cut to its own longest, with the whole batch's
    n_tokens, n_seqs and width: the parts sum to the unbatched value (not a mean of micro-batch means)."""
    g = torch.Generator().manual_seed(4)
    lens = [1, 4, 2, 6, 3, 5, 2, 5]
    per_token = torch.randn(8, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lens])
    whole = aggregate(per_token, mask, mode)
    norm = {"n_tokens": mask.sum(), "n_seqs": 8, "max_len": 6}
    parts = []
    for sl in (slice(0, 3), slice(3, 6), slice(6, 8)):
        w = max(lens[sl])
        parts.append(aggregate(per_token[sl, :w], mask[sl, :w], mode, **norm))
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-12)
    means = [aggregate(per_token[sl], mask[sl], mode) for sl in (slice(0, 3), slice(3, 6), slice(6, 8))]
    assert float(sum(means) / 3) != pytest.approx(float(whole), rel=1e-3)  # the mean of means is not it
    with pytest.raises(ValueError, match="n_seqs" if mode != "token_mean" else "n_tokens"):
        aggregate(per_token, mask, mode, **({"n_seqs": 8} if mode == "token_mean" else {"n_tokens": 5}))


def test_micro_batch_aggregation_at_its_edges():
    """A whole batch of one valid token (the n_tokens floor is 1, not more); sum-norm without max_len divides by
    the micro-batch's width T (not B, and not None); the refusal names what is missing, word for word."""
    per_token = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.75, 0.0, 0.0, 0.0], [0.0] * 5], dtype=torch.float64)
    one = torch.zeros(3, 5, dtype=torch.long)
    one[1, 1] = 1
    assert float(aggregate(per_token, one, "token_mean", n_tokens=one.sum())) == 0.75
    ragged = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    values = torch.arange(15, dtype=torch.float64).reshape(3, 5)
    whole = aggregate(values, ragged, "seq_mean_token_sum_norm")  # divides by T = 5
    assert float(aggregate(values, ragged, "seq_mean_token_sum_norm", n_seqs=3)) == pytest.approx(float(whole))
    assert float(whole) == pytest.approx((0 + 1 + 5 + 6 + 7 + 8 + 9 + 10) / 3 / 5)
    with pytest.raises(ValueError, match="^token_mean over micro-batches needs the whole batch's n_tokens$"):
        aggregate(values, ragged, "token_mean", n_seqs=3)
