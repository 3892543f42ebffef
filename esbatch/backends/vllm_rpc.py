"""The vLLM driver's calls into its engines' workers, in one table: ``WorkerCall``.

Each entry names a method of the worker extension (esbatch/backends/vllm_worker.py:ESWorkerExtension) with its
arguments, in order, and their types. The driver (esbatch/backends/vllm.py) passes entries, never method names,
and ``WorkerCall.check_args`` refuses a call of the wrong arity before it reaches an engine. ``check_worker(cls)``
compares the table with a worker class (names, order, defaults, annotated types) and raises TypeError on any
difference: vllm_worker.py runs it on ESWorkerExtension when it loads (in the driver, before any engine starts,
and in every worker), and the driver on a backend.worker_extension subclass. This module imports neither vLLM
nor the worker (whose import patches vLLM), so the driver can import it eagerly.
"""

from __future__ import annotations

import inspect
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from esbatch.backends.base import PerturbedMember

# A tensor as it crosses collective_rpc: (dtype, shape, raw bytes). vLLM 0.32 sends a torch tensor among an RPC's
# arguments as ['float32', shape, index of a side buffer] and the EngineCore's untyped decoder drops that buffer,
# so tensors travel as bytes, which msgpack and pickle carry whole.
Packed = tuple[str, list[int], bytes]


def pack(t: torch.Tensor) -> Packed:
    """``t`` as (dtype, shape, bytes): one copy, into the RPC message."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return str(t.dtype).removeprefix("torch."), list(t.shape), memoryview(flat.numpy())


def unpack(p: Sequence[Any]) -> torch.Tensor:
    """The tensor of ``pack``, read-only, over the received bytes (no copy)."""
    dtype, shape, data = p
    with warnings.catch_warnings():  # the bytes object is immutable: the tensor is only read (copied from)
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(shape)


@dataclass(frozen=True)
class Call:
    """One worker method: its name, its arguments after ``self`` as (name, type), how many trailing ones have
    defaults, and whether it moves the engine's weights (cached attention states are stale afterwards)."""

    method: str
    params: tuple[tuple[str, Any], ...] = ()
    optional: int = 0
    moves_weights: bool = False


class WorkerCall(Enum):
    """Every call the driver makes into a worker (each returns a dict; {"error": traceback} when it failed)."""

    SETUP = Call(
        "es_setup",
        (
            ("hf_shapes", dict[str, list[int]]),
            ("track_drift", bool),
            ("noise", str),
            ("master", str),
            ("lowrank", dict[str, Any] | None),
            ("restore", str),
        ),
        optional=3,
    )
    LOWRANK_BEGIN = Call("es_lowrank_begin", (("members", Sequence[PerturbedMember]),))
    LOWRANK_END = Call("es_lowrank_end")
    PERTURB = Call("es_perturb", (("seed", int), ("scale", float)), moves_weights=True)
    RESTORE = Call("es_restore", moves_weights=True)
    UPDATE = Call("es_update", (("spec", dict[str, Any]),), moves_weights=True)
    CHECKSUM = Call("es_checksum")
    # es.restore: inplace: replay an update's perturb/restore cycles; the engine's weights at sampled coordinates
    CYCLES = Call("es_cycles", (("members", list[tuple[int, float]]),), moves_weights=True)
    SAMPLE = Call("es_sample", (("per_tensor", int), ("names", list[str] | None)), optional=1)
    SAVE = Call("es_save", (("path", str), ("which", str)), optional=1)
    LOAD = Call("es_load", (("path", str),), moves_weights=True)
    MEMORY = Call("es_memory")
    # token entropy of tagged requests (esbatch/backends/vllm_entropy.py): hook the sampler once, then take the
    # per-token lists after each generate call
    ENTROPY_BEGIN = Call("es_entropy_begin")
    ENTROPY_TAKE = Call("es_entropy_take")
    # GRPO rollouts (esbatch/backends/vllm_policy.py): views of the engine's weights without an ES center, and
    # the trainer's new weights copied in by HF name, the tensors passing through the RPC itself (no file)
    POLICY_SETUP = Call("es_policy_setup", (("hf_shapes", dict[str, list[int]]),))
    # the trainer's tensors, packed (an engine in its own process) or as they are (an engine in this process)
    SET_WEIGHTS = Call("es_set_weights", (("weights", dict[str, Packed | torch.Tensor]),), moves_weights=True)

    @property
    def method(self) -> str:
        return self.value.method

    @property
    def moves_weights(self) -> bool:
        return self.value.moves_weights

    def check_args(self, args: tuple[Any, ...]) -> None:
        """TypeError unless ``args`` fill the required arguments and no more than all of them."""
        params, optional = self.value.params, self.value.optional
        if not len(params) - optional <= len(args) <= len(params):
            names = ", ".join(n for n, _ in params) or "no arguments"
            raise TypeError(f"RPC {self.method} takes ({names}), got {len(args)} argument(s)")


def check_worker(cls: type) -> None:
    """TypeError unless every ``WorkerCall`` names a method of ``cls`` that takes exactly its arguments: the same
    names in the same order, positional, defaults on the last ``optional`` ones, and the table's types wherever
    the method annotates them (an override may leave them out)."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    for call in WorkerCall:
        spec = call.value
        fn = getattr(cls, spec.method, None)
        if not callable(fn):
            raise TypeError(f"{where} has no RPC method {spec.method} (esbatch/backends/vllm_rpc.py:{call.name})")
        fn = inspect.unwrap(fn)  # the method under its error-catching wrapper (vllm_worker.py:_safe)
        params = list(inspect.signature(fn).parameters.values())[1:]
        want = [n for n, _ in spec.params]
        got = [p.name for p in params]
        positional = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        defaults = [p.default is not p.empty for p in params]
        if got != want or not positional or defaults != [i >= len(want) - spec.optional for i in range(len(want))]:
            raise TypeError(
                f"{where}.{spec.method}{inspect.signature(fn)} does not match the RPC table "
                f"(esbatch/backends/vllm_rpc.py:{call.name}): arguments {want}, the last {spec.optional} optional"
            )
        hints = typing.get_type_hints(fn)
        for name, typ in spec.params:
            if name in hints and hints[name] != typ:
                raise TypeError(
                    f"{where}.{spec.method}: argument {name} is {hints[name]}, the RPC table says {typ} "
                    f"(esbatch/backends/vllm_rpc.py:{call.name})"
                )
