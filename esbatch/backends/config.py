"""The `backend:` section of a run config, and ``ESSetup``: what an ES backend is built from.

Light on purpose (no torch): validation reads it. The ES trainer assembles an ``ESSetup`` from the run config
(esbatch/es/config.py:backend_setup) and hands it to ``BACKENDS.get(name).for_es``.
"""

from __future__ import annotations

from dataclasses import dataclass

from esbatch.models import ModelConfig
from esbatch.schema import setting

WEIGHT_TRANSFERS = ("auto", "rpc", "ipc")  # backend.weight_transfer (weight_transfer_problem)


@dataclass
class BackendConfig:
    """The `backend:` section of a run config: which generation backend and its engine settings."""

    name: str = setting("hf", "Generation backend (`esbatch ls`): hf, or vllm (imported only when chosen).")
    engines: int = setting(
        1,
        "vllm: engines on this node; the population (evals: each call's prompts) is sharded over them (one GPU "
        "each on GPU nodes).",
        ge=1,
    )
    gpu_memory_utilization: float = setting(0.85, "vllm: fraction of each GPU an engine may use.", gt=0, le=1)
    kv_cache_gb: int = setting(2, "vllm on CPU: KV cache per engine, whole GiB (VLLM_CPU_KVCACHE_SPACE).", ge=1)
    max_model_len: int | None = setting(None, "vllm: context length to reserve KV cache for (default: the model's).")
    prefix_caching: bool = setting(True, "vllm: reuse shared prompt prefixes; reset after every weight change.")
    cuda_graphs: bool = setting(True, "vllm on GPU: capture CUDA graphs (false: eager mode; ignored on CPU).")
    policy_engine: str = setting(
        "in_process",
        "vllm GRPO: in_process (each rank's engine in its process, external_launcher over ranks; tensors copied "
        "in) or separate (own process; weight_transfer).",
        choices=("in_process", "separate"),
    )
    weight_transfer: str = setting(
        "auto",
        "vllm GRPO, policy_engine separate: rpc (bytes; CPU's only way), ipc (vLLM's CUDA IPC weight transfer; not "
        "run on a GPU yet) or auto (ipc on CUDA).",
        choices=WEIGHT_TRANSFERS,
    )
    worker_extension: str = setting(
        "esbatch.backends.vllm_worker:ESWorkerExtension",
        "vllm: the class mixed into each engine's worker (package.module:Class, subclassing the default), to "
        "instrument engines (the hang test).",
    )

    def validate(self, path: str, errors: list[str]) -> None:
        """backend.weight_transfer names a transport into an engine of its own process (weight_transfer_problem)."""
        why = weight_transfer_problem(self.weight_transfer, self.policy_engine, on_gpu=None)
        if why:
            errors.append(f"{path + '.' if path else ''}{why}")


def weight_transfer_problem(requested: str, policy_engine: str, on_gpu: bool | None) -> str | None:
    """Why backend.weight_transfer ``requested`` cannot serve a GRPO policy engine run as ``policy_engine``
    (in_process, separate) on this device (``on_gpu``; None: not known yet, as when a config is validated), as an
    error line naming the key, the reason and the valid values; None when it can. Checked when the config is
    validated (the policy_engine conflict) and again before the engine starts (CPU)."""
    if requested == "auto":
        return None
    if policy_engine == "in_process":
        return (
            f"weight_transfer: {requested} moves weights into an engine in its own process, but policy_engine: "
            "in_process hands the trainer's tensors to an engine in the rank's process; set policy_engine: separate "
            "or weight_transfer: auto. Valid: " + ", ".join(WEIGHT_TRANSFERS)
        )
    if requested == "ipc" and on_gpu is False:
        return (
            "weight_transfer: ipc needs CUDA (vLLM's ipc backend shares GPU memory through CUDA IPC handles), "
            "and this run has no GPU; on CPU the separate engine's weights go as bytes through collective_rpc. "
            "Valid on CPU: auto, rpc"
        )
    return None


def resolve_weight_transfer(requested: str, policy_engine: str, on_gpu: bool) -> str:
    """The transport a GRPO policy engine uses: in_process (its tensors handed over in the rank's process), rpc or
    ipc. Raises ValueError (the weight_transfer_problem line) when ``requested`` cannot serve."""
    why = weight_transfer_problem(requested, policy_engine, on_gpu)
    if why:
        raise ValueError(f"backend.{why}")
    if policy_engine == "in_process":
        return "in_process"
    if requested == "auto":
        return "ipc" if on_gpu else "rpc"
    return requested


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
