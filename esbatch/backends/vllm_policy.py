"""GRPO rollouts on vLLM: ``VLLMPolicy``, one engine next to each trainer rank, its weights following the policy.

Each GRPO rank generates its own share of a batch's prompts with its own seed (esbatch/grpo/trainer.py), so each
rank has its own engine: no prompts or tokens cross ranks, and as every rank holds the whole policy after an
optimizer step (ZeRO 0-2), each loads its own engine with no communication. On GPU the engine shares the rank's
GPU (backend.gpu_memory_utilization is its share: leave DeepSpeed room); on CPU it runs on the rank's share of
the cores. backend.engines is ES's (one engine per rank here).

The engine starts on the run's model files and keeps no ES state (es_policy_setup: HF-named views of its
weights, no fp32 center). ``load_policy`` copies the trainer's tensors in by HF name: cast to the engine's dtype,
they travel through vLLM's collective_rpc (msgpack to the EngineCore, the executor's message queue to the
worker) in buckets of at most ``bucket_mb``, and no file is written; the prefix cache is reset after each
bucket (WorkerCall.SET_WEIGHTS moves weights). Generation is VLLMBackend's: ES's per-prompt seeds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

import torch

from esbatch.backends.config import ESSetup
from esbatch.backends.vllm import VLLMBackend
from esbatch.backends.vllm_rpc import Packed, WorkerCall, pack
from esbatch.models import model_path


class VLLMPolicy(VLLMBackend):
    """One vLLM engine generating with the policy a GRPO rank trains (module docstring)."""

    def __init__(
        self, model_dir: str, *, local_rank: int = 0, local_world: int = 1, bucket_mb: int = 256, **options: Any
    ) -> None:
        """``local_rank`` of ``local_world`` ranks on this node: which GPU, or which share of the cores, the
        engine takes. ``options``: VLLMBackend's (its ``engines`` is 1)."""
        self.local_rank, self.local_world = local_rank, local_world
        self.bucket_bytes = bucket_mb << 20
        super().__init__(model_dir, **{**options, "engines": 1})

    def _setup_workers(self, track_drift: bool, noise: str, master: str) -> None:
        (res,) = self._rpc_all(WorkerCall.POLICY_SETUP, self.hf_shapes)
        self.engine_dtype = getattr(torch, res["dtype"])

    def _engine_envs(self, engines: int, on_gpu: bool, kv_cache_gb: int) -> list[dict[str, str]]:
        """This rank's engine environment: VLLMBackend's for engine ``local_rank`` of ``local_world``."""
        return super()._engine_envs(self.local_world, on_gpu, kv_cache_gb)[self.local_rank : self.local_rank + 1]

    @classmethod
    def for_policy(cls, module: Any, tokenizer: Any, setup: ESSetup) -> VLLMPolicy:
        """The engine of this rank (LOCAL_RANK of LOCAL_WORLD_SIZE), loaded with ``module``'s weights (the run's
        model with model.init_weights, e.g. an earlier pipeline stage's)."""
        m = setup.model
        if setup.backend.engines > 1:
            print(
                f"note: GRPO runs one vLLM engine per rank; backend.engines: {setup.backend.engines} is ES's",
                file=sys.stderr,
            )
        path, rev = model_path(m.name, m.gguf_file, m.revision)
        local = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gen = cls(path, revision=rev, local_rank=local[0], local_world=local[1], **cls.es_options(setup))
        gen.load_policy(module.named_parameters())
        return gen

    def load_policy(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``params`` (HF name, tensor) into the engine, ``bucket_bytes`` at a time, without a file."""
        bucket: dict[str, Packed] = {}
        size = 0
        with torch.no_grad():
            for name, p in params:
                t = p.detach().to("cpu", self.engine_dtype)  # no copy for a CPU tensor in that dtype
                if bucket and size + t.nbytes > self.bucket_bytes:
                    self._rpc(0, WorkerCall.SET_WEIGHTS, bucket)
                    bucket, size = {}, 0
                bucket[name] = pack(t)
                size += t.nbytes
            if bucket:
                self._rpc(0, WorkerCall.SET_WEIGHTS, bucket)
