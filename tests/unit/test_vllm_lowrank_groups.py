"""The row grouping of vLLM's low-rank hooks (esbatch/backends/vllm_lowrank.py, ``_Groups``) against an explicit
per-row computation: whatever order vLLM's batch holds the rows in (member-major, runs of unequal length, a
shuffled batch, rows of no member), every row gets exactly its own member's term, once. No vLLM needed: the
grouping is plain torch."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from esbatch.backends.vllm_lowrank import _Groups

U = 6  # members 0 .. 5, and the zero member 6


def explicit_lowrank(y, x, b, parts, r, member):
    """Row t gets its own member's term: out[t, c:c+w] += (x[t] @ b[m_t])[k r:(k+1) r] @ at[m_t], each row's factors
    picked by its member (a gather per row, no grouping)."""
    out = y.clone()
    left = x if b is None else torch.einsum("tn,tnq->tq", x, b[member])
    for c, w, at, k in parts:
        out[:, c : c + w] += torch.einsum("tr,trw->tw", left[:, k * r : (k + 1) * r], at[member])
    return out


def layout(runs):
    """(member, rows) runs -> the (T,) member of each row."""
    return torch.tensor([m for m, n in runs for _ in range(n)], dtype=torch.long)


RUNS = st.lists(st.tuples(st.integers(0, U), st.integers(1, 40)), min_size=1, max_size=30)
CASES = {
    "member-major decode": [(m, 4) for m in range(U)],
    "whole prompts, last member split": [(m, 43) for m in range(4)] + [(4, 21)],
    "decode then prefill": [(m, 4) for m in range(3)] + [(3, 3 + 43)] + [(m, 43 * 4) for m in (4, 5)],
    "condensed: last requests moved into holes": [(5, 1), (0, 3)] + [(m, 4) for m in range(1, 5)] + [(5, 3)],
    "descending": [(m, 40) for m in (5, 4, 3, 2)],
    "one row each, shuffled": [(m, 1) for m in (3, 1, 4, 1, 5, 2, 6, 0, 2)],
    "no member (center requests) between": [(0, 40), (U, 40), (1, 40)],
}


def check(member: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t, n, r = member.shape[0], 8, 2
    x = torch.randn(t, n, generator=g, dtype=torch.float64)
    y = torch.randn(t, 11, generator=g, dtype=torch.float64)
    bt = torch.randn(U + 1, 2 * r, n, generator=g, dtype=torch.float64)
    at1, at2 = (torch.randn(U + 1, r, w, generator=g, dtype=torch.float64) for w in (5, 4))
    bt[U], at1[U], at2[U] = 0, 0, 0  # the zero member
    parts = [(0, 5, at1, 0), (7, 4, at2, 1)]  # two parts of a fused output, columns 5-6 untouched
    groups = _Groups.of(member, "cpu", torch.float64)
    got = y.clone()
    groups.lowrank(got, x, bt, parts, r)
    torch.testing.assert_close(got, explicit_lowrank(y, x, bt.transpose(1, 2), parts, r, member), rtol=0, atol=1e-12)
    assert torch.equal(got[:, 5:7], y[:, 5:7])
    whole = [(0, 11, torch.randn(U + 1, r, 11, generator=g, dtype=torch.float64), 1)]  # an unfused output
    whole[0][2][U] = 0
    got = y.clone()
    groups.lowrank(got, x, bt, whole, r)
    torch.testing.assert_close(got, explicit_lowrank(y, x, bt.transpose(1, 2), whole, r, member), rtol=0, atol=1e-12)

    # rank 1 (addcmul) and left factors given (the embedding): b None
    left = torch.randn(t, 1, generator=g, dtype=torch.float64)
    got = y.clone()
    groups.lowrank(got, left, None, [(2, 9, at2[:, :1].repeat(1, 1, 3)[..., :9], 0)], 1)
    want = y.clone()
    for i, m in enumerate(member.tolist()):
        want[i, 2:11] += left[i] @ at2[m, :1].repeat(1, 3)[:, :9]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    # vector terms: a bias (y += v[m]) and a norm weight (y += v[m] * n)
    vec = torch.randn(U + 1, 11, generator=g, dtype=torch.float64)
    vec[U] = 0
    norm = torch.randn(t, 11, generator=g, dtype=torch.float64)
    got = y.clone()
    groups.vector(got, vec)
    torch.testing.assert_close(got, y + vec[member], rtol=0, atol=1e-12)
    got = y.clone()
    groups.vector(got, vec, norm)
    torch.testing.assert_close(got, y + vec[member] * norm, rtol=0, atol=1e-12)

    # a norm's gain (y *= gain[m]), in fp32 on a bf16 output
    gain = 1 + torch.randn(U + 1, 11, generator=g) * 1e-2
    gain[U] = 1
    low = y.to(torch.bfloat16)
    got = low.clone()
    groups.scale(got, gain)
    assert torch.equal(got, (low.float() * gain[member]).to(torch.bfloat16))


def test_every_layout_vllm_makes_gets_each_rows_own_members_term():
    for name, runs in CASES.items():
        check(layout(runs), seed=len(name))


def test_blocks_view_the_long_runs_and_gather_only_the_short_ones():
    groups = _Groups.of(layout(CASES["decode then prefill"]), "cpu")
    assert [(b.start, b.count, b.length) for b in groups.blocks] == [(12, 1, 46), (58, 2, 172)]
    assert groups.gather is not None and groups.gather.rows.tolist() == list(range(12))
    assert groups.blocks[1].pick == slice(4, 6)  # members 4, 5: factor stacks sliced, not gathered
    groups = _Groups.of(layout(CASES["member-major decode"] * 2), "cpu")
    assert groups.gather is None and len(groups.blocks) == 1
    assert groups.blocks[0].pick.tolist() == [0, 1, 2, 3, 4, 5] * 2  # members repeat: factor stacks gathered


@settings(max_examples=150, deadline=None)
@given(RUNS, st.integers(0, 2**16))
def test_any_layout_gets_each_rows_own_members_term(runs, seed):
    check(layout(runs), seed)
