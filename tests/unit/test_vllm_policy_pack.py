"""How GRPO's policy weights cross vLLM's collective_rpc (esbatch/backends/vllm_rpc.py:pack/unpack): as (dtype, shape,
bytes), since vLLM 0.32 drops a tensor's side buffer among an RPC's arguments; and the RPC table's policy entries
match the worker (no vLLM needed)."""

from __future__ import annotations

import pickle

import pytest
import torch

from esbatch.backends.vllm_rpc import WorkerCall, pack, unpack


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7,
        (torch.arange(6, dtype=torch.float32) / 3).to(torch.bfloat16).reshape(2, 3),
        torch.tensor(2.5),  # 0-dim
        torch.zeros(0, 5),  # empty
        torch.arange(20, dtype=torch.float32).reshape(4, 5).t(),  # not contiguous
    ],
)
def test_a_packed_tensor_comes_back_bit_for_bit_after_pickling(t):
    dtype, shape, data = pack(t)
    assert (dtype, shape) == (str(t.dtype).removeprefix("torch."), list(t.shape))
    wire = pickle.loads(pickle.dumps((dtype, shape, bytes(data))))  # what the worker receives: plain bytes
    back = unpack(wire)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_pack_shares_the_memory_of_a_contiguous_tensor():
    t = torch.ones(4)
    _, _, data = pack(t)
    t.add_(1)  # no copy until the RPC message is written
    assert torch.equal(unpack(("float32", [4], bytes(data))), torch.full((4,), 2.0))


def test_the_policy_entries_of_the_rpc_table():
    assert WorkerCall.SET_WEIGHTS.moves_weights and not WorkerCall.POLICY_SETUP.moves_weights
    with pytest.raises(TypeError, match=r"es_set_weights takes \(weights\), got 2"):
        WorkerCall.SET_WEIGHTS.check_args(({}, {}))
    from esbatch.backends.vllm_worker import ESWorkerExtension

    assert callable(ESWorkerExtension.es_set_weights) and callable(ESWorkerExtension.es_policy_setup)
