"""uid blocks for root evaluators: two evaluators on one machine (or a forked copy) never share a uid.

Both tests start processes (evaluators of their own, a fork); the lock folder's own check is in
tests/unit/test_sandbox_uids.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from esbatch.sandbox import _uids

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="uid blocks are taken by root evaluators only")

HOLD = "from esbatch.sandbox._uids import uid_block\nb = uid_block()\nprint(b.start, flush=True)\ninput()"


def test_concurrent_evaluators_get_disjoint_blocks():
    mine = _uids.uid_block()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    others = [subprocess.Popen([sys.executable, "-c", HOLD], env=env, **pipes) for _ in range(2)]
    try:
        starts = [int(p.stdout.readline()) for p in others]
    finally:
        for p in others:
            p.communicate("\n", timeout=300)  # a safety limit: they exit as soon as they read the line
    assert len({mine.start, *starts}) == 3, (mine, starts)
    assert all(s % _uids.UIDS_PER_BLOCK == 0 for s in [mine.start, *starts])
    assert len(mine) == _uids.UIDS_PER_BLOCK


def test_forked_evaluator_takes_its_own_block():
    mine = _uids.uid_block()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, str(_uids.uid_block().start).encode())
        finally:
            os._exit(0)
    os.close(w)
    child = int(os.read(r, 100))
    os.waitpid(pid, 0)
    os.close(r)
    assert child != mine.start
    assert _uids.uid_block() == mine, "the parent keeps its block after the child has gone"
