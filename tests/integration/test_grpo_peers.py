"""esbatch's GRPO loss against TRL 1.16's own GRPOTrainer._compute_loss (called, not copied) on identical inputs:
the loss and its gradient for every loss_aggregation (and the TRL loss_type docs/grpo-and-pipelines.md names for
it), beta 0 and > 0 with both KL estimators, on-policy (old = current) and off-policy old log-probs, with and
without the rollout correction (TRL's vllm importance sampling, mode token_truncate, the same cap).

TRL's trainer is made with object.__new__ and given the attributes _compute_loss reads, the way TRL's own unit tests
do; its forward (_get_per_token_logps_and_entropies) returns the test's log-probs, so both losses are functions of
the same leaf tensor and their gradients compare directly. In an integration file: importing TRL takes ~7 s.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import trl.trainer.grpo_trainer as trl_grpo  # a dev dependency (pyproject [dev]), pinned to 1.16.0

from esbatch.grpo.core import grpo_loss, rollout_is_weights

# ours -> TRL GRPOConfig.loss_type
TRL_LOSS = {
    "token_mean": "dapo",
    "seq_mean_token_mean": "grpo",
    "seq_mean_token_sum": "luspo",
    "seq_mean_token_sum_norm": "dr_grpo",
}
B, T, L_MAX, CAP = 6, 5, 7, 2.0


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    for i, n in enumerate([5, 3, 1, 4, 2, 5]):  # ragged responses
        mask[i, n:] = 0
    logp = -1.5 + 0.5 * torch.randn(B, T, generator=g)
    return {
        "logp": logp,
        "old": logp + 0.3 * torch.randn(B, T, generator=g),  # ratios well outside [0.8, 1.2]: the clip acts
        "ref": logp + 0.2 * torch.randn(B, T, generator=g),
        "engine": logp + 0.6 * torch.randn(B, T, generator=g),  # some importance ratios above the cap
        "adv": torch.randn(B, generator=g),
        "mask": mask,
    }


def trl_loss(x, leaf, *, loss_type, beta, bias_kl, old, tis):
    """TRL 1.16's _compute_loss on ``x`` with per-token log-probs ``leaf``."""
    tr = object.__new__(trl_grpo.GRPOTrainer)
    tr.loss_type, tr.beta = loss_type, beta
    tr.epsilon_low = tr.epsilon_high = 0.2
    tr.importance_sampling_level = "token"
    tr.top_entropy_quantile, tr.off_policy_mask_threshold = 1.0, None
    tr.use_vllm, tr.vllm_importance_sampling_correction = tis, tis
    tr.max_completion_length = L_MAX
    tr.current_gradient_accumulation_steps = 1
    tr.aux_loss_enabled, tr._entropy_bonus_enabled = False, False
    tr.args = SimpleNamespace(use_bias_correction_kl=bias_kl, delta=None, steps_per_generation=1)
    tr.model = SimpleNamespace(training=True)
    tr.accelerator = SimpleNamespace(
        num_processes=1, gather=lambda t: t, reduce=lambda t, reduction="sum": t, gather_for_metrics=lambda t: t
    )
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    batch = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": x["mask"].long(),
        "advantages": x["adv"],
        "num_items_in_batch": x["mask"].sum(),
    }
    if old:
        batch["old_per_token_logps"] = x["old"]
    if beta:
        batch["ref_per_token_logps"] = x["ref"]
    if tis:  # TRL's own formula in _generate_and_score_completions, mode token_truncate, clip_min None
        trainer_old = x["old"] if old else leaf.detach()
        diff = torch.nan_to_num((trainer_old - x["engine"]) * x["mask"], nan=0.0)
        batch["importance_sampling_ratio"] = torch.clamp(torch.exp(diff), min=None, max=CAP)
    return tr._compute_loss(None, batch)


@pytest.mark.parametrize("mode", list(TRL_LOSS))
@pytest.mark.parametrize("beta, kl", [(0.0, "k3"), (0.04, "k3"), (0.04, "k3_ratio")])
@pytest.mark.parametrize("old", [False, True])
@pytest.mark.parametrize("tis", [False, True])
def test_loss_and_gradient_equal_trl_compute_loss(mode, beta, kl, old, tis):
    x = inputs()
    ours_leaf = x["logp"].clone().requires_grad_(True)
    trl_leaf = x["logp"].clone().requires_grad_(True)
    old_logp = x["old"] if old else None
    w = None
    if tis:
        w, _ = rollout_is_weights(x["old"] if old else ours_leaf.detach(), x["engine"], x["mask"], CAP)
    ours, _ = grpo_loss(
        ours_leaf,
        old_logp,
        x["adv"],
        x["mask"],
        beta=beta,
        ref_logp=x["ref"] if beta else None,
        aggregation=mode,
        max_len=L_MAX,
        kl_estimator=kl,
        is_weight=w,
    )
    theirs = trl_loss(x, trl_leaf, loss_type=TRL_LOSS[mode], beta=beta, bias_kl=kl == "k3_ratio", old=old, tis=tis)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_leaf.grad, trl_leaf.grad, rtol=1e-6, atol=1e-8)
    assert ours_leaf.grad.abs().sum() > 0


def test_the_peer_comparison_tells_the_modes_and_estimators_apart():
    """The parity above is not vacuous: on these inputs every other pairing of our mode with a TRL loss_type, and
    the other KL estimator, gives another loss."""
    x = inputs()
    for mode in TRL_LOSS:
        ours, _ = grpo_loss(x["logp"], x["old"], x["adv"], x["mask"], aggregation=mode, max_len=L_MAX)
        for other, loss_type in TRL_LOSS.items():
            if other != mode:
                theirs = trl_loss(x, x["logp"], loss_type=loss_type, beta=0.0, bias_kl=False, old=True, tis=False)
                assert abs(float(ours) - float(theirs)) > 1e-4, (mode, loss_type)
    leaf = x["logp"].clone().requires_grad_(True)
    k3, _ = grpo_loss(leaf, x["old"], x["adv"], x["mask"], beta=0.04, ref_logp=x["ref"], kl_estimator="k3")
    theirs = trl_loss(x, leaf, loss_type="dapo", beta=0.04, bias_kl=True, old=True, tis=False)
    assert abs(float(k3) - float(theirs)) > 1e-5
