"""checkpoint.center: every | final | none without training: the modes a run's log cannot rebuild are refused,
and the disk a run's checkpoints take is computed from the model's headers (the dry run prints it). The runs stopped
and resumed in each mode are in tests/integration/test_center_runs.py."""

from pathlib import Path

import pytest

from esbatch.config import ConfigError, config_from_dict


@pytest.mark.parametrize("algorithm", ["grpo", "pipeline"])
@pytest.mark.parametrize("mode", ["final", "none"])
def test_final_and_none_are_refused_where_the_log_cannot_rebuild_the_weights(tiny_model_dir, algorithm, mode):
    from toy import toy_config

    d = toy_config(tiny_model_dir, algorithm=algorithm, checkpoint={"center": mode})
    d["grpo"] = {"updates": 2}
    if algorithm == "pipeline":
        d["pipeline"] = {"stages": ["es", "grpo"], "updates": 4}
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    assert f"checkpoint.center: {mode} needs algorithm: es" in str(e.value)
    assert "checkpoint.center: every" in str(e.value)
    config_from_dict({**d, "checkpoint": {"center": "every"}})  # the default is accepted


# ----------------------------------------------------------------------------- disk estimate (sweep --dry-run)


def _tiny_params(model_dir):
    """By hand from the architecture of tests/toy.py:make_tiny_model (hidden 32, 2 layers, 4 heads / 2 KV heads of
    size 8, MLP 64, tied embeddings): the embedding V x 32, per layer q and o 32 x 32, k and v 32 x 16, gate, up and
    down 32 x 64, two norms of 32; the final norm 32."""
    import json

    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    per_layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
    return vocab * 32 + 2 * per_layer + 32


def test_parameter_count_is_read_from_the_headers(tiny_model_dir):
    from esbatch.models import parameter_count

    assert parameter_count(str(tiny_model_dir)) == _tiny_params(tiny_model_dir)
    assert parameter_count("Org/never-downloaded-model") is None  # nothing is fetched


def test_run_disk_matches_a_hand_computation(tiny_model_dir):
    from toy import toy_config

    from esbatch.launch.disk import run_disk

    p = _tiny_params(tiny_model_dir)

    def disk(**sections):
        d = toy_config(tiny_model_dir, es_updates=3, **sections)
        d["model"]["dtype"] = "bfloat16"
        return run_disk(config_from_dict(d), p)

    every = disk(checkpoint={"center": "every", "snapshots": [2]})  # one past the budget is refused (test_config)
    assert every.items == [("center.safetensors (fp32)", 4 * p), (f"snapshots/: 1 x {_h(4 * p)} (fp32)", 4 * p)]
    assert (every.total, every.peak) == (8 * p, 12 * p)
    assert disk(checkpoint={"center": "final"}).total == 2 * p
    assert disk(checkpoint={"center": "none"}).items == []
    assert disk(checkpoint={"center": "none"}, tracking={"log_model": True}).total == 2 * p + 2 * p  # + MLflow copy
    inplace = disk(checkpoint={"center": "every"}, es={"population_size": 4, "restore": "inplace", "updates": 3})
    assert inplace.total == 2 * p  # the center in the compute dtype
    grpo = disk(algorithm="grpo", grpo={"updates": 5}, checkpoint={"every": 2})
    # center fp32 at the end + the newest DeepSpeed checkpoint (bf16 weights, fp32 master, m and v); the next one
    # is written beside it before the older goes
    assert (grpo.total, grpo.peak) == (4 * p + p * (2 + 4 + 8), 4 * p + 2 * p * (2 + 4 + 8))
    fp32 = config_from_dict(
        {**toy_config(tiny_model_dir, algorithm="grpo", grpo={"updates": 5}), "checkpoint": {"every": 2}}
    )
    assert run_disk(fp32, p).total == 4 * p + p * (4 + 8)  # fp32 weights are their own master copy


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (999_949, "999.9 kB"), (10**6, "1.0 MB"), (3.2e15, "3200.0 TB")],
)
def test_sizes_change_unit_at_exactly_1000(n, text):
    assert _h(n) == text


def _h(n):
    from esbatch.launch.disk import human

    return human(n)


def test_sweep_dry_run_prints_the_disk_per_run_and_in_total(tmp_path, tiny_model_dir, capsys):
    import yaml
    from toy import toy_config

    from esbatch.cli import main

    p = _tiny_params(tiny_model_dir)
    base = toy_config(tiny_model_dir, es_updates=3)
    base["model"]["dtype"] = "bfloat16"
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {
        "name": "disk",
        "base": str(tmp_path / "base.yaml"),
        "output_dir": str(tmp_path / "out"),
        "grid": {"checkpoint.center": ["every", "final", "none"]},
        "launcher": "local",
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    assert main(["sweep", str(tmp_path / "s.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{p:,} parameters (from its files' headers)" in out
    assert f"{_h(4 * p)}, {_h(8 * p)} while a checkpoint is written: center.safetensors (fp32) {_h(4 * p)}" in out
    assert f"{_h(2 * p)}: final_model/ (bfloat16) {_h(2 * p)}" in out
    assert "0 B: no weight files (checkpoint.center: none)" in out
    assert f"total: {_h(6 * p)} for 3 run(s); up to {_h(10 * p)}" in out
