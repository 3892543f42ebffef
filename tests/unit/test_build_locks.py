"""A DeepSpeed op build killed mid-way must not hang every later GRPO start (torch's FileBaton waits forever)."""

import os
import time

from esbatch.grpo.trainer import clear_stale_build_locks


def test_only_locks_older_than_the_limit_are_removed(tmp_path, capsys):
    old = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    fresh = tmp_path / "py311_cpu" / "other_op" / "lock"
    flat = tmp_path / "flat_op" / "lock"  # TORCH_EXTENSIONS_DIR set by the user: one level less
    keep = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    for f in (old, fresh, flat, keep):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
    hour_ago = time.time() - 3600
    for f in (old, flat, keep):
        os.utime(f, (hour_ago, hour_ago))
    removed = clear_stale_build_locks(600, root=tmp_path)
    assert sorted(removed) == sorted([old, flat])
    assert not old.exists() and not flat.exists()
    assert fresh.exists() and keep.exists()  # a build in progress, and the built op itself
    assert "stale build lock" in capsys.readouterr().err
    assert clear_stale_build_locks(600, root=tmp_path) == []


def test_the_environment_variable_names_the_folder(tmp_path, monkeypatch):
    lock = tmp_path / "op" / "lock"
    lock.parent.mkdir()
    lock.write_bytes(b"")
    os.utime(lock, (0, 0))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert clear_stale_build_locks(600) == [lock]
