"""The GRPO policy's weights into a separate vLLM engine process through vLLM's weight-transfer API (backend ipc).

backend.weight_transfer (esbatch/backends/config.py) picks the transport into an engine of its own process
(backend.policy_engine: separate): ``rpc`` packs each bucket to bytes for collective_rpc (msgpack, then the
executor's queue; the only way on CPU), ``ipc`` uses vLLM's weight-transfer API
(vllm/distributed/weight_transfer/ipc_engine.py) and moves no weight bytes through an RPC at all.

Engine side: vLLM's own. The engine starts with ``weight_transfer_config={"backend": "ipc"}``, so its worker builds an
``IPCWeightTransferEngine`` after loading the model; the worker's methods ``init_weight_transfer_engine(init_info)``,
``start_weight_update()``, ``update_weights(update_info)`` and ``finish_weight_update()`` drive it. Each update
rebuilds the trainer's tensors from their CUDA IPC handles (``rebuild_cuda_tensor``) and hands them to the model's
``load_weights`` inside vLLM's layerwise reload, which copies the values back into the engine's own storage (so
the HF-named views the esbatch worker samples stay valid).

Trainer side: ``IPCSender`` speaks vLLM's ``VLLMWeightSyncClient`` protocol (the four calls above) over the engine's
``collective_rpc``, one bounded call each, and builds each bucket's ``update_info`` with the fields of vLLM's
``IPCWeightTransferUpdateInfo``, unpacked (one handle per tensor), as vLLM's ``IPCTrainerWeightTransferEngine``
does. It does not call that class's ``send_weights``: that sends the whole model in one ``update_weights`` (unpacked)
or cuts chunks itself into a staging buffer no tensor may exceed (packed). Driving the calls here keeps the
rpc path's buckets (``plan_buckets``: same names, dtypes, shapes, one ``update_weights`` per bucket, each bounded
and named to the watchdog) and copies nothing: a handle points at the trainer's tensor in the engine's dtype.
vLLM's layerwise reload keeps a layer's tensors until its last one arrives (perhaps in a later bucket), so they all
stay alive and unchanged until finish_weight_update returns.
The handles travel pickled in ``ipc_handles_pickled`` (a string, as vLLM's HTTP client sends them), which the
engine accepts with VLLM_ALLOW_INSECURE_SERIALIZATION=1, set in the engine's environment only: the pickle comes
from the trainer process that started the engine.

Why IPC and not NCCL: each rank's engine runs on the rank's own GPU; vLLM's nccl backend makes trainer and engine
two ranks of one NCCL group, which NCCL refuses on one device, while CUDA IPC is made for two processes on one
GPU. Not run on a GPU yet: scripts/gpu_check.py measures it (its sync row) on the first lent GPU.
"""

from __future__ import annotations

import base64
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from esbatch import deadlines as watchdog

ENGINE_OPTIONS = {"weight_transfer_config": {"backend": "ipc"}}  # vLLM LLM(...) option: the worker's engine
ENGINE_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the engine unpickles ipc_handles_pickled (docstring)
INIT_INFO = {"packed": False}  # IPCWeightTransferInitInfo: one handle per tensor, no staging buffer


class WeightSyncError(RuntimeError):
    """A call of a weight sync failed or passed its timeout; the message names the engine, the call and the
    bucket, and how long it ran."""


def plan_buckets(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Indices of tensors (``sizes`` in bytes, in order) grouped into buckets of at most ``cap`` bytes: a tensor
    that would overflow the current bucket starts the next, and one larger than ``cap`` is a bucket of its own.
    The rpc and ipc transports send the same buckets."""
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if not buckets or (buckets[-1] and size + n > cap):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def bucket_note(k: int, n: int, nbytes: int) -> str:
    """What the watchdog and errors say about bucket ``k`` (0-based) of ``n``."""
    return f", weight sync bucket {k + 1} of {n}, {nbytes / 2**20:.0f} MB"


def cuda_ipc_handle(t: torch.Tensor) -> tuple:
    """The rebuild_cuda_tensor arguments of ``t`` (torch's reduce_tensor), as vLLM's IPC sender makes them."""
    from torch.multiprocessing.reductions import reduce_tensor

    return tuple(reduce_tensor(t)[1])


def gpu_uuid(device_index: int) -> str:
    """The physical GPU's UUID, the key the engine looks its handle up by (vLLM's IPC engine)."""
    return str(torch.cuda.get_device_properties(device_index).uuid)


def update_info(bucket: Sequence[tuple[str, torch.Tensor]], uuid: str, handle: Callable[[torch.Tensor], tuple]) -> dict:
    """One bucket's ``update_info`` for vLLM's IPC engine (the fields of IPCWeightTransferUpdateInfo, unpacked):
    names, dtype names (torch's, without ``torch.``), shapes, and one {gpu uuid: handle} per tensor, pickled."""
    handles = [{uuid: handle(t)} for _, t in bucket]
    return {
        "names": [n for n, _ in bucket],
        "dtype_names": [str(t.dtype).split(".")[-1] for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii"),
    }


class IPCSender:
    """The trainer side of vLLM's weight-transfer API for one engine: vLLM's ``VLLMWeightSyncClient`` calls, each a
    bounded collective_rpc named to the watchdog, and ``send``, one sync in buckets (module docstring).

    ``engine``: the vLLM ``LLM`` (its ``collective_rpc``); ``timeout_s``: each call's backstop (None: none);
    ``uuid``/``handle``: the GPU's UUID and the IPC handle maker (tests put stand-ins here)."""

    def __init__(
        self,
        engine: Any,
        *,
        timeout_s: float | None,
        uuid: str,
        handle: Callable[[torch.Tensor], tuple] = cuda_ipc_handle,
        label: str = "vLLM engine 0",
    ) -> None:
        self.engine, self.timeout_s, self.uuid, self.handle, self.label = engine, timeout_s, uuid, handle, label
        self.note = ""  # what the next call is part of (a bucket), for the watchdog and errors

    def _call(self, method: str, **kwargs: Any) -> None:
        what = f"{self.label}: RPC {method} (vLLM weight transfer, ipc){self.note}"
        t0 = time.monotonic()
        with watchdog.waiting_on(what):
            try:
                self.engine.collective_rpc(method, timeout=self.timeout_s, kwargs=kwargs)
            except Exception as err:  # vLLM's timeout and a worker's failure both arrive as an exception
                raise WeightSyncError(
                    f"{what} failed after {time.monotonic() - t0:.1f} s (timeout {self.timeout_s} s): {err}"
                ) from err

    # vLLM's VLLMWeightSyncClient protocol (vllm/distributed/weight_transfer/base.py), the worker methods of the
    # same names (vllm/v1/worker/gpu_worker.py:Worker) behind it
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._call("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update")

    def connect(self) -> None:
        """The handshake, once after the engine starts: unpacked IPC (INIT_INFO)."""
        self.note = ", weight transfer handshake"
        self.init_weight_transfer_engine(dict(INIT_INFO))

    def send(self, buckets: Sequence[Sequence[tuple[str, torch.Tensor]]]) -> None:
        """One sync: start, one update_weights per bucket, finish; then torch releases the handles' memory the
        engine no longer maps. The tensors must stay alive until this returns (the caller holds them)."""
        sizes = [sum(t.nbytes for _, t in b) for b in buckets]
        self.note = f", weight sync start ({len(buckets)} buckets)"
        self.start_weight_update()
        for k, bucket in enumerate(buckets):
            self.note = bucket_note(k, len(buckets), sizes[k])
            self.update_weights(update_info(bucket, self.uuid, self.handle))
        self.note = ", weight sync finish"
        self.finish_weight_update()
        self.note = ""
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
