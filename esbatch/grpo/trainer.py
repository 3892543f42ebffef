"""GRPO on DeepSpeed (paper Section 2.2), readable top to bottom.

Per step t (every rank, data-parallel):  take this rank's share of the step's B prompts -> generate G
responses per prompt with the current policy -> score them with the task verifier -> group-relative
advantages (all ranks' rewards gathered, so batch statistics are global) -> one forward/backward of the
clipped token-level surrogate (+ beta * k3 KL to a frozen reference when beta > 0) -> DeepSpeed step
(ZeRO, AdamW, gradient clipping) -> rank 0 logs the step.

Generation uses the DeepSpeed module itself (HF ``generate`` on ``engine.module``): with ZeRO stages 0-2
every rank holds the full updated weights after ``engine.step()``, so the generator is in sync by
construction. One inner iteration per batch (old log-probs = the sampling policy's, detached), as TRL's
default ``num_iterations=1``. Launch with ``torchrun --nproc_per_node=N -m esbatch train CONFIG`` (gloo
on CPU, NCCL on GPU); ``esbatch train`` does that itself when ``run.nproc_per_node > 1``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path
from typing import Any

from esbatch.config import TrainConfig, flatten
from esbatch.es.checkpoint import RunDir
from esbatch.es.schedule import batch_indices
from esbatch.es.trainer import STOP


def init_distributed(device: str) -> tuple[int, int]:
    """(rank, world size). A single process without a launcher gets the env DeepSpeed expects."""
    import deepspeed
    import torch.distributed as dist

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), dist.get_world_size()


def ds_config(cfg: TrainConfig, world: int, on_gpu: bool) -> dict[str, Any]:
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


def checksum(model: Any) -> float:
    """A cheap fingerprint of the weights, compared across ranks."""
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum() * (i + 1) for i, p in enumerate(model.parameters())))


def grpo_step(cfg: TrainConfig, engine: Any, ref: Any, gen: Any, probs: Any, t: int, rank: int, world: int) -> dict:
    """One GRPO step on this rank's share of the batch; returns metrics averaged over ranks."""
    import torch
    import torch.distributed as dist

    from esbatch.backends.base import SamplingParams
    from esbatch.es.trainer import reward_of
    from esbatch.grpo.core import group_advantages, grpo_loss, token_entropy, token_logprobs

    g, gen_cfg = cfg.grpo, cfg.generation
    _, idx = batch_indices(cfg.run.seed, t, len(probs.train), g.batch_size)
    mine = idx[rank::world] or idx[:1]  # a short tail batch: idle ranks repeat a prompt (weight 0 below)
    weight = 1.0 if idx[rank::world] else 0.0
    t0 = time.perf_counter()
    sampling = SamplingParams(gen_cfg.temperature, gen_cfg.top_p, gen_cfg.max_new_tokens, n=g.group_size)
    engine.module.eval()
    gens = gen.generate([probs.train_prompts[i] for i in mine], sampling, _step_seed(cfg.run.seed, t, rank))
    t_gen = time.perf_counter() - t0
    rewards = torch.tensor(
        [
            reward_of(probs.task.score(x.text, probs.train[i]), cfg)
            for i, x in zip([i for i in mine for _ in range(g.group_size)], gens)
        ],
        dtype=torch.float32,
    ).view(len(mine), g.group_size)

    # group-relative advantages; "batch" scaling needs every rank's rewards
    everyone = [torch.zeros_like(rewards) for _ in range(world)]
    dist.all_gather(everyone, rewards)
    if g.scale_rewards == "batch":
        all_r = torch.cat(everyone)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (all_r.std() + 1e-4)
    else:
        adv = group_advantages(rewards, scale=g.scale_rewards)

    # sequences = prompt + sampled tokens, right-padded; the loss covers the sampled tokens only
    tok = gen.tok
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompt_ids = tok([probs.train_prompts[i] for i in mine], add_special_tokens=False)["input_ids"]  # once each
    seqs, resp = [], []
    for j, x in enumerate(gens):
        p_ids = prompt_ids[j // g.group_size]
        seqs.append(p_ids + list(x.token_ids))
        resp.append([0] * len(p_ids) + [1] * len(x.token_ids))
    L = max(len(s) for s in seqs)
    device = next(engine.module.parameters()).device
    ids = torch.tensor([s + [pad] * (L - len(s)) for s in seqs], device=device)
    attn = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs], device=device)
    mask = torch.tensor([r + [0] * (L - len(r)) for r in resp], device=device)[:, 1:].float()

    engine.module.train()
    t1 = time.perf_counter()
    logits = engine(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    temp = gen_cfg.temperature or 1.0
    logp = token_logprobs(logits, ids[:, 1:], temp)
    ref_logp = None
    if g.beta > 0:
        with torch.no_grad():
            ref_logp = token_logprobs(ref(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), ids[:, 1:], temp)
    loss, stats = grpo_loss(
        logp,
        logp.detach(),
        adv.reshape(-1).to(device),
        mask,
        eps_low=g.epsilon,
        eps_high=g.epsilon_high,
        beta=g.beta,
        ref_logp=ref_logp,
        aggregation=g.loss_aggregation,
    )
    engine.backward(loss * weight)
    engine.step()
    t_train = time.perf_counter() - t1
    with torch.no_grad():
        ent = (token_entropy(logits.detach(), temp) * mask).sum() / mask.sum().clamp(min=1)

    n_tok = float(mask.sum())
    from esbatch.grpo.flops import grpo_flops

    n_prompt = sum(len(s) for s in seqs) - n_tok  # tokens of the prompts, repeated per response
    flops = (
        grpo_flops(
            gen.num_parameters(),
            g.group_size,
            len(mine),
            max(n_prompt / len(seqs), 1.0),
            max(n_tok / len(seqs), 1.0),
            beta=g.beta,
        )["total"]
        * weight
    )
    local = torch.tensor(
        [
            float(rewards.mean()),
            float(rewards.std()),
            float(ent),
            float(stats["kl"]),
            float(stats["clip_fraction"]),
            float(loss.detach()),
            n_tok,
            checksum(engine.module),
            flops,
        ],
        dtype=torch.float64,
    )
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    m = torch.stack(gathered)
    grad_norm = engine.get_global_grad_norm()
    return {
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
        "flops/update": float(m[:, 8].sum()),  # App. G.2 accounting with this step's real token counts
        "_checksums": [float(c) for c in m[:, 7]],
    }


def train_grpo(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    run_name: str | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run GRPO into ``run_dir`` (rank 0 writes the folder and MLflow); returns a summary on rank 0."""
    import copy

    import deepspeed
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from esbatch.backends.hf import HFGenerator
    from esbatch.es.trainer import evaluate_heldout, load_problems, peak_rss_mb
    from esbatch.models import load_model_and_tokenizer, resolve_device
    from esbatch.tracking import MLflowTracker, default_tracking_uri, parent_tag, run_tags

    device = resolve_device(cfg.model.device)
    rank, world = init_distributed(device)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    rd = RunDir(run_dir)
    if rank == 0:
        if rd.exists() and not resume:
            raise FileExistsError(f"{rd.path} already holds a run; pick another run.name")
        rd.path.mkdir(parents=True, exist_ok=True)
        rd.config.write_text(cfg.to_yaml())
    dtype = "float32" if device == "cpu" else cfg.model.dtype
    model, tok = load_model_and_tokenizer(cfg.model.name, cfg.model.gguf_file, cfg.model.revision, dtype, device)
    if cfg.model.init_weights:  # an earlier pipeline stage's weights
        from safetensors.torch import load_file

        state = load_file(cfg.model.init_weights)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(state[name].to(p.dtype))
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.grpo.beta > 0 else None
    model.requires_grad_(True)  # loaded for inference; the policy trains every parameter
    engine, *_ = deepspeed.initialize(
        model=model,
        config=ds_config(cfg, world, device != "cpu"),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
    )
    gen = HFGenerator(engine.module, tok, batch_size=cfg.generation.batch_size)
    probs = load_problems(cfg, gen)
    total = cfg.total_updates(len(probs.train))
    start = 0
    if resume and (rd.path / "ds_checkpoint" / "latest").exists():
        _, client = engine.load_checkpoint(str(rd.path / "ds_checkpoint"))
        start = int(client["step"])

    tracker = None
    if rank == 0:
        uri = cfg.tracking.uri or default_tracking_uri(cfg.run.output_dir)
        tracker = MLflowTracker(uri, cfg.tracking.experiment, Path(cfg.run.output_dir) / "mlartifacts")
        meta = rd.read_meta()
        run_id = tracker.start(
            run_name or cfg.run.name,
            flatten(cfg.to_dict()),
            {
                **run_tags(),
                "algorithm": "grpo",
                "world_size": str(world),
                **parent_tag(cfg.tracking.parent_run_id),
                **(tags or {}),
            },
            run_id=meta.get("mlflow_run_id") if resume else None,
        )
        rd.write_meta(mlflow_run_id=run_id, tracking_uri=uri, total_updates=total, status="running")
    t_start = time.perf_counter()

    def heldout(t: int) -> None:  # rank 0 only; the others wait at the next collective
        if probs.heldout and rank == 0:
            engine.module.eval()
            scores = evaluate_heldout(cfg, gen, probs)
            rd.append_eval({"t": t, **scores})
            tracker.log_metrics(scores, step=t)

    if start == 0:
        heldout(0)
    bar = tqdm(total=total, initial=start, desc="GRPO", unit="step", disable=not progress or rank != 0)
    status = "FAILED"
    try:
        for t in range(start, total):
            if STOP.is_set():  # SIGTERM (see es/trainer.py): stop between steps
                raise KeyboardInterrupt
            m = grpo_step(cfg, engine, ref, gen, probs, t, rank, world)
            sums = m.pop("_checksums")
            if rank == 0:
                rd.append_update({"t": t, "metrics": m, "param_checksums": sums})
                tracker.log_metrics({**m, "memory/peak_rss_mb": peak_rss_mb()}, step=t + 1)
            if (t + 1) % cfg.checkpoint.every == 0 or t + 1 == total:
                engine.save_checkpoint(str(rd.path / "ds_checkpoint"), tag=f"step{t + 1}", client_state={"step": t + 1})
            if cfg.eval.every and (t + 1) % cfg.eval.every == 0 and t + 1 != total:
                heldout(t + 1)
            bar.set_postfix({"reward": f"{m['reward/mean']:.3f}", "H": f"{m['policy/entropy']:.2f}"})
            bar.update(1)
        heldout(total)
        if rank == 0:  # the policy in the same format as an ES center: evaluable and hand-over-able
            state = {n: p.detach().float().cpu().contiguous() for n, p in engine.module.named_parameters()}
            save_file(state, str(rd.center), metadata={"t": str(total)})
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):
        status = "KILLED"
        raise
    finally:
        bar.close()
        if rank == 0:
            rd.write_meta(status=status.lower())
            tracker.end(status)
        dist.barrier()
        dist.destroy_process_group()  # explicit teardown: gloo aborts at exit without it (measured 1 in 8)
    if rank != 0:
        return {}
    return {
        "run_dir": str(rd.path),
        "updates": total,
        "tracking_uri": uri,
        "mlflow_run_id": run_id,
        "experiment_id": tracker.experiment_id,
        "wall_s": time.perf_counter() - t_start,
        "heldout_first": (rd.evals() or [None])[0],
        "heldout_last": (rd.evals() or [None])[-1],
        "peak_rss_mb": peak_rss_mb(),
        "world_size": world,
    }
