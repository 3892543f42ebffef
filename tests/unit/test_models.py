from pathlib import Path

import pytest

from esbatch.models import MODELS, resolve_source


def test_smollm2_alias_points_at_the_gguf_in_the_pypi_package():
    src = resolve_source("smollm2-135m-instruct")
    assert src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (Path(src.path) / src.gguf_file).is_file()


def test_gguf_path_and_dirs_and_hub_ids(tmp_path):
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    assert resolve_source(str(g)).gguf_file == "m.gguf" and resolve_source(str(g)).path == str(tmp_path)
    assert resolve_source(str(tmp_path)).path == str(tmp_path)
    assert resolve_source("Qwen/Qwen2.5-0.5B-Instruct").path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_source("qwen2.5-1.5b-instruct").path == "Qwen/Qwen2.5-1.5B-Instruct"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(str(tmp_path / "missing.gguf"))


def test_registry_lists_models():
    assert "smollm2-135m-instruct" in MODELS.names()


def test_tiny_model_dir_loads_in_both_dtypes(tiny_model_dir):
    import torch

    from esbatch.models import load_model_and_tokenizer

    for dtype in ("float32", "bfloat16"):
        model, tok = load_model_and_tokenizer(str(tiny_model_dir), dtype=dtype)
        assert next(model.parameters()).dtype == getattr(torch, dtype)
        assert tok.padding_side == "left" and tok.pad_token is not None


def test_a_folder_of_a_hub_repo_is_a_model_name(tmp_path, monkeypatch):
    """hf://org/repo/folder (the paper's released Hard GRPO checkpoint lives in one): only that folder is fetched."""
    import huggingface_hub

    from esbatch.models import model_path, model_problem

    assert model_problem("hf://zz1358m/SofT-GRPO-master/saved_weight/Deepeeek-Qwen-1.5B+GRPO") is None
    for bad in ("hf://org/repo", "hf://org/repo/", "hf://org"):
        assert "expected hf://org/repo/folder" in model_problem(bad)
    calls = []

    def fake(repo, revision=None, allow_patterns=None):
        calls.append((repo, revision, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    path, rev = model_path("hf://org/repo/a/b+c", revision="v1")
    assert (path, rev) == (str(tmp_path / "a" / "b+c"), None)
    assert calls == [("org/repo", "v1", ["a/b+c/*"])]
