"""ES weight moves inside each vLLM worker process: ``LLM(worker_extension_cls=...)`` + ``collective_rpc``.

The same code as the HF backend (esbatch/perturb/centered.py), on views of vLLM's own tensors named
by their HF names (esbatch/backends/layout.py): perturb = copy(master + scale * eps), restore =
copy(master), update = es_update on the fp32 master then copy. So one seed gives the same weights in
both backends and the center is restored bit for bit.

Every rpc method returns a dict and never raises: an exception inside an rpc kills the vLLM engine, so
errors travel back as {"error": traceback} and the driver raises them (esbatch/backends/vllm.py). The driver calls
them through one table (esbatch/backends/vllm_rpc.py:WorkerCall), checked against ESWorkerExtension at the end of
this module, when it loads.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from esbatch.backends.base import PerturbedMember
from esbatch.backends.layout import hf_rows, hf_views
from esbatch.backends.vllm_lowrank import EngineLowRank
from esbatch.backends.vllm_rpc import Packed, check_worker, pack, unpack
from esbatch.perturb import weights_for
from esbatch.perturb.inplace import coordinate_sample
from esbatch.perturb.lowrank import LowRankWeights
from esbatch.perturb.update import UpdateSpec


def keep_cpu_linear_weights() -> None:
    """vLLM on CPU moves each linear weight into an opaque oneDNN handle after loading and leaves a
    0-element parameter behind, so in-place perturbation would change nothing. Replace that dispatch
    with one that keeps the weight and calls F.linear on it (identical fp32 outputs, ~7-40% slower).
    Must run before the model loads: at import of this module, which vLLM does when building a worker.
    """
    try:
        from vllm.model_executor.layers import utils
    except ImportError:  # not inside a vLLM install (unit tests of the arithmetic)
        return

    def dispatch(layer: Any, remove_weight: bool = False, **_: Any) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    utils.dispatch_cpu_unquantized_gemm = dispatch


keep_cpu_linear_weights()


def _safe(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - reported to the driver instead of killing the engine
            return {"error": traceback.format_exc()}

    return wrapper


class ESWorkerExtension:
    """Mixed into vLLM's worker class; ``self.model_runner.model`` is the live model."""

    @_safe
    def es_setup(
        self,
        hf_shapes: dict[str, list[int]],
        track_drift: bool,
        noise: str,
        master: str = "device",
        lowrank: dict[str, Any] | None = None,
        restore: str = "exact",
    ) -> dict[str, Any]:
        """``lowrank``: {"rank": r, "vectors": ...} for es.perturbation: lowrank (esbatch/backends/vllm_lowrank.py);
        ``restore``: es.restore (inplace: the engine's weights are moved in place, each engine its own round-off)."""

        params = dict(self.model_runner.model.named_parameters())
        empty = [n for n, p in params.items() if p.numel() == 0]
        if empty:
            raise RuntimeError(f"weights moved out of reach by vLLM (empty parameters): {empty[:3]}")
        shapes = {n: tuple(s) for n, s in hf_shapes.items()}
        views = hf_views(params, shapes)
        self.lowrank = None
        if lowrank is None:
            # es.noise: eps drawn on the engine's device; es.master: the fp32 center there, in host memory or on disk
            self.es = weights_for(views, restore, track_drift, noise, master)
        else:
            self.es = LowRankWeights(views, track_drift, noise, lowrank["rank"], lowrank["vectors"])
            self.lowrank = EngineLowRank(self.model_runner, self.es, hf_rows(params, shapes))
        some = next(iter(self.es.live.values()))
        return {"dtype": str(some.dtype), "device": str(some.device)}

    @_safe
    def es_lowrank_begin(self, members: Sequence[PerturbedMember]) -> dict[str, Any]:
        """Requests with extra_args {"es_member": k} run as member k (its direction seed and scale) until
        es_lowrank_end. The members arrive as plain sequences (vLLM's serialization) and are rebuilt here."""
        if self.es.perturbed:
            raise RuntimeError("es_lowrank_begin on perturbed weights: restore first")
        self.lowrank.begin([PerturbedMember(int(seed), float(scale), int(gen)) for seed, scale, gen in members])
        return {}

    @_safe
    def es_lowrank_end(self) -> dict[str, Any]:
        self.lowrank.end()
        return {}

    @_safe
    def es_perturb(self, seed: int, scale: float) -> dict[str, Any]:
        self.es.perturb(seed, scale)
        return {}

    @_safe
    def es_restore(self) -> dict[str, Any]:
        self.es.restore()
        return {}

    @_safe
    def es_update(self, spec: dict[str, Any]) -> dict[str, Any]:
        l2, changed = self.es.update(UpdateSpec.from_record(spec))
        return {"l2": l2, "changed": changed, "rel": self.es.rel_distance(), "checksum": self.es.checksum()}

    @_safe
    def es_checksum(self) -> dict[str, Any]:
        return {"checksum": self.es.checksum()}

    @_safe
    def es_cycles(self, members: list[tuple[int, float]]) -> dict[str, Any]:
        """Perturb and restore each (seed, scale) in turn, generating nothing (replay of es.restore: inplace)."""
        for seed, scale in members:
            self.es.perturb(int(seed), float(scale))
            self.es.restore()
        return {}

    @_safe
    def es_sample(self, per_tensor: int, names: list[str] | None = None) -> dict[str, Any]:
        """The weights (``names`` only, if given) at the coordinates every engine samples
        (esbatch/perturb/inplace.py:coordinate_sample)."""
        live = self.es.live
        if names is not None:
            if unknown := sorted(set(names) - set(live)):
                raise KeyError(f"es_sample: no engine weight has the HF name(s) {unknown[:5]}")
            live = {n: live[n] for n in names}
        dtype, shape, data = pack(coordinate_sample(live, per_tensor))
        return {"sample": (dtype, shape, bytes(data))}

    @_safe
    def es_save(self, path: str, which: str = "center") -> dict[str, Any]:
        """Write the center (fp32; es.restore: inplace: the compute-dtype weights) or the live weights as fp32, with
        HF names, to a safetensors file."""
        from safetensors.torch import save_file

        if which == "center":
            src = self.es.master if self.es.master is not None else self.es.state_dict()
        else:
            src = self.es.live
        dtype = None if which == "center" and self.es.master is None else torch.float32  # inplace: compute dtype
        save_file({n: t.detach().to("cpu", dtype or t.dtype).contiguous() for n, t in src.items()}, path)
        return {}

    @_safe
    def es_load(self, path: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        self.es.load(load_file(path))
        return {}

    @_safe
    def es_memory(self) -> dict[str, Any]:
        return self.es.memory_report()

    @_safe
    def es_entropy_begin(self) -> dict[str, Any]:
        """Hook the sampler (once) to record the token entropies of requests tagged extra_args {TAG: key}
        (esbatch/backends/vllm_entropy.py); independent of the weight setup (ES or GRPO engines alike)."""
        from esbatch.backends.vllm_entropy import EngineEntropy

        if getattr(self, "entropy_meter", None) is None:
            self.entropy_meter = EngineEntropy(self.model_runner)
        return {}

    @_safe
    def es_entropy_take(self) -> dict[str, Any]:
        """The recorded lists, {"entropy": {key: [H per token]}, ...}, cleared; whether this engine schedules
        ahead (async: a finished request may have sampled one step past its end)."""
        if getattr(self, "entropy_meter", None) is None:
            raise RuntimeError("es_entropy_take before es_entropy_begin: no request was measured")
        ahead = bool(getattr(self.model_runner, "use_async_scheduling", False))
        return {**self.entropy_meter.take(), "async": ahead}

    @_safe
    def es_policy_setup(self, hf_shapes: dict[str, list[int]]) -> dict[str, Any]:
        """GRPO rollouts (esbatch/backends/vllm_policy.py): HF-named views of the engine's weights and nothing
        else (no fp32 center, no theta_0: the trainer holds the policy); ``es_set_weights`` copies into them."""
        params = dict(self.model_runner.model.named_parameters())
        if empty := [n for n, p in params.items() if p.numel() == 0]:
            raise RuntimeError(f"weights moved out of reach by vLLM (empty parameters): {empty[:3]}")
        views = hf_views(params, {n: tuple(s) for n, s in hf_shapes.items()})
        self.es, self.lowrank = weights_for(views, "inplace", track_drift=False), None  # live weights only
        some = next(iter(views.values()))
        return {"dtype": str(some.dtype).removeprefix("torch."), "device": str(some.device)}

    @_safe
    def es_set_weights(self, weights: dict[str, Packed | torch.Tensor]) -> dict[str, Any]:
        """Copy HF-named tensors (the trainer's new weights: packed into the RPC, vllm_rpc.py:pack, or the tensors
        themselves from a trainer in this process) into the engine's weights; any subset of them (the changed
        ones). Only after es_policy_setup (no ES center)."""
        if self.es.master is not None:
            raise RuntimeError("es_set_weights on an engine holding an ES center: set it up with es_policy_setup")
        live = self.es.live
        weights = {n: p if isinstance(p, torch.Tensor) else unpack(p) for n, p in weights.items()}
        if unknown := sorted(set(weights) - set(live)):
            raise KeyError(f"es_set_weights: no engine weight has the HF name(s) {unknown[:5]}")
        if bad := [n for n, t in weights.items() if t.shape != live[n].shape]:
            raise ValueError(
                f"es_set_weights: {bad[0]} is {tuple(weights[bad[0]].shape)}, the engine's {tuple(live[bad[0]].shape)}"
            )
        with torch.no_grad():
            for name, t in weights.items():
                live[name].copy_(t)
        return {"tensors": len(weights), "elements": sum(t.numel() for t in weights.values())}


check_worker(ESWorkerExtension)  # every driver call names a method here, with its arguments
