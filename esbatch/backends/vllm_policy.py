"""GRPO rollouts on vLLM: ``VLLMPolicy``, one engine next to each trainer rank, its weights following the policy.

Each GRPO rank generates its own share of a batch's prompts with its own seed (esbatch/grpo/trainer.py), so each
rank has its own engine: no prompts or tokens cross ranks, and as every rank holds the whole policy after an
optimizer step (ZeRO 0-2), each loads its own engine with no communication. On GPU the engine shares the rank's
GPU (backend.gpu_memory_utilization is its share: leave DeepSpeed room); on CPU it runs on the rank's share of
the cores. backend.engines is ES's (one engine per rank here).

Where the engine runs (backend.policy_engine): ``in_process`` (default), vLLM's engine core and worker inside the
rank's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0; with several ranks, vLLM's external_launcher on the ranks'
process group, each rank an independent engine, as TRL's colocate mode): ``load_policy`` hands the trainer's
tensors themselves to the worker, which copies them into its weights (CPU: one memory copy; GPU: device to
device). ``separate``: the engine in its own EngineCore process, its weights through backend.weight_transfer:
``rpc`` packs the tensors to bytes for collective_rpc (msgpack, then the executor's queue), the path ES engines
use and the only one on CPU; ``ipc`` (auto's choice on CUDA) hands the engine CUDA IPC handles of the trainer's
tensors through vLLM's weight-transfer API (esbatch/backends/weight_transfer.py; not run on a GPU yet).

The engine starts on the run's model files and keeps no ES state (es_policy_setup: HF-named views of its
weights, no fp32 center). A sync moves the weights in buckets of at most ``bucket_mb`` (one RPC each, never one
per tensor; the same buckets by either transport), each named to the watchdog (engine, bucket k of n, MB) so a hang
says where it stopped, and bounded by the RPC backstop; the prefix cache is reset after the load
(WorkerCall.SET_WEIGHTS moves weights; after vLLM's finish_weight_update for ipc); then the engine's values at sampled
coordinates of every loaded tensor are compared with the trainer's, and a difference stops the run
(StaleEngineError) instead of letting it train on rollouts of stale weights.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

from esbatch import deadlines as watchdog
from esbatch.backends import mempolicy
from esbatch.backends import weight_transfer as wt
from esbatch.backends.config import ESSetup, resolve_weight_transfer
from esbatch.backends.vllm import VLLMBackend
from esbatch.backends.vllm_rpc import WorkerCall, pack, unpack
from esbatch.models import model_path
from esbatch.perturb.inplace import coordinate_sample

CHECK_PER_TENSOR = 8  # sampled coordinates per tensor compared after every sync


class StaleEngineError(RuntimeError):
    """The engine's weights differ from the trainer's after a sync: its rollouts would come from stale weights."""


class VLLMPolicy(VLLMBackend):
    """One vLLM engine generating with the policy a GRPO rank trains (module docstring)."""

    weight_transfer = "rpc"  # how a separate engine gets its weights: rpc or ipc (module docstring)
    _ipc: wt.IPCSender | None = None

    def __init__(
        self,
        model_dir: str,
        *,
        local_rank: int = 0,
        local_world: int = 1,
        bucket_mb: int = 256,
        in_process: bool = True,
        weight_transfer: str = "rpc",
        **options: Any,
    ) -> None:
        """``local_rank`` of ``local_world`` ranks on this node: which GPU, or which share of the cores, the
        engine takes; ``in_process``: backend.policy_engine; ``weight_transfer``: rpc or ipc, a separate engine's
        transport (module docstring). ``options``: VLLMBackend's (its ``engines`` is 1)."""
        self.local_rank, self.local_world = local_rank, local_world
        self.bucket_bytes = bucket_mb << 20
        self.in_process = in_process
        if weight_transfer not in ("rpc", "ipc") or (weight_transfer == "ipc" and in_process):
            raise ValueError(f"weight_transfer: {weight_transfer!r}; valid for a separate engine: rpc, ipc")
        self.weight_transfer = weight_transfer
        self.last_sync: dict[str, float] = {}  # the last load_policy: seconds, bytes, buckets, checked coordinates
        super().__init__(model_dir, **{**options, "engines": 1})

    def _setup_workers(self, track_drift: bool, noise: str, master: str) -> None:
        (res,) = self._rpc_all(WorkerCall.POLICY_SETUP, self.hf_shapes)
        self.engine_dtype = getattr(torch, res["dtype"])
        if self.weight_transfer == "ipc":
            uuid = wt.gpu_uuid(torch.cuda.current_device())
            self._ipc = wt.IPCSender(self.engines[0], timeout_s=self._rpc_backstop_s, uuid=uuid)
            self._ipc.connect()

    def _engine_envs(self, engines: int, on_gpu: bool, kv_cache_gb: int) -> list[dict[str, str]]:
        """This rank's engine environment: VLLMBackend's for engine ``local_rank`` of ``local_world``; in process,
        vLLM's engine core in this process."""
        (env,) = super()._engine_envs(self.local_world, on_gpu, kv_cache_gb)[self.local_rank : self.local_rank + 1]
        if self.in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.weight_transfer == "ipc":
            env.update(wt.ENGINE_ENV)
        return [env]

    def _start_engines(self, vllm: Any, envs: list[dict[str, str]], options: dict[str, Any]) -> None:
        """In process under several ranks: vLLM's external_launcher, which takes the ranks' process group as its
        world instead of starting its own (each rank's engine generates on its own, tensor-parallel size 1).
        With weight_transfer ipc, the worker builds vLLM's IPC weight-transfer engine. In process, this thread keeps
        its NUMA memory policy (esbatch/backends/mempolicy.py)."""
        import torch.distributed as dist

        if self.weight_transfer == "ipc":
            options = {**options, **wt.ENGINE_OPTIONS}

        if self.in_process and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            options = {**options, "distributed_executor_backend": "external_launcher"}
        if not self.in_process:
            return super()._start_engines(vllm, envs, options)
        with mempolicy.kept():  # vLLM's CPU worker binds this thread's memory to one node (mempolicy.py)
            super()._start_engines(vllm, envs, options)

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
        in_process = setup.backend.policy_engine == "in_process"
        # before the engine starts: ipc on a machine without CUDA is the config's error, named
        transport = resolve_weight_transfer(
            setup.backend.weight_transfer, setup.backend.policy_engine, torch.cuda.is_available()
        )
        gen = cls(
            path,
            revision=rev,
            local_rank=local[0],
            local_world=local[1],
            in_process=in_process,
            weight_transfer="rpc" if in_process else transport,
            **cls.es_options(setup),
        )
        gen.load_policy(module.named_parameters())
        return gen

    def load_policy(self, params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``params`` (HF name, tensor) into the engine, ``bucket_bytes`` at a time, without a file, then check
        that the engine holds them (module docstring). Raises StaleEngineError when it does not."""
        t0 = time.perf_counter()
        ipc = not self.in_process and self.weight_transfer == "ipc"
        on_cpu = not (self.in_process or ipc) or not torch.cuda.is_available()
        device = "cpu" if on_cpu else torch.device("cuda", torch.cuda.current_device())
        with torch.no_grad():  # no copy for a tensor already in the engine's dtype and place (ipc: contiguous)
            tensors = [(name, p.detach().to(device, self.engine_dtype).contiguous()) for name, p in params]
        plan = wt.plan_buckets([t.nbytes for _, t in tensors], self.bucket_bytes)
        buckets = [[tensors[i] for i in idx] for idx in plan]
        sizes = [sum(t.nbytes for _, t in b) for b in buckets]
        if ipc:
            assert self._ipc is not None, "weight_transfer ipc: the engine's handshake (_setup_workers) never ran"
            self._ipc.send(buckets)  # vLLM's weight-transfer API, one update_weights per bucket
            if self.prefix_caching:
                with watchdog.waiting_on("vLLM engine 0: reset_prefix_cache after the weight sync (ipc)"):
                    self.engines[0].reset_prefix_cache()  # cached attention states belong to the old weights
        else:
            for k, (bucket, size) in enumerate(zip(buckets, sizes)):
                sent = {name: t if self.in_process else pack(t) for name, t in bucket}
                self._rpc(0, WorkerCall.SET_WEIGHTS, sent, note=wt.bucket_note(k, len(buckets), size))
        checked = self.check_policy(tensors)
        self.last_sync = {
            "seconds": time.perf_counter() - t0,
            "bytes": sum(sizes),
            "buckets": len(buckets),
            "checked": checked,
        }

    def check_policy(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Compare the engine's weights with ``tensors`` (HF name, the trainer's tensor in the engine's dtype) at
        CHECK_PER_TENSOR sampled coordinates of each; the number compared. StaleEngineError names the first
        tensors that differ."""
        if not tensors:
            return 0
        names = [n for n, _ in tensors]
        res = self._rpc(0, WorkerCall.SAMPLE, CHECK_PER_TENSOR, names, note=", checking the weight sync")
        engine = unpack(res["sample"]).to(torch.float64)
        ours = coordinate_sample(dict(tensors), CHECK_PER_TENSOR)
        if engine.shape != ours.shape or not torch.equal(engine, ours):
            where = "in process" if self.in_process else f"separate process, weight transfer {self.weight_transfer}"
            bad, at, numel = [], 0, {n: t.numel() for n, t in tensors}
            for name in sorted(names):  # coordinate_sample's order: names sorted, each its share
                k = min(CHECK_PER_TENSOR, numel[name])
                if engine.shape == ours.shape and not torch.equal(engine[at : at + k], ours[at : at + k]):
                    bad.append(name)
                at += k
            raise StaleEngineError(
                f"vLLM engine 0 (GRPO rollouts, {where}): after "
                f"the weight sync its weights differ from the trainer's at sampled coordinates of "
                f"{len(bad) or 'all'} of {len(names)} tensors (first: {', '.join(bad[:3]) or 'shape mismatch'}); "
                "its rollouts would come from stale weights, so the run stops here"
            )
        return int(ours.numel())

    def close(self) -> None:
        """Stop the engine. In process, vLLM's engine shutdown would also destroy torch.distributed's default process
        group (vllm/distributed/parallel_state.py:destroy_distributed_environment, meant for an EngineCore process
        of its own), which is the trainer's (DeepSpeed's): only vLLM's own groups go."""
        if not self.in_process:
            return super().close()
        import vllm.distributed.parallel_state as ps

        def vllm_groups_only() -> None:
            if ps._WORLD:
                ps._WORLD.destroy()
            ps._WORLD = None

        keep, ps.destroy_distributed_environment = ps.destroy_distributed_environment, vllm_groups_only
        try:
            super().close()
        finally:
            ps.destroy_distributed_environment = keep
