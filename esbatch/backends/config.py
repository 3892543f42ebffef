"""The `backend:` section of a run config, and ``ESSetup``: what an ES backend is built from.

Light on purpose (no torch): validation reads it. The ES trainer assembles an ``ESSetup`` from the run config
(esbatch/es/config.py:backend_setup) and hands it to ``BACKENDS.get(name).for_es``.
"""

from __future__ import annotations

from dataclasses import dataclass

from esbatch.models import ModelConfig
from esbatch.schema import setting


@dataclass
class BackendConfig:
    """The `backend:` section of a run config: which generation backend and its engine settings."""

    name: str = setting("hf", "Generation backend (see `esbatch ls`): hf, or vllm (imported only when chosen).")
    engines: int = setting(
        1,
        "vllm: engines on this node; the population (evals: each call's prompts) is sharded over them (one GPU "
        "each on GPU nodes).",
        ge=1,
    )
    gpu_memory_utilization: float = setting(0.85, "vllm: fraction of each GPU an engine may use.", gt=0, le=1)
    kv_cache_gb: int = setting(2, "vllm on CPU: KV cache size per engine in whole GiB (VLLM_CPU_KVCACHE_SPACE).", ge=1)
    max_model_len: int | None = setting(None, "vllm: context length to reserve KV cache for (default: the model's).")
    prefix_caching: bool = setting(True, "vllm: reuse shared prompt prefixes; reset after every weight change.")
    cuda_graphs: bool = setting(True, "vllm on GPU: capture CUDA graphs (false = eager mode). Ignored on CPU.")
    policy_engine: str = setting(
        "in_process",
        "vllm, GRPO rollouts: in_process runs each rank's engine in the rank's own process (external_launcher over "
        "several ranks) and copies the policy's tensors in with no serialization; separate: in its own process, "
        "the tensors packed through collective_rpc.",
        choices=("in_process", "separate"),
    )
    worker_extension: str = setting(
        "esbatch.backends.vllm_worker:ESWorkerExtension",
        "vllm: the class mixed into each engine's worker that moves its weights (package.module:Class, a "
        "subclass of the default). Change it only to instrument engines, as the engine hang test does.",
    )


@dataclass(frozen=True)
class ESSetup:
    """Everything an ES backend is built from: the model and backend sections and the run settings that decide
    how the weights move (es.restore, es.noise, ...; their help is in the config reference)."""

    model: ModelConfig
    backend: BackendConfig
    batch_size: int = 64  # generation.batch_size: prompts per generate() call
    track_drift: bool = True  # tracking.drift
    seed: int = 0  # run.seed (vLLM engines' sampler seed)
    hang_timeout_s: float = 3600.0  # run.hang_timeout_s (the vLLM RPC backstop sits behind it)
    restore: str = "exact"  # es.restore
    noise: str = "philox-gauss"  # es.noise
    master: str = "device"  # es.master
    perturbation: str = "full"  # es.perturbation: picks the backend class (BACKENDS)
    rank: int = 1  # es.rank
    lowrank_vectors: str = "full"  # es.lowrank_vectors
    dispatch: str = "static"  # es.dispatch
