"""The ``grpo`` section of a run config: GRPO's settings with their help text (names and defaults as TRL's
GRPOConfig where the two share a setting)."""

from __future__ import annotations

from dataclasses import dataclass

from esbatch.schema import setting


@dataclass
class GRPOConfig:
    group_size: int = setting(
        8, "G: responses per prompt (TRL num_generations=8; the paper pairs G=8 with ES N=32).", ge=2
    )
    batch_size: int = setting(8, "B: prompts per optimizer step, across all ranks.", ge=1)
    learning_rate: float = setting(1e-6, "AdamW learning rate (TRL default 1e-6).", gt=0.0)
    weight_decay: float = setting(0.0, "AdamW weight decay.", ge=0.0)
    epsilon: float = setting(0.2, "Lower (and default upper) clip of the PPO ratio (TRL/PPO 0.2).", gt=0.0)
    epsilon_high: float | None = setting(
        None, "Separate upper clip (DAPO clip-higher, e.g. 0.28); None = epsilon.", gt=0.0
    )
    beta: float = setting(
        0.0, "KL penalty weight (see kl_estimator); 0 = no reference model is loaded (TRL default).", ge=0.0
    )
    kl_estimator: str = setting(
        "k3",
        "KL per token (beta > 0): k3 (Shao et al.; TRL use_bias_correction_kl=False; verl low_var_kl, clamped) or "
        "k3_ratio, k3 x pi/pi_old (DeepSeek-V3.2; TRL use_bias_correction_kl=True, its 1.16 default).",
        choices=("k3", "k3_ratio"),
    )
    scale_rewards: str = setting(
        "group",
        "Advantage scale: group std (GRPO), batch std over the whole batch on all ranks, or none (Dr. GRPO).",
        choices=("group", "batch", "none"),
    )
    loss_aggregation: str = setting(
        "token_mean",
        "The loss over the whole batch on all ranks (the same step on any number of ranks or micro-batches): "
        "token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm (Dr. GRPO, / (responses x "
        "generation.max_new_tokens)); TRL's and verl's names in docs/grpo-and-pipelines.md.",
        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"),
    )
    rollout_correction: str = setting(
        "tis",
        "tis: each token's loss x min(pi_trainer / pi_engine, rollout_correction_cap), the engine's own log-prob "
        "(TRL vllm_importance_sampling_mode=token_truncate; verl rollout_is=token); none: off. Default tis: round-off "
        "where the engine is the trainer (hf, fp32), a correction where not (vLLM, bf16), as TRL and verl do.",
        choices=("none", "tis"),
    )
    rollout_correction_cap: float = setting(2.0, "C of tis (Yao et al., 2025 and verl: 2; TRL: 3).", gt=0.0)
    micro_batch_size: int | None = setting(
        None,
        "Sequences (responses) per forward/backward pass on each rank; a step accumulates the gradients of "
        "ceil(its sequences / this) micro-batches before its one optimizer step, with the loss normalised over "
        "the whole batch, so the gradient equals the unbatched one. Old and reference log-probs are computed "
        "in micro-batches too. A memory setting, not a hyperparameter. None = the whole batch on this rank in "
        "one pass. TRL: per_device_train_batch_size (counted in completions) with gradient_accumulation_steps.",
        ge=1,
    )
    iterations: int = setting(
        1,
        "mu: optimizer steps per generated batch (TRL num_iterations; GRPO paper's mu). Old log-probs are "
        "computed once, before the first of them, so from the second on the ratio differs from 1 and the clip "
        "acts. 1 = on-policy, old = current log-probs detached (no extra forward).",
        ge=1,
    )
    max_grad_norm: float = setting(1.0, "Gradient clipping (DeepSpeed gradient_clipping).", gt=0.0)
    zero_stage: int = setting(
        2, "DeepSpeed ZeRO stage 0-2 (3 would shard the weights the generator reads on every rank).", ge=0, le=2
    )
    updates: int | None = setting(
        None,
        "Training budget in optimizer steps (set this or `epochs`), as TRL's max_steps counts them (global_step): "
        "with iterations = mu, a batch is generated every mu steps and a step is one logged update (log.jsonl "
        "line, MLflow step, checkpoint.every and eval.every count them too).",
        ge=1,
    )
    epochs: float | None = setting(
        None,
        "Training budget in epochs over the training split: each prompt is generated for once per epoch, so an "
        "epoch is ceil(train / batch_size) generated batches = that many x iterations optimizer steps (TRL).",
        gt=0.0,
    )
