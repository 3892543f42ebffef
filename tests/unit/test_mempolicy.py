"""esbatch/backends/mempolicy.py: a thread's NUMA memory policy read, set and kept across a block, with the real
system calls. Each case runs in a thread of its own: the policy is per thread, so the test process's own stays as
it was. Node 0 exists on every Linux machine."""

from __future__ import annotations

import platform
import threading

import pytest

from esbatch.backends import mempolicy

BIND0 = (2, (0,))  # MPOL_BIND on node 0: what vLLM's CPU worker sets
PREFERRED0 = (1, (0,))

pytestmark = pytest.mark.skipif(mempolicy.current() is None, reason="get_mempolicy is not available here")


def in_thread(fn):
    """fn() in a fresh thread (it starts with the default policy: this process never sets another); its result."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("start", [None, PREFERRED0, BIND0])
@pytest.mark.parametrize("inside", [BIND0, PREFERRED0, (0, ())])
def test_kept_gives_the_thread_back_the_policy_it_had(start, inside):
    def case():
        if start is not None:
            mempolicy.apply(start)
        before = mempolicy.current()
        with mempolicy.kept():
            mempolicy.apply(inside)
            seen = mempolicy.current()
        return before, seen, mempolicy.current()

    before, seen, after = in_thread(case)
    assert before == (start or (0, ()))
    assert seen == inside  # the change happened, and current() reads it back as apply() took it
    assert after == before


def test_kept_restores_when_the_block_raises():
    def case():
        with pytest.raises(RuntimeError, match="engine failed"), mempolicy.kept():
            mempolicy.apply(BIND0)
            raise RuntimeError("engine failed")
        return mempolicy.current()

    assert in_thread(case) == (0, ())


def test_kept_calls_nothing_when_the_block_left_the_policy_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(mempolicy, "apply", calls.append)
    with mempolicy.kept():
        pass
    assert calls == []


def test_a_thread_started_under_a_binding_inherits_it():
    """Why the module says a thread started inside kept() keeps the binding: the kernel copies the policy to a
    new thread (the trainer's torch threads exist before its engine starts)."""

    def case():
        mempolicy.apply(BIND0)
        return in_thread(mempolicy.current)

    assert in_thread(case) == BIND0


def test_an_invalid_policy_is_a_named_error():
    with pytest.raises(OSError, match=r"set_mempolicy\(bind\): Invalid argument"):
        in_thread(lambda: mempolicy.apply((2, ())))  # bind to no node


def test_describe_spells_policies_as_numactl():
    assert [mempolicy.describe(p) for p in [(0, ()), BIND0, (3, (0, 2)), None, (2 | 1 << 15, (1,))]] == [
        "default",
        "bind:0",
        "interleave:0,2",
        "unknown",
        "bind:1",
    ]


def test_elsewhere_the_policy_is_left_as_is(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert mempolicy.current() is None
    with mempolicy.kept():
        pass
    with pytest.raises(OSError, match="not available on Linux riscv64"):
        mempolicy.apply(BIND0)


def test_a_policy_that_cannot_be_read_leaves_the_block_running(monkeypatch, capsys):
    """Docker's default seccomp profile refuses get_mempolicy without CAP_SYS_NICE (EPERM): the engine still starts."""

    def refused():
        raise OSError(1, "get_mempolicy: Operation not permitted")

    monkeypatch.setattr(mempolicy, "current", refused)
    ran = []
    with mempolicy.kept():
        ran.append(True)
    assert ran == [True]
    assert "left as the vLLM engine sets it (" in capsys.readouterr().err
