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
