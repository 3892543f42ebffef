"""The GRPO weight sync into a vLLM policy engine (esbatch/backends/vllm_policy.py:VLLMPolicy.load_policy), its
RPC calls recorded by a stand-in for the engine's worker (the real worker's es_set_weights / es_sample, on a dict):
one call per bucket (never per tensor), each named to the watchdog with its bucket and size; the tensors themselves
in process, packed bytes to a separate process; then a check of sampled coordinates that raises StaleEngineError,
naming the tensors, when the engine did not take the load. tests/vllm_cpu runs the same against real engines.
"""

from __future__ import annotations

import pytest
import torch

from esbatch.backends.vllm_policy import CHECK_PER_TENSOR, StaleEngineError, VLLMPolicy
from esbatch.backends.vllm_rpc import WorkerCall, pack, unpack
from esbatch.perturb.inplace import coordinate_sample


class FakeWorker:
    """The engine side: HF-named weights; copies what SET_WEIGHTS sends (unless ``ignore``), samples them."""

    def __init__(self, weights: dict[str, torch.Tensor], ignore: set[str] = frozenset()) -> None:
        self.live = {n: t.clone() for n, t in weights.items()}
        self.ignore, self.calls = ignore, []

    def rpc(self, e: int, call: WorkerCall, *args, note: str = ""):
        call.check_args(args)
        self.calls.append((call, args, note))
        if call is WorkerCall.SET_WEIGHTS:
            (bucket,) = args
            for name, p in bucket.items():
                if name not in self.ignore:
                    self.live[name].copy_(p if isinstance(p, torch.Tensor) else unpack(p))
            return {"tensors": len(bucket)}
        per_tensor, names = args
        dtype, shape, data = pack(coordinate_sample({n: self.live[n] for n in names}, per_tensor))
        return {"sample": (dtype, shape, bytes(data))}


def policy(worker: FakeWorker, in_process: bool, bucket_bytes: int) -> VLLMPolicy:
    gen = object.__new__(VLLMPolicy)
    gen.in_process, gen.bucket_bytes, gen.engine_dtype, gen.last_sync = in_process, bucket_bytes, torch.float32, {}
    gen._rpc = worker.rpc
    return gen


def trained(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (16, 8), "b.weight": (8,), "c.weight": (4, 4), "d.bias": (3,), "e.weight": (32, 2)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


@pytest.mark.parametrize("in_process", [True, False])
def test_one_call_per_bucket_then_a_check_and_the_engine_holds_the_weights(in_process):
    old, new = trained(0), trained(1)
    worker = FakeWorker(old)
    # buckets of at most 300 bytes: a (512, larger than a bucket: alone) | b (32), c (64), d (12) | e (256, which
    # would make 364): 3 calls for 5 tensors
    gen = policy(worker, in_process, bucket_bytes=300)
    gen.load_policy(new.items())
    sets = [c for c in worker.calls if c[0] is WorkerCall.SET_WEIGHTS]
    assert [sorted(c[1][0]) for c in sets] == [["a.weight"], ["b.weight", "c.weight", "d.bias"], ["e.weight"]]
    assert [c[2] for c in sets] == [
        ", weight sync bucket 1 of 3, 0 MB",
        ", weight sync bucket 2 of 3, 0 MB",
        ", weight sync bucket 3 of 3, 0 MB",
    ]
    sent = sets[0][1][0]["a.weight"]
    assert isinstance(sent, torch.Tensor) == in_process  # the tensor itself in process; packed bytes otherwise
    assert worker.calls[-1][0] is WorkerCall.SAMPLE and "checking the weight sync" in worker.calls[-1][2]
    assert all(torch.equal(worker.live[n], new[n]) for n in new)
    n_checked = sum(min(CHECK_PER_TENSOR, t.numel()) for t in new.values())
    assert gen.last_sync["checked"] == n_checked and gen.last_sync["buckets"] == 3
    assert gen.last_sync["bytes"] == sum(t.nbytes for t in new.values())


def test_a_bucket_as_large_as_the_model_is_one_call():
    worker = FakeWorker(trained(0))
    policy(worker, True, bucket_bytes=1 << 20).load_policy(trained(1).items())
    assert [c[0] for c in worker.calls] == [WorkerCall.SET_WEIGHTS, WorkerCall.SAMPLE]


@pytest.mark.parametrize("ignored", [{"c.weight"}, {"a.weight", "e.weight"}, set(trained())])
def test_an_engine_that_ignores_a_load_is_caught_and_named(ignored):
    worker = FakeWorker(trained(0), ignore=ignored)
    gen = policy(worker, True, bucket_bytes=256)
    with pytest.raises(StaleEngineError, match="stale weights") as err:
        gen.load_policy(trained(1).items())
    msg = str(err.value)
    assert f"{len(ignored)} of 5 tensors" in msg
    assert all(n in msg for n in sorted(ignored)[:3])


def test_one_changed_coordinate_outside_the_sample_is_not_seen_but_any_sampled_one_is():
    """What the check covers: CHECK_PER_TENSOR coordinates of each tensor (all of a tensor that small)."""
    new = trained(1)
    worker = FakeWorker(new)
    gen = policy(worker, True, bucket_bytes=1 << 20)
    gen.load_policy(new.items())  # in sync
    worker.live["d.bias"][0] += 1.0  # 3 elements: all sampled
    with pytest.raises(StaleEngineError, match="d.bias"):
        gen.check_policy(list(new.items()))
