"""ES weight moves inside each vLLM worker process: ``LLM(worker_extension_cls=...)`` + ``collective_rpc``.

The same arithmetic as the HF backend, on views of vLLM's own tensors named by their HF names
(esbatch/backends/layout.py): perturb = copy(master + scale * eps), restore = copy(master), update =
es_update on the fp32 master then copy. So one seed gives the same weights in both backends and the
center is restored bit for bit.

Every rpc method returns a dict and never raises: an exception inside an rpc kills the vLLM engine, so
errors travel back as {"error": traceback} and the driver raises them (esbatch/backends/vllm.py).
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch


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
    def es_setup(self, hf_shapes: dict[str, list[int]], track_drift: bool) -> dict[str, Any]:
        from esbatch.backends.layout import hf_views

        model = self.model_runner.model
        params = {n: p for n, p in model.named_parameters()}
        empty = [n for n, p in params.items() if p.numel() == 0]
        if empty:
            raise RuntimeError(f"weights moved out of reach by vLLM (empty parameters): {empty[:3]}")
        self.es_views = hf_views(params, {n: tuple(s) for n, s in hf_shapes.items()})
        self.es_master = {n: v.detach().to(torch.float32, copy=True) for n, v in self.es_views.items()}
        self.es_theta0 = {n: t.clone() for n, t in self.es_master.items()} if track_drift else None
        self.es_perturbed = False
        dtype = next(iter(self.es_views.values())).dtype
        return {"dtype": str(dtype), "device": str(next(iter(self.es_views.values())).device)}

    @_safe
    @torch.no_grad()
    def es_perturb(self, seed: int, scale: float) -> dict[str, Any]:
        from esbatch.es.noise import direction

        if self.es_perturbed:
            raise RuntimeError("es_perturb on perturbed weights; restore first")
        self.es_perturbed = True
        for name, v in self.es_views.items():
            v.copy_(direction(seed, name, v.shape).to(v.device).mul_(scale).add_(self.es_master[name]))
        return {}

    @_safe
    @torch.no_grad()
    def es_restore(self) -> dict[str, Any]:
        for name, v in self.es_views.items():
            v.copy_(self.es_master[name])
        self.es_perturbed = False
        return {}

    @_safe
    @torch.no_grad()
    def es_update(self, seeds: Sequence[int], weights: Sequence[float], alpha: float, n: int) -> dict[str, Any]:
        from esbatch.backends.hf import _norm, center_checksum
        from esbatch.es.core import es_update

        if self.es_perturbed:
            raise RuntimeError("es_update on perturbed weights; restore first")
        l2 = es_update(self.es_master, seeds, weights, alpha, n)
        changed = total = 0
        for name, v in self.es_views.items():
            new = self.es_master[name].to(v.dtype)
            changed += int((new != v).sum())
            total += v.numel()
            v.copy_(new)
        rel = None
        if self.es_theta0 is not None:
            rel = _norm(self.es_master[k] - t for k, t in self.es_theta0.items()) / _norm(self.es_theta0.values())
        return {"l2": l2, "changed": changed / total, "rel": rel, "checksum": center_checksum(self.es_master)}

    @_safe
    def es_checksum(self) -> dict[str, Any]:
        from esbatch.backends.hf import center_checksum

        return {"checksum": center_checksum(self.es_master)}

    @_safe
    def es_save(self, path: str, which: str = "center") -> dict[str, Any]:
        """Write the fp32 center (or the live weights, as fp32) with HF names to a safetensors file."""
        from safetensors.torch import save_file

        src = self.es_master if which == "center" else self.es_views
        save_file({n: t.detach().to("cpu", torch.float32).contiguous() for n, t in src.items()}, path)
        return {}

    @_safe
    @torch.no_grad()
    def es_load(self, path: str) -> dict[str, Any]:
        from safetensors.torch import load_file

        state = load_file(path)
        if diff := set(state) ^ set(self.es_master):
            raise KeyError(f"checkpoint and model disagree on parameters: {sorted(diff)[:5]}")
        for name, t in state.items():
            self.es_master[name].copy_(t)
            self.es_views[name].copy_(self.es_master[name])
        self.es_perturbed = False
        return {}

    @_safe
    def es_memory(self) -> dict[str, Any]:
        master = sum(t.numel() * 4 for t in self.es_master.values())
        model = sum(v.numel() * v.element_size() for v in self.es_views.values())
        return {"model_bytes": model, "master_bytes": master, "theta0_bytes": master if self.es_theta0 else 0}
