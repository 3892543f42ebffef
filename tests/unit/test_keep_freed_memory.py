"""Where a run applies run.keep_freed_memory (RunSession: CPU only, when asked) and how a refusal is named. What it
does to glibc's allocator: tests/integration/test_malloc_kept.py (a process per case)."""

import pytest

from esbatch.config import config_from_dict
from esbatch.train import lifecycle


@pytest.mark.parametrize(
    ("device", "key", "applied"),
    [("cpu", True, True), ("auto", True, True), ("cpu", False, False), ("cuda", True, False)],
)
def test_a_run_keeps_freed_memory_on_cpu_only_and_only_when_asked(tmp_path, monkeypatch, device, key, applied):
    """device auto resolves to cpu here (no GPU); cuda is not resolved, so a machine without one still opens."""
    calls = []
    monkeypatch.setattr(lifecycle, "keep_freed_memory", lambda: calls.append(1))
    monkeypatch.setenv("ESBATCH_TRACKING_END_WAIT_S", "0")
    cfg = config_from_dict(
        {
            "run": {"name": "r", "output_dir": str(tmp_path), "keep_freed_memory": key},
            "model": {"device": device},
            "es": {"updates": 1},
        }
    )
    with lifecycle.RunSession(cfg, tmp_path / "r", resume=False):
        pass
    assert calls == ([1] if applied else [])


def test_a_refusal_is_named_on_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lifecycle, "keep_freed_memory", lambda: "the C library is not glibc")
    cfg = config_from_dict(
        {"run": {"name": "r", "output_dir": str(tmp_path)}, "model": {"device": "cpu"}, "es": {"updates": 1}}
    )
    with lifecycle.RunSession(cfg, tmp_path / "r", resume=False):
        pass
    assert "run.keep_freed_memory: the C library is not glibc" in capsys.readouterr().err
