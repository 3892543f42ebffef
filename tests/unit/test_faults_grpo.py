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
            "grpo": {"group_size": 2, "batch_size": 2, "updates": 1, "loss_aggregation": aggregation},
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
    ent, kl, clip, loss, n_tok, flops = tr._learn(tr._prepare([0, 1], gens, ADV, 1.0))
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
    flops = tr._learn(tr._prepare([0, 1], gens, ADV, 1.0))[5]
    P = sum(p.numel() for p in model.parameters())
    G, B = 2, 2
    L_p = (2 + 2 + 3 + 3) / 4  # each response's prompt
    L_g = (2 + 3 + 1 + 2) / 4
    # generation 2 P G B L + train forward/backward 6 P G B L + AdamW 12 P (no reference, no old log-probs)
    assert flops == pytest.approx(2 * P * G * B * (L_p + L_g) + 6 * P * G * B * (L_p + L_g) + 12 * P, rel=1e-12)
    assert flops == pytest.approx(P * (144 + 12), rel=1e-12)
    assert tr._learn(tr._prepare([0, 1], gens, ADV, 0.0))[5] == 0.0  # an idle rank's repeated prompt counts nothing
