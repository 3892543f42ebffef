"""GRPO on DeepSpeed (paper Section 2.2), readable top to bottom.

Per step t (every rank, data-parallel):  take this rank's share of the step's B prompts -> generate G
responses per prompt with the current policy -> score them with the task verifier -> group-relative
advantages (all ranks' rewards gathered, so batch statistics are global) -> one forward/backward of the
clipped token-level surrogate (+ beta * k3 KL to a frozen reference when beta > 0) -> DeepSpeed step
(ZeRO, AdamW, gradient clipping) -> the record the lifecycle logs (esbatch/train/lifecycle.py).

Generation uses the DeepSpeed module itself (HF ``generate`` on ``engine.module``, through the backend
registry's ``for_policy``): with ZeRO stages 0-2 every rank holds the full updated weights after
``engine.step()``, so the generator is in sync by construction. One inner iteration per batch (old
log-probs = the sampling policy's, detached), as TRL's default ``num_iterations=1``. Resume continues from
the newest DeepSpeed checkpoint (``checkpoint.every``); steps logged after it are redone.
"""

from __future__ import annotations

import copy
import hashlib
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from esbatch.train.flops import grpo_flops
from esbatch.train.lifecycle import Trainer
from esbatch.train.problems import evaluate_heldout, load_problems, reward_of
from esbatch.train.ranks import Ranks
from esbatch.train.rundir import RunDir
from esbatch.train.schedule import batch_indices, schedule_start


def init_distributed(device: str, timeout_min: float = 30.0) -> Ranks:
    """This process's rank in DeepSpeed's process group; one process without a launcher gets the env
    DeepSpeed expects (it looks for mpi4py otherwise)."""
    import deepspeed

    from esbatch.train.ranks import joined

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(
            dist_backend="nccl" if device.startswith("cuda") else "gloo", timeout=timedelta(minutes=timeout_min)
        )
    return joined("gloo", timeout_min)


def ds_config(cfg: Any, world: int, on_gpu: bool) -> dict[str, Any]:
    g = cfg.grpo
    return {
        "train_batch_size": world,  # one "micro-batch" (this rank's prompts x G responses) per rank per step
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": g.max_grad_norm,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": g.learning_rate, "weight_decay": g.weight_decay, "torch_adam": True},
        },
        "zero_optimization": {"stage": g.zero_stage},
        "bf16": {"enabled": on_gpu},  # fp32 on CPU: bf16 is slower there and loses small updates
        "steps_per_print": 10**9,
    }


def _step_seed(seed: int, t: int, rank: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"grpo/{seed}/{t}/{rank}".encode(), digest_size=4).digest(), "little")


class GRPOTrainer(Trainer):
    label = "GRPO"

    def __init__(self, cfg: Any, rd: RunDir, ranks: Ranks, device: str) -> None:
        self.cfg, self.rd, self.ranks, self.device = cfg, rd, ranks, device
        self._checksum: float | None = None

    def setup(self) -> int:
        import deepspeed

        from esbatch.backends import BACKENDS
        from esbatch.models import load_model_and_tokenizer, load_weights

        cfg, m = self.cfg, self.cfg.model
        dtype = "float32" if self.device == "cpu" else m.dtype
        model, self.tok = load_model_and_tokenizer(m.name, m.gguf_file, m.revision, dtype, self.device)
        if m.init_weights:  # an earlier pipeline stage's weights
            load_weights(model, m.init_weights)
        self.ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.grpo.beta > 0 else None
        model.requires_grad_(True)  # loaded for inference; the policy trains every parameter
        self.engine, *_ = deepspeed.initialize(
            model=model,
            config=ds_config(cfg, self.ranks.world, self.device != "cpu"),
            model_parameters=[p for p in model.parameters() if p.requires_grad],
        )
        backend = BACKENDS.get(cfg.backend.name)
        self.gen = backend.for_policy(self.engine.module, self.tok, cfg.generation.batch_size)
        self.probs = load_problems(cfg, self.gen)
        return cfg.total_updates(len(self.probs.train))

    @property
    def n_train(self) -> int:
        return len(self.probs.train)

    def restore(self, records: list[dict[str, Any]]) -> int:
        """The newest DeepSpeed checkpoint (weights + optimizer); steps logged after it are redone."""
        if not (self.rd.ds_checkpoint / "latest").exists():
            return 0
        _, client = self.engine.load_checkpoint(str(self.rd.ds_checkpoint))
        start = int(client["step"])
        self.saved_at = start if self.rd.center_t() == start else -1  # the final center may be missing
        return start

    def step(self, t: int) -> dict[str, Any]:
        """One GRPO step on this rank's share of the batch; the record holds metrics averaged over ranks."""
        cfg, g = self.cfg, self.cfg.grpo
        n = len(self.probs.train)
        _, idx = batch_indices(cfg.run.seed, t, n, g.batch_size, schedule_start(n, cfg.run.data_before))
        mine = idx[self.ranks.rank :: self.ranks.world] or idx[:1]  # a short tail batch: idle ranks repeat a
        weight = 1.0 if idx[self.ranks.rank :: self.ranks.world] else 0.0  # prompt, with weight 0 below
        t0 = time.perf_counter()
        gens, rewards = self._sample(mine, t)
        t_gen = time.perf_counter() - t0
        t1 = time.perf_counter()
        stats = self._learn(mine, gens, self._advantages(rewards), weight)
        t_train = time.perf_counter() - t1
        self._checksum = self._weights_checksum()
        local = [float(rewards.mean()), float(rewards.std()), *stats, self._checksum]
        m = self._gather(local)
        grad_norm = self.engine.get_global_grad_norm()
        metrics = {
            "reward/mean": float(m[:, 0].mean()),
            "reward/std": float(m[:, 1].mean()),
            "policy/entropy": float(m[:, 2].mean()),
            "policy/kl": float(m[:, 3].mean()),
            "policy/clip_fraction": float(m[:, 4].mean()),
            "loss": float(m[:, 5].mean()),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens/per_s": float(m[:, 6].sum()) / max(t_gen, 1e-9),
            "time/generation_s": t_gen,
            "time/train_s": t_train,
            "flops/update": float(m[:, 7].sum()),  # App. G.2 accounting with this step's real token counts
        }
        return {"t": t, "metrics": metrics, "param_checksums": [float(c) for c in m[:, 8]]}

    def _sample(self, mine: list[int], t: int) -> tuple[list[Any], Any]:
        """G responses per prompt with the current policy, and their rewards [prompts, G]."""
        import torch

        from esbatch.backends.base import SamplingParams

        g, gc = self.cfg.grpo, self.cfg.generation
        sampling = SamplingParams(gc.temperature, gc.top_p, gc.max_new_tokens, n=g.group_size)
        self.engine.module.eval()
        prompts = [self.probs.train_prompts[i] for i in mine]
        gens = self.gen.generate(prompts, sampling, _step_seed(self.cfg.run.seed, t, self.ranks.rank))
        owners = [i for i in mine for _ in range(g.group_size)]
        scores = [reward_of(self.probs.task.score(x.text, self.probs.train[i]), self.cfg) for i, x in zip(owners, gens)]
        return gens, torch.tensor(scores, dtype=torch.float32).view(len(mine), g.group_size)

    def _advantages(self, rewards: Any) -> Any:
        """Group-relative advantages; "batch" scaling divides by the std of every rank's rewards."""
        import torch
        import torch.distributed as dist

        from esbatch.grpo.core import group_advantages

        everyone = [torch.zeros_like(rewards) for _ in range(self.ranks.world)]
        dist.all_gather(everyone, rewards)
        if self.cfg.grpo.scale_rewards == "batch":
            return (rewards - rewards.mean(1, keepdim=True)) / (torch.cat(everyone).std() + 1e-4)
        return group_advantages(rewards, scale=self.cfg.grpo.scale_rewards)

    def _learn(self, mine: list[int], gens: list[Any], adv: Any, weight: float) -> list[float]:
        """Forward/backward of the clipped surrogate and the DeepSpeed step; returns this rank's
        [entropy, kl, clip fraction, loss, completion tokens, FLOPs]."""
        import torch

        from esbatch.grpo.core import grpo_loss, token_entropy, token_logprobs

        g, temp = self.cfg.grpo, self.cfg.generation.temperature or 1.0
        ids, attn, mask, n_prompt = self._sequences(mine, gens)
        self.engine.module.train()
        logits = self.engine(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = token_logprobs(logits, ids[:, 1:], temp)
        ref_logp = None
        if g.beta > 0:
            with torch.no_grad():
                ref = self.ref(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
                ref_logp = token_logprobs(ref, ids[:, 1:], temp)
        loss, stats = grpo_loss(
            logp,
            logp.detach(),
            adv.reshape(-1).to(ids.device),
            mask,
            eps_low=g.epsilon,
            eps_high=g.epsilon_high,
            beta=g.beta,
            ref_logp=ref_logp,
            aggregation=g.loss_aggregation,
        )
        self.engine.backward(loss * weight)
        self.engine.step()
        with torch.no_grad():
            ent = (token_entropy(logits.detach(), temp) * mask).sum() / mask.sum().clamp(min=1)
        n_tok, n_seq = float(mask.sum()), ids.shape[0]
        prompt_len, gen_len = max(n_prompt / n_seq, 1.0), max(n_tok / n_seq, 1.0)
        flops = grpo_flops(self.gen.num_parameters(), g.group_size, len(mine), prompt_len, gen_len, beta=g.beta)
        kl, clip = float(stats["kl"]), float(stats["clip_fraction"])
        return [float(ent), kl, clip, float(loss.detach()), n_tok, flops["total"] * weight]

    def _sequences(self, mine: list[int], gens: list[Any]) -> tuple[Any, Any, Any, float]:
        """prompt + sampled tokens, right-padded, the attention mask, the loss mask over sampled tokens
        (shifted to the predicted positions), and the prompt tokens (repeated per response)."""
        import torch

        tok, G = self.tok, self.cfg.grpo.group_size
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        prompt_ids = tok([self.probs.train_prompts[i] for i in mine], add_special_tokens=False)["input_ids"]
        seqs = [prompt_ids[j // G] + list(x.token_ids) for j, x in enumerate(gens)]
        resp = [[0] * len(prompt_ids[j // G]) + [1] * len(x.token_ids) for j, x in enumerate(gens)]
        L = max(len(s) for s in seqs)
        device = next(self.engine.module.parameters()).device
        ids = torch.tensor([s + [pad] * (L - len(s)) for s in seqs], device=device)
        attn = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs], device=device)
        mask = torch.tensor([r + [0] * (L - len(r)) for r in resp], device=device)[:, 1:].float()
        return ids, attn, mask, sum(len(s) for s in seqs) - float(mask.sum())

    def _gather(self, local: list[float]) -> Any:
        import torch
        import torch.distributed as dist

        mine = torch.tensor(local, dtype=torch.float64)
        parts = [torch.zeros_like(mine) for _ in range(self.ranks.world)]
        dist.all_gather(parts, mine)
        return torch.stack(parts)

    def _weights_checksum(self) -> float:
        from esbatch.models import checksum

        return checksum(dict(self.engine.module.named_parameters()))

    def checksum(self) -> float | None:
        return self._checksum if self._checksum is not None else self._weights_checksum()

    def save(self, t: int, final: bool) -> None:
        self.engine.save_checkpoint(str(self.rd.ds_checkpoint), tag=f"step{t}", client_state={"step": t})
        if final and self.ranks.lead:  # the policy in the same format as an ES center: evaluable, hand-over-able
            self.rd.save_center(self.policy_state(), t)

    def policy_state(self) -> dict[str, Any]:
        return {n: p.detach().float().cpu().contiguous() for n, p in self.engine.module.named_parameters()}

    def center_state(self) -> dict[str, Any]:  # checkpoint.snapshots: the policy as an evaluable center
        return self.policy_state()

    def generator(self) -> Any:  # eval.tasks: sampling from the policy as it stands
        self.engine.module.eval()
        return self.gen

    def evaluate(self) -> dict[str, float]:
        self.engine.module.eval()
        return evaluate_heldout(self.cfg, self.gen, self.probs)

    def postfix(self, metrics: dict[str, Any]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}", "H": f"{metrics['policy/entropy']:.2f}"}

    def export(self, path: Path) -> None:
        self.engine.module.save_pretrained(path)
        self.tok.save_pretrained(path)

    def tags(self) -> dict[str, str]:
        return self.probs.task.tracking_tags()
