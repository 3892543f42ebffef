"""One GRPO learning step (esbatch/grpo/trainer.py:GRPOTrainer._learn) on the tiny model against a by-hand
computation: the gradient the trainer hands to the optimizer equals the gradient of
    -1/n_tok sum_j A_j sum_k log pi(y_jk | prefix)         (token_mean; rho = 1 at one inner iteration)
with each response scored by its own unpadded forward pass, the loss mask is the response tokens shifted to
the predicting positions, and the FLOPs are App. G.2's (2 + 6) P G B L + 12 P.

DeepSpeed is replaced by a double that back-propagates and records, so the step takes well under a second.
"""

import pytest
import torch

from esbatch.backends.base import Generation
from esbatch.config import config_from_dict
from esbatch.grpo.trainer import GRPOTrainer
from esbatch.models import load_model_and_tokenizer
from esbatch.train.problems import Problems
from esbatch.train.ranks import Ranks

TEMP = 0.7
PROMPTS = ["ab", "xyz"]  # character tokenizer: 2 and 3 tokens
RESPONSES = [["1", "2"], ["3", "4", "5"], ["6"], ["7", "8"]]  # G = 2 responses per prompt, prompt-major
ADV = torch.tensor([[1.0, -0.5], [0.25, -2.0]])


def learn(tr, b, first=True):
    """GRPOTrainer._learn's sums as this rank's (entropy, kl, clip fraction, loss, tokens, FLOPs), means per token."""
    r = tr._learn(b, first=first)
    n = max(r["tokens"], 1.0)
    return r["entropy_sum"] / n, r["kl_sum"] / n, r["clip_sum"] / n, r["loss"], r["tokens"], r["flops"]


class EngineDouble:
    """What GRPOTrainer uses of a DeepSpeed engine: the module, forward, backward (recorded) and step (no-op,
    so the gradients stay to be read)."""

    def __init__(self, module):
        self.module, self.losses, self.steps = module, [], 0

    def __call__(self, **kw):
        return self.module(**kw)

    def backward(self, loss, scale_wrt_gas=True):
        self.losses.append(float(loss.detach()))
        loss.backward()

    def step(self):
        self.steps += 1


class GenDouble:
    def __init__(self, params):
        self.params = params

    def num_parameters(self):
        return self.params


def _trainer(tiny_model_dir, aggregation="token_mean"):
    cfg = config_from_dict(
        {
            "algorithm": "grpo",
            "model": {"name": str(tiny_model_dir)},
            "task": {"name": "toy:DigitTask", "heldout_size": 0},
            "generation": {"temperature": TEMP, "max_new_tokens": 4},
            "grpo": {
                "group_size": 2,
                "batch_size": 2,
                "updates": 1,
                "loss_aggregation": aggregation,
                "rollout_correction": "none",  # these responses are written here, no engine sampled them
            },
        }
    )
    model, tok = load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")
    model.requires_grad_(True)
    tr = GRPOTrainer(cfg, None, Ranks(), "cpu")
    tr.engine, tr.tok, tr.ref = EngineDouble(model), tok, None
    tr.gen = GenDouble(sum(p.numel() for p in model.parameters()))
    tr.probs = Problems(None, [], [], list(PROMPTS), [])
    gens = [Generation("".join(r), len(r), token_ids=tok.convert_tokens_to_ids(r)) for r in RESPONSES]
    return tr, model, tok, gens


def _expected_objective(model, tok, gens, aggregation):
    """The surrogate whose gradient the step must take, from one unpadded forward per response."""
    total, n_tok = 0.0, sum(len(r) for r in RESPONSES)
    for j, g in enumerate(gens):
        p = tok(PROMPTS[j // 2], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + list(g.token_ids)])
        logits = model(input_ids=ids).logits[0].float() / TEMP
        logp = torch.log_softmax(logits, dim=-1)
        seq = sum(logp[len(p) - 1 + k, y] for k, y in enumerate(g.token_ids))  # position i predicts token i+1
        a = ADV.reshape(-1)[j]
        if aggregation == "token_mean":
            total = total - a * seq / n_tok
        else:  # seq_mean_token_mean
            total = total - a * seq / len(g.token_ids) / len(gens)
    return total


def test_loss_mask_marks_exactly_the_response_tokens_at_their_predicting_positions(tiny_model_dir):
    tr, _, tok, gens = _trainer(tiny_model_dir)
    ids, attn, mask, n_prompt = tr._sequences([0, 1], gens)
    # lengths: 2+2, 2+3, 3+1, 3+2 -> padded to 5; mask[k] = 1 iff token k+1 is a response token
    assert mask.tolist() == [
        [0, 1, 1, 0],
        [0, 1, 1, 1],
        [0, 0, 1, 0],
        [0, 0, 1, 1],
    ]
    assert attn.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert ids[1].tolist() == tok.convert_tokens_to_ids(["a", "b", "3", "4", "5"])
    assert n_prompt == 2 + 2 + 3 + 3


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_learning_step_descends_the_hand_computed_objective(tiny_model_dir, aggregation):
    tr, model, tok, gens = _trainer(tiny_model_dir, aggregation)
    ent, kl, clip, loss, n_tok, flops = learn(tr, tr._prepare([0, 1], gens, ADV, 1.0))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert tr.engine.steps == 1 and len(tr.engine.losses) == 1

    model.zero_grad(set_to_none=True)
    model.train()
    _expected_objective(model, tok, gens, aggregation).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7, msg=f"gradient of {n}")

    # the loss value at rho = 1: -sum_j A_j * (its share of the tokens)
    a = ADV.reshape(-1).tolist()
    lens = [len(r) for r in RESPONSES]
    if aggregation == "token_mean":
        want = -sum(x * n for x, n in zip(a, lens)) / sum(lens)
    else:
        want = -sum(a) / len(a)
    assert loss == pytest.approx(want, rel=1e-6)
    assert tr.engine.losses[0] == pytest.approx(want, rel=1e-6)
    assert n_tok == 8 and kl == 0.0 and clip == 0.0

    # entropy: the mean over the 8 response tokens of H(softmax(logits / T)), from unpadded forwards
    with torch.no_grad():
        hs = []
        for j, g in enumerate(gens):
            p = tok(PROMPTS[j // 2], add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([p + list(g.token_ids)])).logits[0] / TEMP
            for k in range(len(g.token_ids)):
                q = torch.softmax(logits[len(p) - 1 + k], -1)
                hs.append(float(-(q * q.log()).sum()))
    assert ent == pytest.approx(sum(hs) / len(hs), rel=1e-4)


def test_learning_step_flops_follow_appendix_g2(tiny_model_dir):
    tr, model, _, gens = _trainer(tiny_model_dir)
    flops = learn(tr, tr._prepare([0, 1], gens, ADV, 1.0))[5]
    P = sum(p.numel() for p in model.parameters())
    G, B = 2, 2
    L_p = (2 + 2 + 3 + 3) / 4  # each response's prompt
    L_g = (2 + 3 + 1 + 2) / 4
    # generation 2 P G B L + train forward/backward 6 P G B L + AdamW 12 P (no reference, no old log-probs)
    assert flops == pytest.approx(2 * P * G * B * (L_p + L_g) + 6 * P * G * B * (L_p + L_g) + 12 * P, rel=1e-12)
    assert flops == pytest.approx(P * (144 + 12), rel=1e-12)
    assert learn(tr, tr._prepare([0, 1], gens, ADV, 0.0))[5] == 0.0  # an idle rank's repeated prompt counts nothing


# ----------------------------------------------------------------------------- micro-batches and mu iterations

PROMPTS8 = ["ab", "xyz"]  # G = 4 responses each: 8 sequences of 1-6 response tokens, all lengths different
RESPONSES8 = [["1"], ["2", "3", "4", "5"], ["6", "7"], ["8", "9", "0", "1", "2", "3"], ["4", "5", "6"], ["7"] * 5]
RESPONSES8 += [["8", "9"], ["0", "1", "2", "3", "4"]]
ADV8 = torch.tensor([[1.0, -0.5, 0.25, -0.75], [2.0, -1.0, 0.5, -1.5]])
# all of core's modes: the three the config offers and Dr. GRPO's sum-norm (set on the config object directly)
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
# fp32 gradient-equality tolerance: micro-batching only reorders fp32 sums and cuts the padded width
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7


class SGDEngineDouble(EngineDouble):
    """DeepSpeed's gradient accumulation as GRPOTrainer drives it: backward() accumulates .grad, step() counts
    micro-steps and at the last of ``gas`` records the gradient and the weights, applies plain SGD (p -= lr grad)
    and zeroes the gradient."""

    def __init__(self, module, gas=1, lr=0.0):
        super().__init__(module)
        self.gas, self.lr, self.micro, self.grads, self.weights = gas, lr, 0, [], []

    def step(self):
        self.micro += 1
        if self.micro % self.gas:
            return
        self.steps += 1
        with torch.no_grad():
            self.grads.append({n: p.grad.clone() for n, p in self.module.named_parameters()})
            self.weights.append({n: p.detach().clone() for n, p in self.module.named_parameters()})
            for p in self.module.parameters():
                p -= self.lr * p.grad
                p.grad = None


def _trainer8(tiny_model_dir, aggregation="token_mean", micro=None, iterations=1, beta=0.0, lr=0.0, epsilon=0.2):
    from esbatch.grpo.trainer import micro_batches

    grpo = {"group_size": 4, "batch_size": 2, "updates": 4, "micro_batch_size": micro, "iterations": iterations}
    cfg = config_from_dict(
        {
            "algorithm": "grpo",
            "model": {"name": str(tiny_model_dir)},
            "task": {"name": "toy:DigitTask", "heldout_size": 0},
            "generation": {"temperature": TEMP, "max_new_tokens": 6},
            "grpo": {**grpo, "beta": beta, "epsilon": epsilon, "rollout_correction": "none"},
        }
    )
    cfg.grpo.loss_aggregation = aggregation
    model, tok = load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")
    model.requires_grad_(True)
    tr = GRPOTrainer(cfg, None, Ranks(), "cpu")
    tr.engine = SGDEngineDouble(model, micro_batches(cfg, 1), lr)
    tr.tok, tr.ref = tok, None
    if beta > 0:  # a reference that differs from the policy, so the k3 term has a gradient
        import copy

        tr.ref = copy.deepcopy(model).requires_grad_(False)
        with torch.no_grad():
            for p in tr.ref.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    tr.gen = GenDouble(sum(p.numel() for p in model.parameters()))
    tr.probs = Problems(None, [], [], list(PROMPTS8), [])
    gens = [Generation("".join(r), len(r), token_ids=tok.convert_tokens_to_ids(r)) for r in RESPONSES8]
    return tr, model, tok, gens


@pytest.mark.parametrize(
    "aggregation, micro", [(a, 3) for a in AGGREGATIONS] + [("token_mean", 1), ("token_mean", 5), ("token_mean", 8)]
)
def test_micro_batched_step_has_the_unbatched_gradient(tiny_model_dir, aggregation, micro):
    """3 over 8 sequences: micro-batches of 3, 3, 2 sequences of different lengths (also 1, 5 + 3, and 8 = one
    micro-batch through the accumulating path); stale old log-probs (ratios away from 1, some clipped) and a
    reference (beta > 0), so every term of the loss is in the gradient."""
    results = {}
    for m in (None, micro):
        tr, model, tok, gens = _trainer8(tiny_model_dir, aggregation, micro=m, beta=0.04)
        b = tr._prepare([0, 1], gens, ADV8, 1.0)
        noise = torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(5))
        b["old_logp"] = tr._logprobs(model, b["ids"], b["attn"]) + 0.3 * noise  # as if from an earlier policy
        ent, kl, clip, loss, n_tok, _ = learn(tr, b)
        results[m] = (tr.engine.grads[0], (ent, kl, clip, loss, n_tok), list(tr.engine.losses), b)
    (g0, s0, l0, b0), (g1, s1, l1, b1) = results[None], results[micro]
    assert len(l0) == 1 and len(l1) == -(-8 // micro)  # one backward per micro-batch, one optimizer step
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"gradient of {n}")
    assert sum(l1) == pytest.approx(l0[0], rel=1e-5)  # the micro-batch losses sum to the whole batch's loss
    assert s1 == pytest.approx(s0, rel=1e-5)  # entropy, kl, clip fraction, loss, tokens
    assert 0 < s0[2] < 1 and s0[1] > 0  # the clip and the KL term are both at work
    # reference log-probs were computed micro-batch by micro-batch and agree with the one-pass ones
    torch.testing.assert_close(b1["ref_logp"] * b1["mask"], b0["ref_logp"] * b0["mask"], rtol=1e-5, atol=1e-6)


def test_micro_batch_passes_pad_a_short_rank_share():
    """ceil(ceil(B / world) G / micro) passes on every rank; an uneven split pads with zero-weight passes."""
    from esbatch.grpo.trainer import ds_config, micro_batches

    def cfg(**grpo):
        return config_from_dict({"algorithm": "grpo", "grpo": {"updates": 1, **grpo}})

    assert micro_batches(cfg(batch_size=8, group_size=8), 1) == 1  # None: the whole batch in one pass
    assert micro_batches(cfg(batch_size=8, group_size=8, micro_batch_size=8), 1) == 8
    assert micro_batches(cfg(batch_size=8, group_size=8, micro_batch_size=3), 2) == 11  # ceil(32 / 3)
    assert micro_batches(cfg(batch_size=5, group_size=4, micro_batch_size=5), 2) == 3  # ceil(3 * 4 / 5)
    ds = ds_config(cfg(batch_size=5, group_size=4, micro_batch_size=5), 2, False)
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    assert [ds[k] for k in keys] == [6, 1, 3]


def _hand_logps(model, tok, gens, prompts=PROMPTS8, G=4):
    """Each response's token log-probs from its own unpadded forward (no trainer code)."""
    out = []
    with torch.no_grad():
        for j, g in enumerate(gens):
            p = tok(prompts[j // G], add_special_tokens=False)["input_ids"]
            logits = model(input_ids=torch.tensor([p + list(g.token_ids)])).logits[0].double() / TEMP
            logp = torch.log_softmax(logits, dim=-1)
            out.append(torch.stack([logp[len(p) - 1 + k, y] for k, y in enumerate(g.token_ids)]))
    return out


@pytest.mark.parametrize("micro", [None, 3])
def test_second_inner_iteration_is_the_hand_computed_clipped_surrogate(tiny_model_dir, micro):
    """mu = 2: old log-probs stored before the first update; after it (plain SGD, lr 0.05) the ratio leaves
    [1 - eps, 1 + eps] on some tokens. The trainer's 2nd-iteration loss and clip fraction equal the per-token
    formula -min(r A, clamp(r, 1 - eps, 1 + eps) A) averaged over all tokens (token_mean), written out here."""
    eps = 0.2
    tr, model, tok, gens = _trainer8(tiny_model_dir, micro=micro, iterations=2, lr=0.05, epsilon=eps)
    old_hand = _hand_logps(model, tok, gens)  # the policy that sampled (the weights before any update)
    b = tr._prepare([0, 1], gens, ADV8, 1.0)
    mask = b["mask"].bool()
    torch.testing.assert_close(b["old_logp"][mask], torch.cat(old_hand).float(), rtol=1e-5, atol=1e-5)
    first = learn(tr, b, first=True)
    lens = [len(r) for r in RESPONSES8]
    # at the first inner step the ratio is 1: the loss is -sum_j A_j n_j / n_tok and nothing is clipped
    assert first[3] == pytest.approx(-sum(a * n for a, n in zip(ADV8.reshape(-1).tolist(), lens)) / sum(lens))
    assert first[2] == 0.0

    new_hand = _hand_logps(model, tok, gens)  # after the first update
    adv = ADV8.reshape(-1).tolist()
    terms, clipped = [], 0
    for j, (new, old) in enumerate(zip(new_hand, old_hand)):
        for r in torch.exp(new - old).tolist():
            a = adv[j]
            terms.append(-min(r * a, min(max(r, 1 - eps), 1 + eps) * a))
            clipped += (a > 0 and r > 1 + eps) or (a < 0 and r < 1 - eps)
    n_tok = sum(len(r) for r in RESPONSES8)
    want_loss, want_clip = sum(terms) / n_tok, clipped / n_tok
    assert 0 < clipped < n_tok  # the update moved some ratios out of the clip range, not all

    ent, kl, clip, loss, n, flops = learn(tr, b, first=False)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    assert clip == pytest.approx(want_clip, abs=1e-6) and round(clip * n_tok) == clipped  # the same tokens
    assert tr.engine.steps == 2

    # and its gradient is the hand surrogate's, through torch.minimum and an explicit clamp
    got = tr.engine.grads[1]
    params = dict(model.named_parameters())
    with torch.no_grad():  # back to the weights of the 2nd iteration (the double applied its update)
        for k, v in params.items():
            v.copy_(tr.engine.weights[1][k])
    model.zero_grad(set_to_none=True)
    total = 0.0
    for j, g in enumerate(gens):
        p = tok(PROMPTS8[j // 4], add_special_tokens=False)["input_ids"]
        logits = model(input_ids=torch.tensor([p + list(g.token_ids)])).logits[0].float() / TEMP
        logp = torch.log_softmax(logits, dim=-1)
        new = torch.stack([logp[len(p) - 1 + k, y] for k, y in enumerate(g.token_ids)])
        ratio = torch.exp(new - old_hand[j].float())
        a = adv[j]
        total = total - torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a).sum()
    (total / n_tok).backward()
    for k, v in params.items():
        torch.testing.assert_close(got[k], v.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {k}")


def test_inner_iteration_flops_sum_to_the_batch_total(tiny_model_dir):
    """With mu = 3 the first step carries generation + old log-probs + 1/3 of the training; the batch's three
    steps sum to (2 + 2 + 3 x 6) P G B L + 3 x 12 P."""
    tr, model, _, gens = _trainer8(tiny_model_dir, iterations=3, lr=0.0)
    b = tr._prepare([0, 1], gens, ADV8, 1.0)
    steps = [learn(tr, b, first=k == 0)[5] for k in range(3)]
    P, G, B = sum(p.numel() for p in model.parameters()), 4, 2
    L = (2 * 4 + 3 * 4) / 8 + sum(len(r) for r in RESPONSES8) / 8  # mean prompt + mean response tokens
    per_step_train = 6 * P * G * B * L + 12 * P
    assert steps[1] == steps[2] == pytest.approx(per_step_train, rel=1e-12)
    assert steps[0] == pytest.approx(2 * P * G * B * L + 2 * P * G * B * L + per_step_train, rel=1e-12)
    assert sum(steps) == pytest.approx((2 + 2 + 3 * 6) * P * G * B * L + 3 * 12 * P, rel=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_defaults_compute_the_single_pass_step_bit_for_bit(tiny_model_dir, beta):
    """micro_batch_size None and iterations 1 (the defaults): the step is the one-forward computation written
    out here (the trainer's code before micro-batches and mu), equal to the last bit in loss and gradient."""
    from esbatch.grpo.core import grpo_loss, token_entropy, token_logprobs

    tr, model, _, gens = _trainer8(tiny_model_dir, beta=beta)
    ent, kl, clip, loss, n_tok, _ = learn(tr, tr._prepare([0, 1], gens, ADV8, 1.0))
    got = tr.engine.grads[0]

    ids, attn, mask, _ = tr._sequences([0, 1], gens)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = token_logprobs(logits, ids[:, 1:], TEMP)
    ref_logp = None
    if beta > 0:
        with torch.no_grad():
            ref_logp = token_logprobs(
                tr.ref(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), ids[:, 1:], TEMP
            )
    want, stats = grpo_loss(logp, logp.detach(), ADV8.reshape(-1), mask, beta=beta, ref_logp=ref_logp)
    want.backward()
    h = (token_entropy(logits.detach(), TEMP) * mask).sum() / mask.sum().clamp(min=1)
    assert (loss, n_tok) == (float(want), 28.0)  # the loss to the last bit
    # the stats travel as per-rank sums (rank-invariant means): the same figures up to that round-off
    assert (ent, kl, clip) == pytest.approx((float(h), stats["kl"], stats["clip_fraction"]), rel=1e-6, abs=1e-12)
    for n, p in model.named_parameters():
        assert torch.equal(got[n], p.grad), n


def test_a_verifier_that_raises_stops_grpo_before_the_step(tiny_model_dir):
    """GRPO counts the scorer's exceptions of a generated batch (all ranks) and stops before learning from it."""
    from types import SimpleNamespace

    from esbatch.tasks import Verdict
    from esbatch.tasks.verify import ScoringError, guarded
    from esbatch.train.problems import load_problems

    tr, *_ = _trainer(tiny_model_dir)
    tr.cfg.reward.max_score_errors = 0.5

    class Gen:
        def chat_prompt(self, messages):
            return messages[-1]["content"]

        def generate(self, prompts, sampling, seed):
            return [Generation("7" if k % 4 else "", 1) for k in range(len(prompts) * sampling.n)]

    tr.gen = Gen()
    tr.probs = load_problems(tr.cfg, tr.gen)

    def fragile(response, ex):
        if response:
            raise KeyError("no parser for " + response)
        return Verdict.MISSING

    tr.probs.task.score = guarded(SimpleNamespace(score=fragile), "score", Verdict.WRONG, tr.probs.errors.add)
    with pytest.raises(ScoringError, match=r"raised on 3 of the 4 responses of this update, more than reward\.max_"):
        tr._rollouts(0)
    assert tr.engine.steps == 0


def test_only_the_checkpoint_latest_names_is_kept_and_nothing_goes_when_latest_disagrees(tmp_path):
    from esbatch.grpo.trainer import drop_older_checkpoints

    for tag in ("step1", "step2", "step10"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("step2")
    with pytest.raises(RuntimeError, match="does not name step10"):
        drop_older_checkpoints(tmp_path, "step10")  # `latest` not yet at the new tag: keep everything
    assert sorted(p.name for p in tmp_path.glob("step*")) == ["step1", "step10", "step2"]
    (tmp_path / "latest").write_text("step10\n")
    assert drop_older_checkpoints(tmp_path, "step10") == ["step1", "step2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step10"]
