"""GRPO on DeepSpeed (paper Section 2.2), readable top to bottom.

Per step t (every rank, data-parallel; one optimizer step, TRL's global_step): when t % mu == 0 (mu =
``grpo.iterations``) generate G responses to this rank's share of batch t // mu's B prompts with HF ``generate`` on
the DeepSpeed module (in sync by construction under ZeRO 0-2), or (backend.name: vllm) on this rank's vLLM engine,
loaded with the policy's weights first (esbatch/backends/vllm_policy.py), score them, take group-relative
advantages over all ranks' rewards, and store the old (mu > 1) and reference (beta > 0) log-probs and the
batch's token and response counts over all ranks (one all-reduce); then the clipped token-level surrogate (+ beta
* KL), times the truncated importance weight of the engine's own log-probs (grpo.rollout_correction), in
micro-batches whose losses are each rank's share of the whole batch's loss, and one DeepSpeed step (which averages
the ranks' gradients: each share is scaled by the rank count to undo that, so the gradient is the whole batch's
whatever the ranks, their shares or idle ranks). The loss scores the generated token ids with the trainer's own
forward, whatever generated them.
Resume: the newest DeepSpeed checkpoint, plus each rank's stored batch when it lies inside one. Records carry
``update/rel_distance_from_theta0`` (theta_0: the base model before ``model.init_weights``, as ES) and, per
generated batch, ``diversity``: p(x) over the G rollouts, a population of one (Section 3.1). docs/grpo-and-pipelines.md.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.cpp_extension import get_default_build_root

from esbatch.backends import BACKENDS
from esbatch.backends.base import SamplingParams
from esbatch.backends.config import ESSetup
from esbatch.grpo.config import GRPOConfig
from esbatch.grpo.core import group_advantages, grpo_loss, rollout_is_weights, token_entropy, token_logprobs
from esbatch.metrics import diversity_metrics
from esbatch.models import (
    SafetensorsReader,
    checksum,
    load_model_and_tokenizer,
    load_weights,
    relative_distance,
    weight_files,
)
from esbatch.tasks import Verdict
from esbatch.train.config import TrainConfig
from esbatch.train.flops import grpo_flops
from esbatch.train.lifecycle import Trainer
from esbatch.train.problems import check_scoring, evaluate_heldout, load_problems, reward_of
from esbatch.train.ranks import Ranks, joined
from esbatch.train.rundir import RunDir
from esbatch.train.schedule import batch_indices, schedule_start


def init_distributed(device: str, timeout_min: float = 30.0) -> Ranks:
    """This process's rank in DeepSpeed's process group; one process without a launcher gets the env
    DeepSpeed expects (it looks for mpi4py otherwise)."""
    import deepspeed

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    clear_stale_build_locks()
    if not device.startswith("cuda"):
        skip_shm_comm_build()
    if not dist.is_initialized():
        deepspeed.init_distributed(
            dist_backend="nccl" if device.startswith("cuda") else "gloo", timeout=timedelta(minutes=timeout_min)
        )
    return joined("gloo", timeout_min)


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed's CPU backend from JIT-compiling its shared-memory all-reduce op at start-up.

    Only ``inference_all_reduce`` (DeepSpeed's tensor-parallel inference, module_inject) uses that op; GRPO's
    gradient all-reduce goes through torch.distributed (gloo) either way. The build cost each fresh home directory
    (or container) about 30 s of wall time and 56 s of CPU on 2 cores (measured here), with every other rank waiting
    on its lock. Marked incompatible, ``deepspeed.comm.torch.build_shm_op`` returns None and nothing is built.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def clear_stale_build_locks(max_age_s: float = 600.0, root: str | Path | None = None) -> list[Path]:
    """Remove torch-extension build locks older than ``max_age_s``; returns the ones removed.

    DeepSpeed JIT-builds its shared-memory op on first start, under a lock file that torch's FileBaton waits on
    with no deadline. A job killed mid-build (preempted, scancelled, a timeout) leaves the lock behind and every
    later GRPO start on that home directory then waits forever in init_distributed (seen here: 20 min before
    anyone looked). A build takes about a minute, so a lock untouched for 10 minutes is a dead builder's.
    """

    base = Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    removed = []
    for lock in list(base.glob("*/lock")) + list(base.glob("*/*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
                removed.append(lock)
                print(
                    f"warning: removed a stale build lock {lock} ({age / 60:.0f} min old: a build killed "
                    "before it finished); the op is rebuilt if needed",
                    file=sys.stderr,
                )
        except FileNotFoundError:  # another rank removed it, or the build finished
            continue
    return removed


def micro_batches(cfg: TrainConfig, world: int) -> int:
    """Forward/backward passes per optimizer step on every rank: ceil(S / micro_batch_size), S the sequences
    of the largest rank share, ceil(B / world) x G (1 without micro-batching). Ranks with fewer sequences
    (an uneven or tail batch) pad with zero-weight passes: DeepSpeed's accumulation counts backward calls."""
    g = cfg.section(GRPOConfig)
    if g.micro_batch_size is None:
        return 1
    return -(-(-(-g.batch_size // world) * g.group_size) // g.micro_batch_size)


def ds_config(cfg: TrainConfig, world: int, on_gpu: bool) -> dict[str, Any]:
    g = cfg.section(GRPOConfig)
    gas = micro_batches(cfg, world)
    return {
        # DeepSpeed's "micro-batch" is one of our micro-batches of sequences; our losses are already normalised
        # over the whole batch (backward(scale_wrt_gas=False)), so its accumulation only counts to the step
        "train_batch_size": world * gas,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
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


def drop_older_checkpoints(folder: Path, keep: str) -> list[str]:
    """Delete every DeepSpeed checkpoint tag in ``folder`` but ``keep`` (the one `latest` names): resume reads only
    the newest, and each tag is the weights plus AdamW's state (about 16 bytes per parameter), so keeping them all
    filled terabytes at the paper's scale. Returns the tags deleted."""
    import shutil

    if (folder / "latest").read_text().strip() != keep:  # never delete what resume would read
        raise RuntimeError(f"{folder}/latest does not name {keep}: older checkpoints kept")
    gone = sorted(p.name for p in folder.glob("step*") if p.is_dir() and p.name != keep)
    for name in gone:
        shutil.rmtree(folder / name)
    return gone


class GRPOTrainer(Trainer):
    label = "GRPO"

    def __init__(self, cfg: TrainConfig, rd: RunDir, ranks: Ranks, device: str) -> None:
        self.cfg, self.rd, self.ranks, self.device = cfg, rd, ranks, device
        self.grpo = cfg.section(GRPOConfig)
        self._checksum: float | None = None
        self._batch: dict[str, Any] | None = None  # the generated batch the next steps train on
        self.theta0: dict[str, Any] | None = None  # rank 0, tracking.drift: fp32 theta_0 on CPU
        self._stale = False  # whether the policy moved since the generator last loaded it (_sync_policy)
        self.total = 0

    def setup(self) -> int:
        cfg, m = self.cfg, self.cfg.model
        dtype = "float32" if self.device == "cpu" else m.dtype
        model, self.tok = load_model_and_tokenizer(m.name, m.gguf_file, m.revision, dtype, self.device)
        if cfg.tracking.drift and self.ranks.lead:  # theta_0 is the base model, as for ES
            self.theta0 = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}
        if m.init_weights:  # an earlier pipeline stage's weights
            load_weights(model, m.init_weights)
        self.ref = copy.deepcopy(model).eval().requires_grad_(False) if self.grpo.beta > 0 else None
        self.engine = self.init_engine(model)
        backend = BACKENDS.get(cfg.backend.name)
        setup = ESSetup(  # backend.name: vllm starts this rank's engine on the module's weights (vllm_policy.py)
            model=dataclasses.replace(m, dtype=dtype),
            backend=cfg.backend,
            batch_size=cfg.generation.batch_size,
            track_drift=False,
            seed=cfg.run.seed,
            hang_timeout_s=cfg.run.hang_timeout_s,
        )
        self.gen = backend.for_policy(self.engine.module, self.tok, setup)  # holding the module's weights
        self.probs = load_problems(cfg, self.gen)
        self.total = cfg.total_updates(len(self.probs.train))
        return self.total

    def init_engine(self, model: Any) -> Any:
        """``model`` as a DeepSpeed engine (AdamW, ZeRO grpo.zero_stage) over this process group, every parameter
        trained."""
        import deepspeed

        model.requires_grad_(True)  # loaded for inference; the policy trains every parameter
        engine, *_ = deepspeed.initialize(
            model=model,
            config=ds_config(self.cfg, self.ranks.world, self.device != "cpu"),
            model_parameters=[p for p in model.parameters() if p.requires_grad],
        )
        return engine

    @property
    def n_train(self) -> int:
        return len(self.probs.train)

    def restore(self, records: list[dict[str, Any]]) -> int:
        """The newest DeepSpeed checkpoint (weights + optimizer); steps logged after it are redone."""
        if not (self.rd.ds_checkpoint / "latest").exists():
            return 0
        _, client = self.engine.load_checkpoint(str(self.rd.ds_checkpoint))
        self._stale = True
        start = int(client["step"])
        self.saved_at = start if self.rd.center_t() == start else -1  # the final center may be missing
        if start % self.grpo.iterations:  # inside a generated batch: continue on the stored one
            path = self._batch_file(start)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: the generated batch of the checkpoint after step {start} is missing")
            self._batch = torch.load(path, map_location=next(self.engine.module.parameters()).device)
        return start

    def _batch_file(self, t: int) -> Path:
        return Path(self.rd.ds_checkpoint) / f"step{t}" / f"grpo_batch_rank{self.ranks.rank}.pt"

    def step(self, t: int) -> dict[str, Any]:
        """One optimizer step on this rank's share of the batch (generated first when t % mu == 0); the record
        holds the whole batch's metrics, from every rank's sums (the same figures whatever the rank count)."""
        mu = self.grpo.iterations
        generated = self._batch is None or self._batch["index"] != t // mu
        if generated:
            self._batch = self._rollouts(t // mu)
        b = self._batch
        rewards, t_gen, w = b["rewards"], b["t_gen"], b["weight"]
        t1 = time.perf_counter()
        s = self._learn(b, first=generated)
        self._stale = True
        t_train = time.perf_counter() - t1
        self._checksum = self._weights_checksum()
        if "rollout" not in b:  # the engine/trainer mismatch of this batch, measured by its first step
            b["rollout"] = [s["logp_diff_sum"], s["logp_diff_max"], s["capped"], s["is_tokens"]]
        local = [
            *(w * x for x in (float(rewards.sum()), float(rewards.square().sum()), float(rewards.numel()))),
            *(s[k] for k in ("entropy_sum", "kl_sum", "clip_sum", "tokens", "loss", "gen_tokens", "flops")),
            self._checksum,
            *b["rollout"],
        ]
        share = self._group_success(b) if generated else None  # a collective: every rank or none
        m = self._gather(local)
        r_sum, r_sq, r_n, ent, kl, clip, n_tok, loss, gen_tok, flops = m[:, :10].sum(0).tolist()
        r_mean = r_sum / max(r_n, 1.0)
        r_var = (r_sq - r_n * r_mean**2) / max(r_n - 1.0, 1.0)  # unbiased, as torch.std, over the batch's rewards
        d_sum, d_max, capped, is_tok = m[:, 11].sum(), m[:, 12].max(), m[:, 13].sum(), m[:, 14].sum()
        grad_norm = self.engine.get_global_grad_norm()
        metrics = {
            "reward/mean": r_mean,
            "reward/std": max(r_var, 0.0) ** 0.5,
            "policy/entropy": ent / max(n_tok, 1.0),
            "policy/kl": kl / max(n_tok, 1.0),
            "policy/clip_fraction": clip / max(n_tok, 1.0),
            "loss": loss,  # the whole batch's loss: the ranks' shares summed
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens/per_s": gen_tok / max(t_gen, 1e-9),  # of the generation this batch came from
            "time/generation_s": t_gen if generated else 0.0,
            "time/weight_sync_s": b.get("t_sync", 0.0) if generated else 0.0,  # the policy into the vLLM engine
            "time/train_s": t_train,
            "update/flops": flops,  # App. G.2 accounting with this step's real token counts
            **{k: float(b[k]) for k in ("score/errors", "score/error_rate") if k in b},  # of the generated batch
            **self._drift(t),
        }
        if is_tok > 0:  # the engine's log-probs of the sampled tokens against the trainer's (rollout_correction)
            metrics["rollout/logp_diff_mean"] = float(d_sum / is_tok)
            metrics["rollout/logp_diff_max"] = float(d_max)
            metrics["rollout/capped_fraction"] = float(capped / is_tok)
        record = {"t": t, "metrics": metrics, "param_checksums": [float(c) for c in m[:, 10]]}
        if share is not None:
            record["diversity"] = {"p": [share], "batch": b["batch"], "samples": self.grpo.group_size}
            div = diversity_metrics([share])
            metrics.update({f"diversity/{k}": div[k] for k in ("js", "h_members", "p_mean")})
        return record

    def _drift(self, t: int) -> dict[str, float]:
        """{"update/rel_distance_from_theta0": ...} after step ``t`` on rank 0: every step from the CPU copy of
        theta_0, or (tracking.drift off) at checkpoint steps and the last one from the base model's files."""

        if not self.ranks.lead:
            return {}
        params = dict(self.engine.module.named_parameters())
        if self.theta0 is not None:
            return {"update/rel_distance_from_theta0": relative_distance(params, lambda n, _: self.theta0[n])}
        due = (t + 1) % self.cfg.checkpoint.every == 0 or t + 1 == self.total
        if not due:
            return {}
        m = self.cfg.model
        try:
            base = SafetensorsReader(weight_files(m.name, m.gguf_file, m.revision))
            # theta_0 as loaded: the base tensor rounded to the live dtype (the model was loaded in it), then fp32
            rel = relative_distance(params, lambda n, p: base.get(n).to(p.dtype))
        except (KeyError, FileNotFoundError) as e:  # a metric is not worth a failed run: say why it is missing
            print(f"warning: update/rel_distance_from_theta0 not logged after step {t}: {e}", file=sys.stderr)
            return {}
        return {"update/rel_distance_from_theta0": rel}

    def _group_success(self, b: dict[str, Any]) -> list[float]:
        """p(x) for the B prompts of the generated batch, in batch order, from every rank's share: prompt q of
        the batch is rank q mod W's (q // W)-th (_rollouts); a rank standing in with weight 0 reports nothing."""
        world, batch = self.ranks.world, b["batch"]
        width = -(-len(batch) // world)
        mine = b["correct"].float().mean(1).tolist() if b["weight"] else []
        local = mine + [float("nan")] * (width - len(mine))
        rows = self._gather(local).tolist() if world > 1 else [local]
        return [float(rows[q % world][q // world]) for q in range(len(batch))]

    def _sample(self, mine: list[int], t: int) -> tuple[list[Any], Any, Any]:
        """G responses per prompt with the current policy, their rewards [prompts, G], and whether the verifier
        scored each CORRECT [prompts, G] (bool)."""

        g, gc = self.grpo, self.cfg.generation
        sampling = SamplingParams(gc.temperature, gc.top_p, gc.max_new_tokens, n=g.group_size, logprobs=True)
        self.engine.module.eval()
        prompts = [self.probs.train_prompts[i] for i in mine]
        gens = self.gen.generate(prompts, sampling, _step_seed(self.cfg.run.seed, t, self.ranks.rank))
        owners = [i for i in mine for _ in range(g.group_size)]
        before = self.probs.errors.count
        verdicts = [self.probs.task.score(x.text, self.probs.train[i]) for i, x in zip(owners, gens)]
        self._score_errors = (self.probs.errors.count - before, len(verdicts))
        scores = [reward_of(v, self.cfg) for v in verdicts]
        correct = torch.tensor([v is Verdict.CORRECT for v in verdicts]).view(len(mine), g.group_size)
        return gens, torch.tensor(scores, dtype=torch.float32).view(len(mine), g.group_size), correct

    def _advantages(self, rewards: Any, weight: float) -> Any:
        """Group-relative advantages; "batch" scaling divides by the std of the batch's rewards on every rank
        (ranks hold different numbers of prompts when the batch splits unevenly; an idle rank's stand-in prompt,
        weight 0, is not in the batch)."""
        if self.grpo.scale_rewards != "batch":
            return group_advantages(rewards, scale=self.grpo.scale_rewards)
        everyone = rewards.reshape(-1).double()
        if self.ranks.world > 1:
            width = -(-self.grpo.batch_size // self.ranks.world) * self.grpo.group_size
            mine = torch.full((width,), float("nan"), dtype=torch.float64)
            if weight:
                mine[: everyone.numel()] = everyone
            parts = [torch.empty_like(mine) for _ in range(self.ranks.world)]
            dist.all_gather(parts, mine)
            everyone = torch.cat(parts)
            everyone = everyone[~everyone.isnan()]
        std = everyone.std().to(rewards.dtype)
        return (rewards - rewards.mean(1, keepdim=True)) / (std + 1e-4)

    def _rollouts(self, index: int) -> dict[str, Any]:
        """Generate and score batch ``index`` (this rank's share), with everything its mu optimizer steps
        reuse: sequences, advantages, old log-probs (mu > 1) and reference log-probs (beta > 0)."""
        cfg, g = self.cfg, self.grpo
        n = len(self.probs.train)
        _, idx = batch_indices(cfg.run.seed, index, n, g.batch_size, schedule_start(n, cfg.run.data_before))
        mine = idx[self.ranks.rank :: self.ranks.world] or idx[:1]  # a short tail batch: idle ranks repeat a
        weight = 1.0 if idx[self.ranks.rank :: self.ranks.world] else 0.0  # prompt, with weight 0 in the loss
        t_sync = self._sync_policy()
        t0 = time.perf_counter()
        gens, rewards, correct = self._sample(mine, index)
        t_gen = time.perf_counter() - t0
        errors, scored = self._score_errors
        if self.ranks.world > 1:  # every rank stops or none
            errors, scored = (int(x) for x in self._gather([float(errors), float(scored)]).sum(0).tolist())
        scoring = check_scoring(cfg, self.probs, errors, scored)
        b = self._prepare(mine, gens, self._advantages(rewards, weight), weight)
        return {
            **b,
            **{"index": index, "rewards": rewards, "t_gen": t_gen, "t_sync": t_sync, "correct": correct, "batch": idx},
            **scoring,
        }

    def _sync_policy(self) -> float:
        """Load the policy into the generator if an optimizer step (or a checkpoint) moved it since the last
        load; the seconds it took. A generator reading the module itself (hf) has nothing to load; a vLLM engine
        gets every trained tensor (all of them: GRPO trains every parameter), gathered whole should ZeRO-3 ever
        partition them (grpo.zero_stage is 0-2: every rank holds them whole, and loads its own engine)."""
        if not self._stale:
            return 0.0
        import deepspeed

        t0 = time.perf_counter()
        params = [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters([p for _, p in params]):  # a no-op at ZeRO 0-2 (whole weights)
            self.gen.load_policy(params)
        self._stale = False
        return time.perf_counter() - t0

    def _prepare(self, mine: list[int], gens: list[Any], adv: Any, weight: float) -> dict[str, Any]:
        """The tensors the optimizer steps on one generated batch reuse, the whole batch's valid tokens and
        responses (summed over ranks: one all-reduce; an idle rank's stand-in counts 0), and the batch's FLOPs."""
        g = self.grpo
        ids, attn, mask, n_prompt = self._sequences(mine, gens)
        self.engine.module.train()  # the mode of the training forward, so the first inner step has ratio 1
        old = self._logprobs(self.engine.module, ids, attn) if g.iterations > 1 else None
        ref = self._logprobs(self.ref, ids, attn) if g.beta > 0 else None
        n_tok, n_seq = float(mask.sum()), ids.shape[0]
        counts = torch.tensor([n_tok * weight, n_seq * weight], dtype=torch.float64)
        if self.ranks.world > 1:
            dist.all_reduce(counts)
        prompt_len, gen_len = max(n_prompt / n_seq, 1.0), max(n_tok / n_seq, 1.0)
        P, mu = self.gen.num_parameters(), g.iterations
        flops = grpo_flops(P, g.group_size, len(mine), prompt_len, gen_len, beta=g.beta, iterations=mu)
        return {
            "weight": weight,
            "adv": adv.reshape(-1).to(ids.device),
            "ids": ids,
            "attn": attn,
            "mask": mask,
            "old_logp": old,
            "ref_logp": ref,
            "engine_logp": self._engine_logprobs(gens, mask),
            "n_tokens": float(counts[0]),
            "n_seqs": float(counts[1]),
            "flops": flops,
        }

    def _engine_logprobs(self, gens: list[Any], mask: Any) -> Any:
        """The generator's log-probs of the sampled tokens (Generation.logprobs) at the loss mask's positions
        [B, T], or None when it gave none (rollout_correction: tis then refuses to train)."""
        if any(x.logprobs is None for x in gens):
            if self.grpo.rollout_correction != "none":
                raise RuntimeError(
                    f"grpo.rollout_correction: {self.grpo.rollout_correction} needs each sampled token's log-prob "
                    f"from the generator, and backend {self.cfg.backend.name!r} returned none; set "
                    "grpo.rollout_correction: none (valid: none, tis)"
                )
            return None
        out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        for j, x in enumerate(gens):
            pos = mask[j].nonzero().flatten()  # the response tokens' predicting positions, in order
            if len(pos) != len(x.logprobs):
                raise RuntimeError(f"response {j}: {len(x.logprobs)} log-probs for {len(pos)} sampled tokens")
            out[j, pos] = torch.tensor(x.logprobs, dtype=torch.float32, device=mask.device)
        return out

    def _slices(self, n: int) -> list[slice]:
        """This rank's n sequences in micro-batches of ``grpo.micro_batch_size`` (the last may be short)."""
        size = self.grpo.micro_batch_size or n
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def _logits(self, model: Any, ids: Any, attn: Any, sl: slice) -> tuple[Any, int]:
        """fp32 logits [n, width - 1, V] of sequences ``sl``, cut to their longest (right padding: causal
        attention makes the cut exact), and that width."""
        width = int(attn[sl].sum(1).max())
        out = model(input_ids=ids[sl, :width], attention_mask=attn[sl, :width])
        return out.logits[:, :-1].float(), width

    def _logprobs(self, model: Any, ids: Any, attn: Any) -> Any:
        """Token log-probs [B, T] of ``model`` without gradient, micro-batch by micro-batch (zeros past each
        micro-batch's width, where the loss mask is 0)."""

        temp = self.cfg.generation.temperature or 1.0
        out = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=ids.device)
        with torch.no_grad():
            for sl in self._slices(ids.shape[0]):
                logits, width = self._logits(model, ids, attn, sl)
                out[sl, : width - 1] = token_logprobs(logits, ids[sl, 1:width], temp)
                del logits
        return out

    def _learn(self, b: dict[str, Any], first: bool = True) -> dict[str, float]:
        """One optimizer step on the stored batch ``b``: forward/backward of the clipped surrogate micro-batch
        by micro-batch, gradients accumulated, then the DeepSpeed step. Each micro-batch's loss is its share of
        the whole batch's loss (the batch's token and response counts over every rank, ``b``), times the rank
        count W: DeepSpeed divides the ranks' summed gradients by W, so the step takes the whole batch's gradient
        on any number of ranks, with any split and with idle ranks (weight 0).

        Returns this rank's sums (0 on an idle rank): entropy_sum, kl_sum, clip_sum over its valid ``tokens``,
        its share of the batch ``loss``, ``gen_tokens`` (what it generated), FLOPs: this step's share of the
        batch's (App. G.2; the ``first`` step of a batch also carries its generation, old and reference forwards,
        so the mu steps of a batch sum to grpo_flops(..., iterations=mu)["total"]); and the rollout mismatch
        (sum and max of |engine - trainer log-prob|, tokens whose importance ratio exceeded the cap, tokens)."""

        g, temp = self.grpo, self.cfg.generation.temperature or 1.0
        ids, attn, mask, adv, weight = b["ids"], b["attn"], b["mask"], b["adv"], b["weight"]
        parts = self._slices(ids.shape[0])
        world = self.ranks.world
        # the whole batch's denominators (core.aggregate); one process in one pass: the unbatched computation
        whole = len(parts) == 1 and world == 1
        norm = {"max_len": self.cfg.generation.max_new_tokens}
        if not whole:
            norm.update(n_tokens=b["n_tokens"], n_seqs=b["n_seqs"])
        engine_logp = b.get("engine_logp")
        self.engine.module.train()
        sums = dict.fromkeys(("entropy_sum", "kl_sum", "clip_sum", "loss", "logp_diff_sum", "capped", "is_tokens"), 0.0)
        d_max = 0.0
        for k in range(micro_batches(self.cfg, world)):
            pad = k >= len(parts)  # a rank with fewer sequences than the largest share: a zero-weight pass
            sl = parts[-1] if pad else parts[k]
            logits, width = self._logits(self.engine, ids, attn, sl)
            m = mask[sl, : width - 1]
            logp = token_logprobs(logits, ids[sl, 1:width], temp)
            old = logp.detach() if b["old_logp"] is None else b["old_logp"][sl, : width - 1]
            ref = None if b["ref_logp"] is None else b["ref_logp"][sl, : width - 1]
            is_weight, mismatch = None, None
            if engine_logp is not None:  # pi_trainer(old) / pi_engine per token, truncated at the cap
                is_weight, mismatch = rollout_is_weights(old, engine_logp[sl, : width - 1], m, g.rollout_correction_cap)
                if g.rollout_correction == "none":
                    is_weight = None
            loss, stats = grpo_loss(
                logp,
                old,
                adv[sl],
                m,
                eps_low=g.epsilon,
                eps_high=g.epsilon_high,
                beta=g.beta,
                ref_logp=ref,
                aggregation=g.loss_aggregation,
                kl_estimator=g.kl_estimator,
                is_weight=is_weight,
                **norm,
            )
            self.engine.backward(loss * (0.0 if pad else weight * world), scale_wrt_gas=False)
            self.engine.step()  # DeepSpeed steps the optimizer at the last micro-batch only
            if pad or not weight:
                continue
            with torch.no_grad():
                n = float(m.sum())
                sums["entropy_sum"] += float((token_entropy(logits.detach(), temp) * m).sum())
                sums["loss"] += float(loss.detach())
                sums["kl_sum"] += stats["kl"] * n
                sums["clip_sum"] += stats["clip_fraction"] * n
                if mismatch is not None:
                    sums["logp_diff_sum"] += float(mismatch["abs_diff"])
                    sums["capped"] += float(mismatch["capped"])
                    sums["is_tokens"] += float(mismatch["tokens"])
                    d_max = max(d_max, float(mismatch["max_abs_diff"]))
            del logits, logp, loss
        f, mu = b["flops"], g.iterations
        per_step = (f["train_fwd_bwd"] + f["optimizer"]) / mu
        flops = f["total"] - (mu - 1) * per_step if first else per_step
        return {
            **sums,
            "logp_diff_max": d_max,
            "tokens": float(mask.sum()) * weight,
            "gen_tokens": float(mask.sum()),
            "flops": flops * weight,
        }

    def _sequences(self, mine: list[int], gens: list[Any]) -> tuple[Any, Any, Any, float]:
        """prompt + sampled tokens, right-padded, the attention mask, the loss mask over sampled tokens
        (shifted to the predicted positions), and the prompt tokens (repeated per response)."""

        tok, G = self.tok, self.grpo.group_size
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
        mine = torch.tensor(local, dtype=torch.float64)
        parts = [torch.zeros_like(mine) for _ in range(self.ranks.world)]
        dist.all_gather(parts, mine)
        return torch.stack(parts)

    def _weights_checksum(self) -> float:
        return checksum(dict(self.engine.module.named_parameters()))

    def checksum(self) -> float | None:
        return self._checksum if self._checksum is not None else self._weights_checksum()

    def save(self, t: int, final: bool) -> None:
        self.engine.save_checkpoint(str(self.rd.ds_checkpoint), tag=f"step{t}", client_state={"step": t})
        if t % self.grpo.iterations and self._batch is not None:  # resuming here reuses this batch
            torch.save(self._batch, self._batch_file(t))
        dist.barrier()  # every rank's part of step t is on disk (and `latest` names it) before older steps go
        if self.ranks.lead:
            drop_older_checkpoints(Path(self.rd.ds_checkpoint), f"step{t}")
        if final and self.ranks.lead:  # the policy in the same format as an ES center: evaluable, hand-over-able
            self.rd.save_center(self.policy_state(), t)

    def policy_state(self) -> dict[str, Any]:
        return {n: p.detach().float().cpu().contiguous() for n, p in self.engine.module.named_parameters()}

    def center_state(self) -> dict[str, Any]:  # checkpoint.snapshots: the policy as an evaluable center
        return self.policy_state()

    def generator(self) -> Any:  # eval.tasks: sampling from the policy as it stands
        self.engine.module.eval()
        self._sync_policy()
        return self.gen

    def evaluate(self) -> dict[str, float | str]:
        self.engine.module.eval()
        self._sync_policy()
        return evaluate_heldout(self.cfg, self.gen, self.probs)

    def postfix(self, metrics: dict[str, Any]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}", "H": f"{metrics['policy/entropy']:.2f}"}

    def export(self, path: Path) -> None:
        self.engine.module.save_pretrained(path)
        self.tok.save_pretrained(path)

    def tags(self) -> dict[str, str]:
        return self.probs.task.tracking_tags()

    def close(self) -> None:
        if hasattr(self, "gen"):  # a vLLM engine's processes stop now, not at interpreter exit
            self.gen.close()
