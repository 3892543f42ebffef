"""The GRPO math: group advantages, token log-probs and entropy, the clipped surrogate, k3 KL, loss aggregation,
and the truncated importance weight that corrects for rollouts sampled by another engine.

Pure torch on tensors, no model. Shapes: B sequences (B = prompts x G responses, or [prompts, G] for the
rewards), T completion tokens, V vocabulary; ``mask[B, T]`` is 1 on valid completion tokens.
Defaults follow TRL's GRPOTrainer (num_generations=8, beta=0.0, epsilon=0.2, scale_rewards="group",
k3 KL, loss "token_mean" as in verl/DAPO); each function names its source.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k3", "k3_ratio")
ROLLOUT_CORRECTIONS = ("none", "tis")


def group_advantages(rewards: Tensor, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Group-relative advantages of ``rewards[P, G]`` (P prompts, G responses each).

        A_ij = (r_ij - mean_j r_ij) / (s + eps)

    group: s = std_j(r_i), the std of prompt i's group (Shao et al., 2024; TRL scale_rewards="group")
    batch: s = std(r), one std over all P*G rewards; the mean stays per group (TRL scale_rewards="batch")
    none:  no division, A_ij = r_ij - mean_j r_ij (Dr. GRPO, Liu et al., 2025)

    std is the unbiased sample std (divide by G - 1), as ``torch.std`` in TRL; the ES z-score
    (App. G.1) divides by N instead. A group of equal rewards gets A = 0, never NaN.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, G], got shape {tuple(rewards.shape)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid: {', '.join(SCALES)}")
    if scale == "group" and rewards.shape[1] < 2:
        raise ValueError("scale='group' needs G >= 2 responses per prompt for a std")
    if scale == "batch" and rewards.numel() < 2:
        raise ValueError("scale='batch' needs at least 2 rewards for a std")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centered
    std = rewards.std(dim=1, keepdim=True) if scale == "group" else rewards.std()
    return centered / (std + eps)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    """logits / T in at least fp32 (bf16 log-softmax loses the small log-probs)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(y_t) = z_{t, y_t} - logsumexp_v z_{t, v}, with z = logits[B, T, V] / temperature."""
    z = _scaled(logits, temperature)
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """H_t = -sum_v p_v log p_v with p = softmax(logits / temperature), per token [B, T].

    log p comes from log_softmax (stable); masked-out logits (-inf) contribute 0, not NaN.
    TRL logs it on the temperature-scaled logits, the distribution the responses were sampled from.
    """
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    return -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per sampled token (y ~ pi):

        k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1

    Non-negative (e^x >= 1 + x) and unbiased: E_pi[k3] = E_pi[pi_ref/pi] - 1 + KL = KL (TRL's per_token_kl).
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def rollout_is_weights(
    trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling (TIS) of rollouts sampled by another engine than the trainer's forward:

        w_t = min(pi_trainer(y_t) / pi_engine(y_t), C) = min(exp(trainer_logp_t - engine_logp_t), C)

    per sampled token, detached (a constant factor of the token's loss, as in TRL's vllm_importance_sampling
    "token_truncate" and verl's token-level rollout IS). ``trainer_logp`` is the trainer's log-prob of the policy
    that generated the batch (GRPO's "old" policy), ``engine_logp`` the engine's log-prob of the same token
    under its sampling distribution. Returns w[B, T] (1 on padding) and sums over the valid tokens for the
    mismatch metrics: ``abs_diff`` (sum |engine - trainer|), ``max_abs_diff``, ``capped`` (tokens with ratio
    > C) and ``tokens``.
    """
    if cap <= 0:
        raise ValueError(f"the importance weight cap must be > 0, got {cap}")
    valid = mask.bool()
    diff = (trainer_logp - engine_logp).detach()
    diff = torch.where(valid, diff, torch.zeros_like(diff))  # padding: ratio 1, and no NaN from its zeros
    ratio = torch.exp(diff)
    w = torch.clamp(ratio, max=cap)
    absd = diff.abs()
    stats = {
        "abs_diff": absd.sum(),
        "max_abs_diff": absd.max() if absd.numel() else torch.zeros(()),
        "capped": ((ratio > cap) & valid).sum(),
        "tokens": valid.sum(),
    }
    return w, stats


def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO-clip per-token loss (Schulman et al., 2017) with a sequence advantage A_i broadcast over tokens:

        rho_t = exp(logp_t - old_logp_t)
        loss_t = -min(rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i)

    eps_high defaults to eps_low (symmetric); a larger eps_high is DAPO's clip-higher (Yu et al., 2025).
    Returns (loss[B, T], clipped[B, T]): clipped marks valid tokens where the clipped term is strictly
    the smaller one (rho > 1 + eps_high with A > 0, or rho < 1 - eps_low with A < 0); those get no gradient.
    """
    eps_high = eps_low if eps_high is None else eps_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp.detach())
    unclipped = ratio * adv
    clipped_term = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    clipped = ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))
    return -torch.minimum(unclipped, clipped_term), clipped & mask.bool()


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    max_len: int | None = None,
    *,
    n_tokens: Tensor | float | None = None,
    n_seqs: int | None = None,
) -> Tensor:
    """Reduce a per-token loss[B, T] over the valid tokens (n_i = sum_t mask_it) to a scalar. The peers' names
    (TRL 1.16 GRPOConfig.loss_type, verl actor.loss_agg_mode) are in docs/grpo-and-pipelines.md's table:

    token_mean:              sum_it l_it m_it / sum_it m_it          (TRL "dapo"; verl "token-mean")
    seq_mean_token_mean:     1/B sum_i (sum_t l_it m_it / n_i)        (TRL "grpo"; verl "seq-mean-token-mean")
    seq_mean_token_sum:      1/B sum_i sum_t l_it m_it                (verl "seq-mean-token-sum"; TRL "luspo")
    seq_mean_token_sum_norm: 1/(B L) sum_it l_it m_it, L = max_len    (Dr. GRPO, Liu et al., 2025; TRL "dr_grpo")

    L is the constant maximum completion length (TRL's max_completion_length; the trainer passes
    generation.max_new_tokens); None takes T, the padded width (verl's divisor, which also omits the 1/B).
    Empty denominators count as 1, so an all-padding batch or sequence adds 0 instead of NaN.

    Gradient accumulation and ranks: when ``per_token`` is one micro-batch (or one rank's share) of a larger
    batch, pass that batch's valid tokens ``n_tokens`` (sum_it m_it) and sequence count ``n_seqs``, summed over
    every micro-batch and rank; the terms then sum to the whole batch's loss (not a mean of per-part means).
    None (the default) takes them from this tensor, the unbatched computation.
    """
    m = mask.to(per_token.dtype)
    token_sums = (per_token * m).sum(-1)
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    if n_tokens is not None or n_seqs is not None:  # one micro-batch's share of the whole batch's loss
        if mode == "token_mean":
            if n_tokens is None:
                raise ValueError("token_mean over micro-batches needs the whole batch's n_tokens")
            return token_sums.sum() / torch.as_tensor(n_tokens, dtype=m.dtype).clamp(min=1)
        if n_seqs is None:
            raise ValueError(f"{mode} over micro-batches needs the whole batch's n_seqs")
        if mode == "seq_mean_token_mean":
            return (token_sums / m.sum(-1).clamp(min=1)).sum() / n_seqs
        if mode == "seq_mean_token_sum":
            return token_sums.sum() / n_seqs
        return token_sums.sum() / n_seqs / (per_token.shape[-1] if max_len is None else max_len)
    if mode == "token_mean":
        return token_sums.sum() / m.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        return (token_sums / m.sum(-1).clamp(min=1)).mean()
    if mode == "seq_mean_token_sum":
        return token_sums.mean()
    return token_sums.mean() / (per_token.shape[-1] if max_len is None else max_len)  # seq_mean_token_sum_norm


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    aggregation: str = "token_mean",
    max_len: int | None = None,
    n_tokens: Tensor | float | None = None,
    n_seqs: int | float | None = None,
    kl_estimator: str = "k3",
    is_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO objective (Shao et al., 2024), to minimize, term for term as TRL's GRPOTrainer._compute_loss:

        L = aggregate_it( w_it * -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i) + beta * kl_it )

    old_logp=None means one update per generation batch: old = logp.detach(), so rho = 1 with grad A.
    ref_logp is required when beta > 0; with beta = 0 (TRL's default) there is no reference model.
    kl_estimator: "k3" (Schulman's k3, Shao et al.; TRL use_bias_correction_kl=False) or "k3_ratio" (k3 times
    rho, differentiable, DeepSeek-V3.2; TRL use_bias_correction_kl=True, its default since 1.16).
    is_weight: the rollout correction's truncated importance weights w[B, T] (``rollout_is_weights``); None = 1.
    Stats (masked means over valid tokens): clip_fraction, kl (k3, without rho; 0 without ref_logp), ratio.
    n_tokens / n_seqs: the whole batch's counts when this is one micro-batch of it (see ``aggregate``).
    """
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp from the reference model")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    old_logp = logp.detach() if old_logp is None else old_logp
    per_token, clipped = clipped_surrogate(logp, old_logp, advantages, mask, eps_low, eps_high)
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    kl = kl_k3(logp, ref_logp.detach()) if ref_logp is not None else torch.zeros_like(logp)
    if beta != 0.0:
        penalty = kl * torch.exp(logp - old_logp.detach()) if kl_estimator == "k3_ratio" else kl
        per_token = per_token + beta * penalty
    loss = aggregate(per_token, mask, aggregation, max_len, n_tokens=n_tokens, n_seqs=n_seqs)

    with torch.no_grad():
        m = mask.to(logp.dtype)
        n = m.sum().clamp(min=1)
        stats = {
            "clip_fraction": float(clipped.to(m.dtype).sum() / n),
            "kl": float((kl * m).sum() / n),
            "ratio": float((torch.exp(logp - old_logp) * m).sum() / n),
        }
    return loss, stats
