"""One rank of the GRPO rank-count test (tests/integration/test_grpo_ranks.py), started by torchrun:

    python -m torch.distributed.run --nproc_per_node W grpo_ranks_worker.py MODEL_DIR CASES_JSON OUT_PT

For each case (grpo settings + batch size B), a real GRPOTrainer (DeepSpeed on gloo, the tiny model) trains one
generated batch (mu optimizer steps) whose rollouts are injected: every prompt's G responses, rewards and engine
log-probs are a function of the prompt's index alone, so the batch is the same whatever the rank count and only
its split over the ranks differs. The trainer's own _rollouts/_prepare/_learn/step run unchanged; the trainer is
set up once (GRPOTrainer.setup) and each case gets its settings and a fresh DeepSpeed engine
(GRPOTrainer.init_engine) on the base model, and with beta > 0 a reference 0.05-perturbed from it (so the KL term
has a gradient from the first step). What DeepSpeed hands the optimizer is read at each step's accumulation
boundary (deepspeed.utils.safe_get_full_grad, a collective every rank calls). Rank 0 saves, per case: each step's
full gradient, the weights after the last step and each step's logged metrics; and the initial weights.
"""

from __future__ import annotations

import copy
import json
import sys

import torch

from esbatch.backends.base import Generation
from esbatch.config import config_from_dict
from esbatch.grpo.config import GRPOConfig
from esbatch.grpo.trainer import GRPOTrainer, init_distributed
from esbatch.models import load_model_and_tokenizer

MAX_NEW = 5


def rollouts(tok, i: int, G: int, seed: int):
    """Prompt i's G responses (1..MAX_NEW digit tokens), their rewards and engine log-probs: functions of i only."""
    gen = torch.Generator().manual_seed(seed * 1000 + i)
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    gens, rewards = [], []
    for _ in range(G):
        n = int(torch.randint(1, MAX_NEW + 1, (1,), generator=gen))
        ids = [digits[int(d)] for d in torch.randint(0, 10, (n,), generator=gen)]
        # engine log-probs around the tiny model's (~ -4.5): ratios from ~e^-1.5 to ~e^1.5, some above the cap
        lp = (-4.5 + 1.5 * (2 * torch.rand(n, generator=gen) - 1)).tolist()
        gens.append(Generation(tok.decode(ids), n, token_ids=ids, logprobs=lp))
        rewards.append(float(torch.rand((), generator=gen) < 0.5) + 0.25 * float(torch.rand((), generator=gen)))
    return gens, rewards


def config(model_dir: str, case: dict):
    grpo = {"group_size": 3, "learning_rate": 1e-2, "max_grad_norm": 1e6, **case["grpo"]}
    return config_from_dict(
        {
            "algorithm": "grpo",
            "run": {"seed": 5, "threads": 1},
            "model": {"name": model_dir, "dtype": "float32"},
            "task": {"name": "toy:DigitTask", "params": {"size": 12}, "heldout_size": 0},
            "generation": {"temperature": 0.9, "max_new_tokens": MAX_NEW, "batch_size": 8},
            "grpo": {**grpo, "iterations": case["mu"], "updates": case["mu"]},
        }
    )


def main() -> None:
    model_dir, cases_path, out_path = sys.argv[1:4]
    ranks = init_distributed("cpu")
    cases = json.loads(open(cases_path).read())
    tr = GRPOTrainer(config(model_dir, cases[0]), None, ranks, "cpu")
    tr.setup()
    base, _ = load_model_and_tokenizer(model_dir, dtype="float32")

    def sample(mine, t):
        gens, rewards = [], []
        for i in mine:
            g, r = rollouts(tr.tok, i, tr.grpo.group_size, seed=7)
            gens += g
            rewards.append(r)
        tr._score_errors = (0, len(gens))
        r = torch.tensor(rewards)
        return gens, r, r > 0.5

    tr._sample = sample
    results = {}
    for case in cases:
        tr.cfg = config(model_dir, case)
        tr.grpo, tr._batch = tr.cfg.section(GRPOConfig), None
        tr.engine = engine = tr.init_engine(copy.deepcopy(base))
        tr.ref = None
        if tr.grpo.beta > 0:
            tr.ref = copy.deepcopy(base).eval().requires_grad_(False)
            with torch.no_grad():
                for p in tr.ref.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        grads, real_step = [], engine.step

        def step(engine=engine, real_step=real_step, grads=grads):
            if engine.is_gradient_accumulation_boundary():
                from deepspeed.utils import safe_get_full_grad

                grads.append(torch.cat([safe_get_full_grad(p).flatten().clone() for p in engine.module.parameters()]))
            real_step()

        engine.step = step
        records = [tr.step(t) for t in range(case["mu"])]
        if ranks.lead:
            weights = torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])
            results[case["id"]] = {"grads": grads, "weights": weights, "metrics": [r["metrics"] for r in records]}
        del engine, tr.engine
    if ranks.lead:
        results["initial weights"] = torch.cat([p.detach().flatten().clone() for p in base.parameters()])
        torch.save(results, out_path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
