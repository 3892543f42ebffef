"""HF names -> vLLM's fused layout, on plain torch: one seed must move both layouts identically."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from toy import fuse

from esbatch.backends.layout import fused_name, hf_views
from esbatch.perturb.noise import direction
from esbatch.perturb.update import UpdateSpec, es_update


def _tiny(kind: str) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True))
    else:  # Qwen2: q/k/v carry biases, untied lm_head
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fused_names() -> None:
    assert fused_name("model.layers.3.self_attn.k_proj.weight") == ("model.layers.3.self_attn.qkv_proj.weight", 1)
    assert fused_name("model.layers.0.self_attn.v_proj.bias") == ("model.layers.0.self_attn.qkv_proj.bias", 2)
    assert fused_name("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert fused_name("model.layers.0.mlp.down_proj.weight") is None
    assert fused_name("model.embed_tokens.weight") is None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_views_are_the_hf_tensors_inside_the_fused_ones(kind: str) -> None:
    hf = _tiny(kind)
    engine = fuse(hf)
    assert "model.layers.0.self_attn.qkv_proj.weight" in engine and "model.layers.0.mlp.gate_up_proj.weight" in engine
    assert engine["model.layers.0.self_attn.qkv_proj.weight"].shape == (32 + 16 + 16, 32)  # 4 heads q, 2 kv heads
    if kind == "qwen2":
        assert engine["model.layers.0.self_attn.qkv_proj.bias"].shape == (64,)
    views = hf_views(engine, {n: tuple(t.shape) for n, t in hf.items()})
    assert set(views) == set(hf)
    for n, t in hf.items():
        assert torch.equal(views[n], t), n
        owner = engine[fused_name(n)[0] if fused_name(n) else n]
        assert views[n].untyped_storage().data_ptr() == owner.untyped_storage().data_ptr()  # a view, not a copy


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_seed_perturbs_and_updates_both_layouts_identically(kind: str) -> None:
    hf = _tiny(kind)
    engine = fuse(hf)
    views = hf_views(engine, {n: tuple(t.shape) for n, t in hf.items()})
    # perturb the way the backends do: by HF name, in place
    for n in hf:
        hf[n].add_(direction(7, n, hf[n].shape), alpha=0.01)
        views[n].add_(direction(7, n, views[n].shape), alpha=0.01)
    expected = fuse(hf)
    assert all(torch.equal(engine[k], expected[k]) for k in expected)
    # and the ES update, applied through the views, lands in the fused tensors bit for bit
    l2_hf = es_update(hf, UpdateSpec([1, 2, 3], [0.5, -1.0, 0.25], alpha=0.1, n=3))
    l2_engine = es_update(views, UpdateSpec([1, 2, 3], [0.5, -1.0, 0.25], alpha=0.1, n=3))
    assert l2_hf == l2_engine > 0
    expected = fuse(hf)
    assert all(torch.equal(engine[k], expected[k]) for k in expected)


def test_padded_vocab_rows_are_left_alone() -> None:
    hf = _tiny("llama")
    engine = fuse(hf)
    emb = engine["model.embed_tokens.weight"]
    engine["model.embed_tokens.weight"] = torch.cat([emb, torch.zeros(64, emb.shape[1])])  # padded to 128 rows
    views = hf_views(engine, {n: tuple(t.shape) for n, t in hf.items()})
    views["model.embed_tokens.weight"].add_(1.0)
    assert torch.equal(engine["model.embed_tokens.weight"][64:], torch.zeros(64, 32))
    assert torch.equal(engine["model.embed_tokens.weight"][:64], hf["model.embed_tokens.weight"] + 1.0)


def test_mismatches_are_reported_by_name() -> None:
    hf = _tiny("llama")
    shapes = {n: tuple(t.shape) for n, t in hf.items()}
    engine = fuse(hf)
    with pytest.raises(ValueError, match="no counterpart.*model.norm.weight"):
        hf_views({k: v for k, v in engine.items() if k != "model.norm.weight"}, shapes)
    with pytest.raises(ValueError, match="no HF counterpart.*lm_head.weight"):
        hf_views({**engine, "lm_head.weight": torch.zeros(64, 32)}, shapes)
    bad = dict(engine)
    bad["model.layers.0.mlp.gate_up_proj.weight"] = torch.zeros(200, 32)
    with pytest.raises(ValueError, match="gate_up_proj.*cover only 96 rows"):
        hf_views(bad, shapes)
    with pytest.raises(ValueError, match="does not fit"):
        hf_views(engine, {**shapes, "model.norm.weight": (33,)})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_choosing_vllm_without_vllm_says_how_to_install_it(tmp_path) -> None:
    from esbatch.backends import BACKENDS

    cls = BACKENDS.get("vllm").cls()  # the backend module itself imports without vLLM (validation never needs it)
    with pytest.raises(ImportError, match="setup-vllm.sh"):
        cls(str(tmp_path))
