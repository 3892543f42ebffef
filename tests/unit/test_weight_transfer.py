"""backend.weight_transfer: ipc, the GRPO policy into a separate engine through vLLM's weight-transfer API
(esbatch/backends/weight_transfer.py), against a stand-in for the engine: ``FakeIPCWorker`` has the methods of
vLLM's worker that the API calls (init_weight_transfer_engine, start_weight_update, update_weights,
finish_weight_update) and decodes each update as vLLM's IPC engine does (names, dtype names, shapes, one
{gpu uuid: handle} per tensor, pickled); a "handle" here is a key into a table of the trainer's tensors, as a CUDA
IPC handle is a key into the GPU's memory. tests/vllm_cpu/test_weight_transfer_api.py checks these method names and
parameters, the payload's fields and the engine option against vLLM's own classes.

What is proved: the buckets (names, dtypes, shapes) through the API equal those the rpc path sends, one
update_weights per bucket between one start and one finish; every call carries the RPC backstop and is named to
the watchdog with its bucket; a failing or timed-out call raises WeightSyncError naming the bucket; the prefix cache
is reset after finish and the sampled-coordinate check runs after it and catches an engine that ignored a bucket;
on CPU ipc is refused before any engine starts, and the config refuses what cannot work.
"""

from __future__ import annotations

import base64
import pickle
from types import SimpleNamespace

import pytest
import torch

from esbatch import deadlines as watchdog
from esbatch.backends import vllm_policy
from esbatch.backends import weight_transfer as wt
from esbatch.backends.config import BackendConfig, ESSetup, resolve_weight_transfer
from esbatch.backends.vllm_policy import StaleEngineError, VLLMPolicy
from esbatch.backends.vllm_rpc import WorkerCall, pack, unpack
from esbatch.perturb.inplace import coordinate_sample
from esbatch.schema import build

UUID = "GPU-00000000-test"


class Handles:
    """Stand-in for CUDA IPC: ``make`` gives a tensor's "handle" (its key), ``open`` the tensor it names."""

    def __init__(self) -> None:
        self.table: dict[int, torch.Tensor] = {}

    def make(self, t: torch.Tensor) -> tuple:
        self.table[id(t)] = t
        return ("fake-ipc", id(t))

    def open(self, handle: tuple) -> torch.Tensor:
        return self.table[handle[1]]


class FakeIPCWorker:
    """The engine's worker: HF-named weights; vLLM's weight-transfer methods (ipc, unpacked) and esbatch's RPCs
    (SET_WEIGHTS, SAMPLE). ``ignore``: names whose loads it drops; ``fail_on``: the update_weights call (1-based)
    that raises, as a worker error or a timeout arrives."""

    def __init__(self, weights: dict[str, torch.Tensor], handles: Handles, ignore=frozenset(), fail_on=0) -> None:
        self.live = {n: t.clone() for n, t in weights.items()}
        self.handles, self.ignore, self.fail_on = handles, ignore, fail_on
        self.log: list[tuple] = []  # (what, detail, watchdog waits during the call, timeout)
        self.updates: list[dict] = []
        self.packed: bool | None = None
        self.active = False

    # vLLM's Worker methods (vllm/v1/worker/gpu_worker.py), the names and parameters the vllm_cpu test checks
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.packed = init_info["packed"]

    def start_weight_update(self) -> None:
        assert not self.active
        self.active = True

    def update_weights(self, update_info: dict | list[dict]) -> None:
        assert self.active and self.packed is False
        self.updates.append(update_info)
        if len(self.updates) == self.fail_on:
            raise TimeoutError("RPC call to update_weights timed out.")
        handles = pickle.loads(base64.b64decode(update_info["ipc_handles_pickled"]))
        for name, dtype, shape, h in zip(
            update_info["names"], update_info["dtype_names"], update_info["shapes"], handles, strict=True
        ):
            t = self.handles.open(h[UUID])
            assert str(t.dtype) == f"torch.{dtype}" and list(t.shape) == shape
            if name not in self.ignore:
                self.live[name].copy_(t)

    def finish_weight_update(self) -> None:
        assert self.active
        self.active = False

    # esbatch's RPC table, as tests/unit/test_policy_sync.py's stand-in
    def rpc(self, e: int, call: WorkerCall, *args, note: str = ""):
        call.check_args(args)
        self.log.append((call.method, args, note))
        if call is WorkerCall.SET_WEIGHTS:
            for name, p in args[0].items():
                if name not in self.ignore:
                    self.live[name].copy_(p if isinstance(p, torch.Tensor) else unpack(p))
            return {"tensors": len(args[0])}
        per_tensor, names = args
        dtype, shape, data = pack(coordinate_sample({n: self.live[n] for n in names}, per_tensor))
        return {"sample": (dtype, shape, bytes(data))}


class FakeLLM:
    """vLLM's LLM as the sender sees it: collective_rpc(method, timeout, args, kwargs) to its one worker, and
    reset_prefix_cache."""

    def __init__(self, worker: FakeIPCWorker) -> None:
        self.worker = worker

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        self.worker.log.append((method, kwargs, tuple(watchdog.waits()), timeout))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> None:
        self.worker.log.append(("reset_prefix_cache", None, tuple(watchdog.waits()), None))


def policy(worker: FakeIPCWorker, transport: str, bucket_bytes: int, dtype=torch.float32) -> VLLMPolicy:
    gen = object.__new__(VLLMPolicy)
    gen.in_process, gen.weight_transfer, gen.bucket_bytes = False, transport, bucket_bytes
    gen.engine_dtype, gen.last_sync, gen.prefix_caching = dtype, {}, True
    gen.engines = [FakeLLM(worker)]
    gen._rpc = worker.rpc
    if transport == "ipc":
        gen._ipc = wt.IPCSender(gen.engines[0], timeout_s=7.0, uuid=UUID, handle=worker.handles.make)
        gen._ipc.connect()
    return gen


def trained(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (16, 8), "b.weight": (8,), "c.weight": (4, 4), "d.bias": (3,), "e.weight": (32, 2)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def sent_buckets(worker: FakeIPCWorker, transport: str) -> list[list[tuple[str, str, list[int]]]]:
    """(name, dtype, shape) of every tensor, bucket by bucket, as the engine received them."""
    if transport == "ipc":
        return [list(zip(u["names"], u["dtype_names"], u["shapes"], strict=True)) for u in worker.updates]
    out = []
    for _, args, _ in [e for e in worker.log if e[0] == WorkerCall.SET_WEIGHTS.method]:
        out.append([(n, str(unpack(p).dtype).split(".")[-1], list(unpack(p).shape)) for n, p in args[0].items()])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_api_sends_the_buckets_names_dtypes_and_shapes_the_rpc_path_sends(dtype):
    new = trained(1)
    got = {}
    for transport in ("rpc", "ipc"):
        worker = FakeIPCWorker(trained(0), Handles())
        gen = policy(worker, transport, bucket_bytes=300 if dtype == torch.float32 else 150, dtype=dtype)
        gen.load_policy(new.items())
        got[transport] = sent_buckets(worker, transport)
        assert all(torch.equal(worker.live[n], new[n].to(dtype)) for n in new)
        assert gen.last_sync["buckets"] == 3
    name = str(dtype).split(".")[-1]
    assert (
        got["ipc"]
        == got["rpc"]
        == [
            [("a.weight", name, [16, 8])],  # 128 elements: larger than a bucket, alone
            [("b.weight", name, [8]), ("c.weight", name, [4, 4]), ("d.bias", name, [3])],
            [("e.weight", name, [32, 2])],  # 64 more elements would overflow the second
        ]
    )


def test_one_update_weights_per_bucket_between_start_and_finish_then_reset_then_the_check():
    worker = FakeIPCWorker(trained(0), Handles())
    gen = policy(worker, "ipc", bucket_bytes=300)
    worker.log.clear()
    gen.load_policy(trained(1).items())
    order = [e[0] for e in worker.log]
    assert order == [
        "start_weight_update",
        "update_weights",
        "update_weights",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
        "es_sample",
    ]
    assert WorkerCall.SAMPLE.method == "es_sample"
    calls = [e for e in worker.log if e[0] != "es_sample"]
    assert [e[3] for e in calls] == [7.0, 7.0, 7.0, 7.0, 7.0, None]  # every API call bounded by the backstop
    waits = [e[2][-1] for e in calls]
    assert waits[1:4] == [
        f"vLLM engine 0: RPC update_weights (vLLM weight transfer, ipc), weight sync bucket {k} of 3, 0 MB"
        for k in (1, 2, 3)
    ]
    assert waits[0].endswith("start_weight_update (vLLM weight transfer, ipc), weight sync start (3 buckets)")
    assert waits[5] == "vLLM engine 0: reset_prefix_cache after the weight sync (ipc)"
    assert watchdog.waits() == []


def test_the_handshake_asks_for_unpacked_ipc_once():
    worker = FakeIPCWorker(trained(0), Handles())
    gen = policy(worker, "ipc", bucket_bytes=300)
    gen.load_policy(trained(1).items())
    gen.load_policy(trained(2).items())
    assert [e[1] for e in worker.log if e[0] == "init_weight_transfer_engine"] == [{"init_info": {"packed": False}}]
    assert worker.packed is False and len(worker.updates) == 6


@pytest.mark.parametrize("fail_on", [1, 2, 3])
def test_a_failed_or_timed_out_bucket_is_a_named_error_and_no_check_runs(fail_on):
    worker = FakeIPCWorker(trained(0), Handles(), fail_on=fail_on)
    gen = policy(worker, "ipc", bucket_bytes=300)
    with pytest.raises(wt.WeightSyncError) as err:
        gen.load_policy(trained(1).items())
    msg = str(err.value)
    assert f"vLLM engine 0: RPC update_weights (vLLM weight transfer, ipc), weight sync bucket {fail_on} of 3" in msg
    assert "(timeout 7.0 s)" in msg and "timed out" in msg and "failed after" in msg
    assert isinstance(err.value.__cause__, TimeoutError)
    assert not any(e[0] in ("finish_weight_update", "es_sample") for e in worker.log)
    assert watchdog.waits() == []


@pytest.mark.parametrize("ignored", [{"c.weight"}, {"a.weight", "e.weight"}])
def test_an_engine_that_ignores_an_api_load_is_caught_by_the_check(ignored):
    worker = FakeIPCWorker(trained(0), Handles(), ignore=ignored)
    gen = policy(worker, "ipc", bucket_bytes=300)
    with pytest.raises(StaleEngineError, match="separate process, weight transfer ipc") as err:
        gen.load_policy(trained(1).items())
    assert f"{len(ignored)} of 5 tensors" in str(err.value)
    assert all(n in str(err.value) for n in ignored)


def test_plan_buckets_cuts_before_an_overflow_and_keeps_a_large_tensor_alone():
    assert wt.plan_buckets([512, 32, 64, 12, 256], 300) == [[0], [1, 2, 3], [4]]
    assert wt.plan_buckets([100, 200, 1, 300], 300) == [[0, 1], [2], [3]]
    assert wt.plan_buckets([10, 10], 1 << 20) == [[0, 1]]
    assert wt.plan_buckets([], 300) == []


def test_update_info_has_vllms_ipc_fields_and_one_handle_per_tensor():
    handles = Handles()
    bucket = [("x", torch.zeros(2, 3, dtype=torch.bfloat16)), ("y", torch.zeros(4))]
    info = wt.update_info(bucket, UUID, handles.make)
    assert set(info) == {"names", "dtype_names", "shapes", "ipc_handles_pickled"}
    assert (info["names"], info["dtype_names"], info["shapes"]) == (["x", "y"], ["bfloat16", "float32"], [[2, 3], [4]])
    decoded = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    assert [handles.open(h[UUID]) is t for h, (_, t) in zip(decoded, bucket, strict=True)] == [True, True]


# ----------------------------------------------------------------------------- choosing and refusing


@pytest.mark.parametrize(
    ("requested", "engine", "on_gpu", "want"),
    [
        ("auto", "separate", True, "ipc"),
        ("auto", "separate", False, "rpc"),
        ("rpc", "separate", True, "rpc"),
        ("ipc", "separate", True, "ipc"),
        ("auto", "in_process", True, "in_process"),
        ("auto", "in_process", False, "in_process"),
    ],
)
def test_resolve_weight_transfer(requested, engine, on_gpu, want):
    assert resolve_weight_transfer(requested, engine, on_gpu) == want


def test_ipc_on_cpu_is_a_config_error_naming_the_key_why_and_the_valid_values():
    with pytest.raises(ValueError) as err:
        resolve_weight_transfer("ipc", "separate", on_gpu=False)
    msg = str(err.value)
    assert msg.startswith("backend.weight_transfer: ipc needs CUDA")
    assert "CUDA IPC handles" in msg and msg.endswith("Valid on CPU: auto, rpc")


@pytest.mark.parametrize(
    ("section", "want"),
    [
        ({"weight_transfer": "nccl", "policy_engine": "separate"}, "'nccl'"),
        ({"weight_transfer": "ipc"}, "ipc moves weights into an engine in its own process"),
        ({"weight_transfer": "rpc", "policy_engine": "in_process"}, "set policy_engine: separate"),
    ],
)
def test_the_config_refuses_what_cannot_work(section, want):
    errors: list[str] = []
    build(BackendConfig, {"name": "vllm", **section}, "backend", errors)
    assert len(errors) == 1 and errors[0].startswith("backend.weight_transfer: ") and want in errors[0], errors
    assert "auto" in errors[0] and "rpc" in errors[0] and "ipc" in errors[0]  # the valid values


@pytest.mark.parametrize("section", [{}, {"weight_transfer": "ipc", "policy_engine": "separate"}])
def test_the_config_accepts_auto_and_ipc_with_a_separate_engine(section):
    errors: list[str] = []
    cfg = build(BackendConfig, {"name": "vllm", **section}, "backend", errors)
    assert errors == [] and cfg.weight_transfer == section.get("weight_transfer", "auto")


def test_for_policy_refuses_ipc_on_cpu_before_any_engine_starts(monkeypatch):
    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_policy, "model_path", lambda *a: ("/nowhere", None))
    monkeypatch.setattr(VLLMPolicy, "__init__", lambda self, *a, **k: started.append(k))
    model = SimpleNamespace(name="m", gguf_file=None, revision=None, dtype="float32")
    setup = ESSetup(model, BackendConfig(name="vllm", policy_engine="separate", weight_transfer="ipc"))
    with pytest.raises(ValueError, match=r"^backend\.weight_transfer: ipc needs CUDA"):
        VLLMPolicy.for_policy(torch.nn.Linear(2, 2), None, setup)
    assert started == []


def test_the_engine_starts_with_vllms_ipc_option_and_environment_only_for_ipc(monkeypatch):
    seen = []
    monkeypatch.setattr(vllm_policy.VLLMBackend, "_start_engines", lambda self, v, envs, opts: seen.append(opts))
    monkeypatch.setattr(
        vllm_policy.VLLMBackend, "_engine_envs", lambda self, n, on_gpu, kv: [{"VLLM_CPU_KVCACHE_SPACE": "2"}]
    )
    envs = {}
    for transport in ("rpc", "ipc"):
        gen = object.__new__(VLLMPolicy)
        gen.in_process, gen.weight_transfer, gen.local_rank, gen.local_world = False, transport, 0, 1
        envs[transport] = gen._engine_envs(1, True, 2)[0]
        gen._start_engines(None, [envs[transport]], {"model": "m"})
    assert seen == [{"model": "m"}, {"model": "m", "weight_transfer_config": {"backend": "ipc"}}]
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in envs["rpc"]
    assert envs["ipc"]["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_ipc_in_process_is_refused_by_the_constructor():
    with pytest.raises(ValueError, match="valid for a separate engine: rpc, ipc"):
        VLLMPolicy("/nowhere", in_process=True, weight_transfer="ipc")
