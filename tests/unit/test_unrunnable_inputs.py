"""Inputs that passed validate but could not run, or wrote where they should not, are refused by validate
(issue 44, deliverable 8): a path-like eval name, a negative seed, a system prompt too long for any context,
an output folder under a file, and max_new_tokens over the model's context."""

from __future__ import annotations

import json

import pytest

from esbatch.config.eval import load_eval_config
from esbatch.config.run import config_from_dict, load_config
from esbatch.launch.sweep import load_sweep
from esbatch.models import context_length, gguf_context_length
from esbatch.schema import ConfigError
from esbatch.train.sections import MAX_SYSTEM_PROMPT


def errors_of(call, *args) -> list[str]:
    with pytest.raises(ConfigError) as e:
        call(*args)
    return e.value.errors


# ----------------------------------------------------------------------------- names that become folders


@pytest.mark.parametrize("name", ["../runs/f1", "a/b", "..", ".hidden", "/abs", "-dash", "x" * 121])
def test_a_path_like_name_is_refused_wherever_it_becomes_a_folder(name):
    expected = "a folder name: letters, digits and - _ . = , +, not starting with . or - (no / : it stays in its"
    for call, args, key in [
        (load_eval_config, ("eval-quick", [f"name={name}"]), "name"),
        (load_config, ("quickstart", [f"run.name={name}"]), "run.name"),
        (lambda n: load_sweep("quickstart", name=n), (name,), "name"),
    ]:
        (line,) = errors_of(call, *args)
        assert line.startswith(f"{key}: got {name!r}; expected {expected}"), line


def test_a_plain_eval_name_is_its_folder():
    assert load_eval_config("eval-quick", ["name=f1.v2_a=b,c+d"]).name == "f1.v2_a=b,c+d"
    assert load_eval_config("eval-quick", ["name=" + "x" * 120]).name == "x" * 120


# ----------------------------------------------------------------------------- seed, system prompt


@pytest.mark.parametrize("seed, ok", [(-1, False), (0, True), (2**32 - 1, True), (2**32, False)])
def test_the_seed_is_a_32_bit_unsigned_integer(seed, ok):
    data = {"es": {"updates": 3}, "run": {"seed": seed}}
    if ok:
        assert config_from_dict(data).run.seed == seed
    else:
        (line,) = errors_of(config_from_dict, data)
        assert line.startswith("run.seed: must be") and str(seed) in line


def test_a_system_prompt_longer_than_the_bound_is_refused():
    assert MAX_SYSTEM_PROMPT == 20_000
    at = "x" * MAX_SYSTEM_PROMPT
    assert config_from_dict({"es": {"updates": 3}, "task": {"system_prompt": at}}).task.system_prompt == at
    (line,) = errors_of(config_from_dict, {"es": {"updates": 3}, "task": {"system_prompt": at + "x"}})
    assert line == (
        "task.system_prompt: got str of 20,001 characters; expected a string of at most 20,000 characters, or null"
    )


# ----------------------------------------------------------------------------- output folders


def test_an_output_folder_under_a_file_is_refused(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    for out in (f, f / "runs", f / "a" / "b"):
        (line,) = errors_of(config_from_dict, {"es": {"updates": 3}, "run": {"output_dir": str(out)}})
        assert line == (
            f"run.output_dir: got {str(out)!r}: {f} is a file; expected a folder path: no part of it that exists "
            "may be a file"
        )
        (line,) = errors_of(load_eval_config, "eval-quick", [f"output_dir={out}"])
        assert line.startswith(f"output_dir: got {str(out)!r}: {f} is a file")
        sweep = tmp_path / "s.yaml"
        sweep.write_text(f"name: s\nbase: quickstart\noutput_dir: {out}\ngrid: {{es.sigma: [0.1]}}\n")
        (line,) = errors_of(load_sweep, str(sweep))
        assert line.startswith(f"output_dir: got {str(out)!r}: {f} is a file")
    new = tmp_path / "a" / "b"  # not there yet: created when the run starts
    assert config_from_dict({"es": {"updates": 3}, "run": {"output_dir": str(new)}}).run.output_dir == str(new)
    assert not (tmp_path / "a").exists()


# ----------------------------------------------------------------------------- the model's context


@pytest.fixture
def model64(tmp_path):
    """A local HF model folder whose config says a context of 64 tokens (validate reads only config.json)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))
    return str(tmp_path / "m")


def test_max_new_tokens_may_not_exceed_the_models_context(model64):
    assert context_length(model64) == 64
    base = {"es": {"updates": 3}, "model": {"name": model64}}
    assert config_from_dict({**base, "generation": {"max_new_tokens": 64}}).generation.max_new_tokens == 64
    (line,) = errors_of(config_from_dict, {**base, "generation": {"max_new_tokens": 65}})
    assert line == (
        f"generation.max_new_tokens: 65 tokens do not fit the context of {model64} (64 tokens, shared with the "
        "prompt): give at most 64, less by the prompt's length"
    )
    evals = {"max_new_tokens": 100, "tasks": [{"name": "arithmetic", "max_new_tokens": 65}]}
    lines = errors_of(config_from_dict, {**base, "generation": {"max_new_tokens": 8}, "eval": evals})
    assert [x.split(":")[0] for x in lines] == ["eval.max_new_tokens", "eval.tasks[0].max_new_tokens"]


def test_an_eval_configs_token_limits_are_checked_against_its_model(model64):
    lines = errors_of(
        load_eval_config,
        "eval-quick",
        [f"model.name={model64}", "model.gguf_file=null", "sampling.max_new_tokens=65", "tasks=[{name: arithmetic}]"],
    )
    assert [x.split(":")[0] for x in lines] == ["sampling.max_new_tokens"]


def test_the_context_of_a_gguf_model_is_read_from_its_metadata(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "bc"])
    w.add_context_length(96)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    assert gguf_context_length(path) == 96
    assert context_length(str(path)) == 96
    (tmp_path / "none.gguf").write_bytes(path.read_bytes()[:8] + (0).to_bytes(8, "little") + (0).to_bytes(8, "little"))
    assert gguf_context_length(tmp_path / "none.gguf") is None


def test_a_model_whose_context_is_not_at_hand_is_not_checked():
    assert context_length("Qwen/Qwen2.5-0.5B-Instruct-not-downloaded") is None
