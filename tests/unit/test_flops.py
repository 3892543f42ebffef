"""ES / GRPO FLOP accounting against hand-computed totals and the paper's N=32 <-> G=8 pairing."""

import pytest

from esbatch.train.flops import es_flops, format_accounting, grpo_flops, match_es_population, match_grpo_group

# a Qwen2.5-1.5B-sized model, 32 prompts per update, 256 prompt + 1024 generated tokens
P, B, LP, LG = 1_543_714_304, 32, 256, 1024


def test_es_flops_tiny_case_by_hand():
    # P=10, N=2, B=3, L=4+5=9: generation 2*10*2*3*9, perturb+restore 4*10*2, update 2*10*2
    f = es_flops(10, 2, 3, 4, 5)
    assert f == {"generation": 1080, "perturb_restore": 80, "update": 40, "passes": 1080, "total": 1200}


def test_grpo_flops_tiny_case_by_hand():
    # P=10, G=2, B=3, L=9: generation 2*10*54, train 6*10*54, AdamW 12*10
    f = grpo_flops(10, 2, 3, 4, 5)
    assert f == {
        "generation": 1080,
        "old_logprobs": 0,
        "reference": 0,
        "train_fwd_bwd": 3240,
        "optimizer": 120,
        "passes": 4320,
        "total": 4440,
    }
    f = grpo_flops(10, 2, 3, 4, 5, beta=0.04, recompute_old_logprobs=True)
    assert (f["old_logprobs"], f["reference"], f["passes"], f["total"]) == (1080, 1080, 6480, 6600)


def test_n32_matches_g8_exactly_on_model_passes():
    es, grpo = es_flops(P, 32, B, LP, LG), grpo_flops(P, 8, B, LP, LG)
    assert es["passes"] == grpo["passes"]  # 2 N = 8 G
    assert match_es_population(grpo["passes"], P, B, LP, LG, overhead=False) == 32.0
    assert match_grpo_group(es["passes"], P, B, LP, LG, overhead=False) == 8.0
    # with the per-parameter update/optimizer terms the totals agree to ~3 / (B L)
    n = match_es_population(grpo["total"], P, B, LP, LG)
    assert n == pytest.approx(32, rel=1e-4) and n != 32
    assert es_flops(P, n, B, LP, LG)["total"] == pytest.approx(grpo["total"], rel=1e-12)
    g = match_grpo_group(es["total"], P, B, LP, LG)
    assert g == pytest.approx(8, rel=1e-4)
    assert grpo_flops(P, g, B, LP, LG)["total"] == pytest.approx(es["total"], rel=1e-12)


def test_matched_population_grows_with_reference_and_old_logprob_forwards():
    n = {
        (beta, old): match_es_population(grpo_flops(P, 8, B, LP, LG, beta, old)["passes"], P, B, LP, LG, False)
        for beta in (0.0, 0.04)
        for old in (False, True)
    }
    assert n == {(0.0, False): 32.0, (0.04, False): 40.0, (0.0, True): 40.0, (0.04, True): 48.0}
    es = es_flops(P, 32, B, LP, LG)["passes"]
    assert match_grpo_group(es, P, B, LP, LG, beta=0.04, overhead=False) == pytest.approx(6.4)


def test_validation():
    with pytest.raises(ValueError, match="> 0"):
        es_flops(P, 32, 0, LP, LG)
    with pytest.raises(ValueError, match="token counts"):
        grpo_flops(P, 8, B, 0, 0)


def test_format_accounting_table():
    text = format_accounting(P, B, LP, LG, updates=300)
    lines = text.splitlines()
    es_total = es_flops(P, 32, B, LP, LG)["total"]
    es_row = next(line for line in lines if line.startswith("ES") and "total" in line)
    assert f"{es_total:.3e}" in es_row and f"{es_total * 300:.3e}" in es_row
    assert any(line.startswith("GRPO") and "train forward + backward" in line and "75.000%" in line for line in lines)
    assert "per run (U=300)" in text
    assert "N = 31.998 (32.000 on the model passes alone)" in text
    assert "G = 8.001" in text
    assert "reference forward (beta=0.04)" in format_accounting(P, B, LP, LG, beta=0.04)


def test_grpo_flops_count_mu_backward_passes():
    # P=10, G=2, B=3, L=9, mu=3: generation 2*10*54, old log-probs 2*10*54 (always recomputed for mu > 1),
    # train 3 * 6*10*54, AdamW 3 * 12*10
    f = grpo_flops(10, 2, 3, 4, 5, iterations=3)
    assert f == {
        "generation": 1080,
        "old_logprobs": 1080,
        "reference": 0,
        "train_fwd_bwd": 3 * 3240,
        "optimizer": 3 * 120,
        "passes": 1080 + 1080 + 3 * 3240,
        "total": 1080 + 1080 + 3 * 3240 + 3 * 120,
    }
    for mu in (1, 2, 4):
        for beta in (0.0, 0.04):
            want = (2 + 2 * (mu > 1) + 2 * (beta > 0) + 6 * mu) * P * 8 * B * (LP + LG) + 12 * mu * P
            assert grpo_flops(P, 8, B, LP, LG, beta, iterations=mu)["total"] == want
    # G = 8 at mu = 2 costs (2 + 2 + 12) / 8 = 2x the passes of mu = 1: N = 64 matches it
    g2 = grpo_flops(P, 8, B, LP, LG, iterations=2)
    assert match_es_population(g2["passes"], P, B, LP, LG, overhead=False) == 64.0
    es = es_flops(P, 64, B, LP, LG)
    assert match_grpo_group(es["total"], P, B, LP, LG, iterations=2) == pytest.approx(8, rel=1e-4)
    assert grpo_flops(P, match_grpo_group(es["total"], P, B, LP, LG, iterations=2), B, LP, LG, iterations=2)[
        "total"
    ] == pytest.approx(es["total"], rel=1e-12)
    with pytest.raises(ValueError, match="iterations"):
        grpo_flops(P, 8, B, LP, LG, iterations=0)


def test_format_accounting_with_mu_counts_generated_batches_per_run():
    text = format_accounting(P, B, LP, LG, updates=300, iterations=2)
    total = grpo_flops(P, 8, B, LP, LG, iterations=2)["total"]
    row = next(line for line in text.splitlines() if line.startswith("GRPO") and "total" in line)
    assert f"{total:.3e}" in row and f"{total * 150:.3e}" in row  # 300 optimizer steps = 150 generated batches
    assert "train forward + backward (mu=2)" in text and "old log-probs " in text and "not recomputed" not in text


def test_flops_command_counts_the_config_on_the_meta_device_without_loading_weights(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """`esbatch flops`: P from the model's config (tied embeddings once, as the saved file holds them) and L_p from
    the tokenizer alone; the same mean prompt length as from the loaded model (the command's former path)."""
    import transformers
    import yaml
    from safetensors.torch import load_file
    from toy import toy_config

    from esbatch.backends.hf import HFGenerator
    from esbatch.cli import main
    from esbatch.config import load_config
    from esbatch.models import load_model_and_tokenizer
    from esbatch.train.flops import mean_prompt_tokens
    from esbatch.train.problems import load_problems

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(toy_config(tiny_model_dir, es_updates=2)))
    cfg = load_config(str(tmp_path / "c.yaml"))
    model, tok = load_model_and_tokenizer(str(tiny_model_dir))
    prompts = load_problems(cfg, HFGenerator(model, tok)).train_prompts[:64]
    loaded_mean = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts) / len(prompts)
    assert mean_prompt_tokens(cfg) == loaded_mean

    def refuse(*args, **kwargs):
        raise AssertionError("esbatch flops loaded the model's weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    assert main(["flops", str(tmp_path / "c.yaml")]) == 0
    params = sum(t.numel() for t in load_file(str(tiny_model_dir / "model.safetensors")).values())
    assert params == sum(p.numel() for p in model.parameters())
    out = capsys.readouterr().out
    assert f"P = {params:,} parameters; prompt {loaded_mean:.0f} tokens" in out
