"""GRPO's rollout correction (grpo.rollout_correction: tis): the engine's own log-probs of the sampled tokens, the
truncated importance weight min(pi_trainer / pi_engine, C) per token, and the mismatch metrics.

- The HF generator's log-probs (Generation.logprobs) are the trainer's token_logprobs of the same tokens at the
  same temperature, to <= 1e-4 in fp32 on CPU, also with top_p < 1 (then of the nucleus, renormalised, as vLLM's
  processed_logprobs); so the correction changes the step by round-off only.
- Off-policy by construction (an engine at another temperature): computed exactly over every sequence of a small
  model (6 tokens, length 3: 216 sequences), the corrected expected gradient is closer to the on-policy one than
  the uncorrected one.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from esbatch.backends.base import SamplingParams
from esbatch.backends.hf import HFGenerator
from esbatch.grpo.core import grpo_loss, rollout_is_weights, token_logprobs
from esbatch.models import load_model_and_tokenizer


def _trainer_logprobs(model, tok, prompt: str, gens, temperature: float) -> list[torch.Tensor]:
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    out = []
    for g in gens:
        ids = torch.tensor([p + list(g.token_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1].float()
        out.append(token_logprobs(logits, ids[:, 1:], temperature)[0, len(p) - 1 :])
    return out


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 1.0), (1.3, 0.9)])
def test_hf_generator_logprobs_are_the_trainers_log_probs(tiny_model_dir, temperature, top_p):
    model, tok = load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")
    gen = HFGenerator(model, tok, batch_size=16)
    prompts = ["Say a digit #1", "ab"]
    sampling = SamplingParams(temperature, top_p, max_new_tokens=8, n=4, logprobs=True)
    gens = gen.generate(prompts, sampling, seed=3)
    assert all(len(g.logprobs) == len(g.token_ids) == g.n_tokens > 0 for g in gens)
    for j, prompt in enumerate(prompts):
        mine = gens[4 * j : 4 * j + 4]
        want = _trainer_logprobs(model, tok, prompt, mine, temperature)
        for g, w in zip(mine, want):
            got = torch.tensor(g.logprobs)
            if top_p == 1.0:
                torch.testing.assert_close(got, w, rtol=0, atol=1e-4)
            else:  # the nucleus renormalised: never below the full distribution's log-prob, and the same token order
                assert bool((got >= w - 1e-4).all()) and bool((got <= 1e-6).all())
    # not a tautology: the sampled tokens' log-probs differ from token to token and from 0
    assert len({round(x, 3) for g in gens for x in g.logprobs}) > 10


def test_correction_changes_the_step_by_round_off_when_the_engine_is_the_trainer(tiny_model_dir):
    """Weights from HF rollouts of the policy itself: the truncated weights are 1 to 1e-4 and the gradient of the
    loss with them equals the gradient without them to that."""
    model, tok = load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")
    model.requires_grad_(True)
    gens = HFGenerator(model, tok, batch_size=16).generate(
        ["Say a digit #1"], SamplingParams(0.9, 1.0, 8, n=6, logprobs=True), 5
    )
    p = tok("Say a digit #1", add_special_tokens=False)["input_ids"]
    L = max(len(g.token_ids) for g in gens)
    ids = torch.tensor([p + list(g.token_ids) + [0] * (L - len(g.token_ids)) for g in gens])
    mask = torch.tensor(
        [[0.0] * (len(p) - 1) + [1.0] * len(g.token_ids) + [0.0] * (L - len(g.token_ids)) for g in gens]
    )
    engine = torch.zeros_like(mask)
    for j, g in enumerate(gens):
        engine[j, mask[j].bool()] = torch.tensor(g.logprobs)
    adv = torch.linspace(-1, 1, len(gens))
    grads = []
    for tis in (False, True):
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:], 0.9)
        w, stats = rollout_is_weights(logp.detach(), engine, mask, 2.0)
        loss, _ = grpo_loss(logp, None, adv, mask, is_weight=w if tis else None)
        loss.backward()
        grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
        assert float(stats["max_abs_diff"]) <= 1e-4 and int(stats["capped"]) == 0
        assert float((w[mask.bool()] - 1).abs().max()) <= 1e-4
    rel = float((grads[0] - grads[1]).abs().max() / grads[0].abs().max())
    assert 0 < float(grads[0].abs().max()) and rel <= 1e-4


def _tiny_lm(vocab: int = 6, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # logits of a useful spread (the default init is nearly uniform)
        for q in model.parameters():
            q.mul_(3.0)
    return model


@pytest.mark.parametrize("engine", ["temperature 1.3", "temperature 0.8", "weights +10% noise"])
def test_truncated_importance_weights_bring_the_off_policy_gradient_nearer_the_on_policy_one(engine):
    """Every sequence y of 3 tokens after the prompt [0] (6^3 = 216), reward r(y) = number of 2s. The policy
    pi samples at T = 1; the engine (mu) samples at another temperature, or with perturbed weights. Exact expected
    GRPO gradients (seq_mean_token_sum, so 1/B sum_y with the sequence's probability in its advantage):

        on-policy:  E_pi[(r - E_pi r)  sum_t grad log pi(y_t)]
        none:       E_mu[(r - E_mu r)  sum_t grad log pi(y_t)]
        tis:        E_mu[(r - E_mu r)  sum_t min(pi/mu, 2) grad log pi(y_t)]

    The corrected gradient is nearer the on-policy one (both relative distances are printed; measured 0.139 ->
    0.103, 0.143 -> 0.100 and 0.106 -> 0.082). Token-level weights do not correct the prefix's distribution: with
    a far-off engine (T = 1.6 on a model of 8x these weights) the corrected gradient was farther (4.3 -> 5.5)."""
    import copy

    V, n, cap = 6, 3, 2.0
    model = _tiny_lm(V)
    seqs = torch.tensor([[0, *y] for y in itertools.product(range(V), repeat=n)])
    mask = torch.ones(len(seqs), n)
    reward = (seqs[:, 1:] == 2).sum(1).double()
    behaviour, t_engine = copy.deepcopy(model), 1.0
    if engine.startswith("temperature"):
        t_engine = float(engine.split()[1])
    else:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for q in behaviour.parameters():
                q.add_(0.1 * q.abs().mean() * torch.randn(q.shape, generator=g))

    def logps(m, temperature):
        return token_logprobs(m(input_ids=seqs).logits[:, :-1].float(), seqs[:, 1:], temperature)

    with torch.no_grad():
        pi_seq = logps(model, 1.0).sum(1).double().exp()
        mu_tok = logps(behaviour, t_engine)
    mu_seq = mu_tok.sum(1).double().exp()
    assert abs(float(pi_seq.sum()) - 1) < 1e-5 and abs(float(mu_seq.sum()) - 1) < 1e-5  # every sequence is there

    def expected_gradient(probs, engine_logp=None):
        model.zero_grad(set_to_none=True)
        logp = logps(model, 1.0)
        adv = (reward - (probs * reward).sum()) * probs * len(seqs)  # 1/B sum_y p(y) (...): the expectation
        w = None
        if engine_logp is not None:
            w, _ = rollout_is_weights(logp.detach(), engine_logp, mask, cap)
        loss, _ = grpo_loss(logp, None, adv.float(), mask, aggregation="seq_mean_token_sum", is_weight=w)
        loss.backward()
        return torch.cat([q.grad.flatten() for q in model.parameters()]).double()

    on = expected_gradient(pi_seq)
    none = expected_gradient(mu_seq)
    tis = expected_gradient(mu_seq, mu_tok)
    d_none, d_tis = float((none - on).norm() / on.norm()), float((tis - on).norm() / on.norm())
    print(f"{engine}: relative distance to the on-policy gradient: uncorrected {d_none:.3f}, corrected {d_tis:.3f}")
    assert d_none > 0.05  # the engine's policy is far enough off for the test to mean something
    assert d_tis < 0.85 * d_none
