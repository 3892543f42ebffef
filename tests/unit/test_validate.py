"""`esbatch validate` knows every kind of YAML file, every shipped one validates, and a document that is not a
mapping (a list, a number, nothing) gets a clear error naming the file in every command."""

import pytest

from esbatch.cli import main
from esbatch.config.loader import KINDS, builtin_names


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_shipped_file_validates_by_name_and_is_told_apart(kind, capsys):
    names = builtin_names(kind)
    assert names, kind
    assert main(["validate", "--kind", kind, *names]) == 0
    out = capsys.readouterr().out
    words = KINDS[kind][1]
    assert out.count("ok: ") == len(names) and out.count(words) == len(names), out


def test_a_name_shared_by_two_kinds_validates_both(capsys):
    assert main(["validate", "quickstart"]) == 0
    out = capsys.readouterr().out
    assert "(run config: es" in out and "(sweep file quickstart" in out


def test_kind_is_detected_from_content_for_paths(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("name: s\ngrid: {es.population_size: [4, 8]}\n")
    (tmp_path / "b.yaml").write_text("cluster: slurm\npartition: gpu\n")
    (tmp_path / "c.yaml").write_text("name: e\ntasks: [arithmetic]\nks: [1]\nsampling: {n: 1}\n")
    (tmp_path / "d.yaml").write_text("es: {updates: 3}\n")
    assert main(["validate", *(str(tmp_path / f"{x}.yaml") for x in "abcd")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("(")[1].split(" ")[:2] for line in out] == [
        ["sweep", "file"],
        ["launcher", "profile:"],
        ["eval", "config:"],
        ["run", "config:"],
    ], out


@pytest.mark.parametrize(
    "text, words",
    [
        ("- a\n- b\n", "expected a mapping of keys, got list"),
        ("42\n", "got int 42"),
        ("", "the file is empty"),
        ("a: [1\n", "YAML syntax error"),
    ],
)
@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "{f}"],
        ["validate", "--kind", "sweep", "{f}"],
        ["train", "{f}"],
        ["sweep", "{f}", "--dry-run"],
        ["sweep", "quickstart", "--dry-run", "--launcher", "{f}"],
        ["eval", "{f}"],
        ["flops", "{f}", "--params", "1", "--prompt-tokens", "1"],
    ],
)
def test_a_document_that_is_not_a_mapping_is_a_clear_error_everywhere(tmp_path, capsys, text, words, argv):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    code = main([a.replace("{f}", str(f)) for a in argv])
    err = capsys.readouterr().err
    assert code in (1, 2), err
    assert words in err and str(f) in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["validate", "{d}"], ["train", "{d}"], ["eval", "{d}"], ["sweep", "{b}"]])
def test_a_folder_or_a_binary_file_is_named_not_a_traceback(tmp_path, capsys, argv):
    (tmp_path / "bin.yaml").write_bytes(b"\x00\x01\x02garbage")
    code = main([a.replace("{d}", str(tmp_path)).replace("{b}", str(tmp_path / "bin.yaml")) for a in argv])
    err = capsys.readouterr().err
    assert code in (1, 2) and ("is a folder" in err or "binary" in err) and "Traceback" not in err, err


def test_schema_of_every_kind_lists_its_keys(capsys):
    for kind, key in (
        ("config", "es.sigma"),
        ("sweep", "grid"),
        ("launcher", "container.image"),
        ("eval", "tasks[].limit"),
        ("aggregate", "tolerance"),
    ):
        assert main(["validate", "--schema", "--kind", kind]) == 0
        assert key in capsys.readouterr().out, kind


def test_vllm_is_refused_where_it_cannot_serve_with_the_reason():
    from esbatch.config import config_from_dict
    from esbatch.config.eval import eval_config_from_dict

    # GRPO: yes (rollouts on a vLLM engine per rank, loaded after each step: esbatch/backends/vllm_policy.py),
    # alone and as a pipeline stage
    grpo = config_from_dict({"algorithm": "grpo", "grpo": {"updates": 2}, "backend": {"name": "vllm"}})
    assert grpo.algorithm == "grpo" and grpo.backend.name == "vllm"
    stages = {"algorithm": "pipeline", "pipeline": {"stages": ["es", "grpo"], "updates": 4}}
    assert config_from_dict({**stages, "backend": {"name": "vllm"}}).backend.name == "vllm"
    # evaluations: yes (token entropy measured in the workers, esbatch/backends/vllm_entropy.py), in-training too
    two = eval_config_from_dict({"tasks": ["arithmetic"], "backend": {"name": "vllm", "engines": 2}})
    assert two.backend.name == "vllm" and two.backend.engines == 2
    es_evals = {"es": {"updates": 2}, "eval": {"tasks": ["arithmetic"]}, "backend": {"name": "vllm"}}
    assert config_from_dict(es_evals).backend.name == "vllm"
    assert config_from_dict({"es": {"updates": 2}, "backend": {"name": "vllm"}}).backend.name == "vllm"  # ES: yes


def test_a_user_algorithm_by_module_path_and_an_unknown_one(tmp_path):
    from esbatch.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as e:
        config_from_dict({"algorithm": "gpro"})
    assert "algorithm: unknown algorithm 'gpro'. Did you mean 'grpo'?" in str(e.value)
    cfg = config_from_dict({"algorithm": "esbatch.es:ES", "es": {"updates": 3}})
    assert cfg.algo().name == "es" and cfg.total_updates(100) == 3
