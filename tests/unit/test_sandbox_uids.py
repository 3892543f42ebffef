"""uid blocks for root evaluators: the lock folder that keeps two evaluators from sharing a uid. (That two
evaluators, or a forked copy, get disjoint blocks starts processes: tests/integration/test_sandbox_uid_leases.py.)"""

from __future__ import annotations

import os

import pytest

from esbatch.sandbox import _uids

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="uid blocks are taken by root evaluators only")


def test_lock_folder_is_root_owned_and_closed():
    # a block's lock taken here (not through uid_block(), which may start a process to clear a dead evaluator's
    # leftovers), so the test does not depend on another test having taken one first
    fd, first = _uids._take_block()
    try:
        folder = _uids._lock_dir()
        st = os.lstat(folder)
        assert st.st_uid == 0 and not st.st_mode & 0o022
        assert any(name.startswith("uids-") for name in os.listdir(folder))
        assert f"uids-{first}-{first + _uids.UIDS_PER_BLOCK - 1}" in os.listdir(folder)
    finally:
        os.close(fd)  # the lock goes with it
