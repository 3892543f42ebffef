"""Config errors name the YAML path, say why, and list valid choices; nothing loads a model."""

import pytest
import yaml

from esbatch.cli import main
from esbatch.config import ConfigError, config_from_dict, flatten, load_config, parse_overrides
from esbatch.config.eval import load_eval_config

BASE = {"es": {"updates": 3}}


def errors_of(data):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    return e.value.errors


def test_defaults_and_builtin_quickstart_are_valid():
    cfg = config_from_dict(BASE)
    assert cfg.es.normalization == "zscore" and cfg.es.estimator == "one_point"
    q = load_config("quickstart")
    assert q.model.name == "smollm2-135m-instruct" and q.task.few_shot == 2


@pytest.mark.parametrize(
    "data, path, words",
    [
        ({"es": {"sigma": 0, "updates": 3}}, "es.sigma", "must be > 0"),
        ({"es": {"sigma": -0.1, "updates": 3}}, "es.sigma", "must be > 0"),
        ({"es": {"population_size": 1, "updates": 3}}, "es.population_size", "must be >= 2"),
        ({"es": {"normalization": "zscor", "updates": 3}}, "es.normalization", "Did you mean 'zscore'"),
        ({"es": {"normalization": "rank", "updates": 3}}, "es.normalization", "Valid: zscore, none, centered_rank"),
        ({"es": {"sigmaa": 0.1, "updates": 3}}, "es.sigmaa", "unknown key. Did you mean 'sigma'"),
        ({"es": {"population_size": "eight", "updates": 3}}, "es.population_size", "expected int, got str"),
        ({"es": {"population_size": 8.5, "updates": 3}}, "es.population_size", "expected int, got float"),
        ({"es": {"updates": True}}, "es.updates", "expected int, got bool"),
        ({"generation": {"top_p": 1.5}, **BASE}, "generation.top_p", "must be <= 1.0"),
        ({"model": {"dtype": "fp8"}, **BASE}, "model.dtype", "Valid: float32, bfloat16, float16"),
        ({"model": {"device": "gpu"}, **BASE}, "model.device", "Valid: auto, cpu, cuda, cuda:N"),
        ({"modle": {}, **BASE}, "modle", "Did you mean 'model'"),
        ({"es": "fast"}, "es", "expected a mapping"),
        ({"task": {"name": "gsm8"}, **BASE}, "task.name", "Did you mean 'gsm8k'"),
        ({"task": {"params": {"max_digit": 3}}, **BASE}, "task.params.max_digit", "Did you mean 'max_digits'"),
        ({"task": {"params": {"max_digits": "3"}}, **BASE}, "task.params.max_digits", "expected int"),
        ({"backend": {"name": "vlm"}, **BASE}, "backend.name", "Did you mean 'vllm'"),
        ({"backend": {"engines": 8}, **BASE}, "backend.engines", "need backend.name: vllm"),
        ({"backend": {"name": "vllm", "engines": 0}, **BASE}, "backend.engines", "must be >= 1"),
        ({"backend": {"name": "vllm", "kv_cache_gb": 0.5}, **BASE}, "backend.kv_cache_gb", "expected int"),
        (
            {"backend": {"name": "vllm", "gpu_memory_utilization": 1.5}, **BASE},
            "backend.gpu_memory_utilization",
            "<= 1",
        ),
        ({"es": {}}, "es.updates / es.epochs", "exactly one"),
        ({"es": {"updates": 3, "epochs": 1}}, "es.updates / es.epochs", "exactly one"),
        ({"es": {"estimator": "antithetic", "population_size": 7, "updates": 3}}, "es.population_size", "even"),
        ({"es": {"generation_seeds": "antithetic_pairs", "updates": 3}}, "es.generation_seeds", "antithetic"),
        ({"eval": {"tasks": ["gsm8k", {"name": "gpqaa"}]}, **BASE}, "eval.tasks[1].name", "Did you mean 'gpqa'"),
        ({"eval": {"tasks": [{"name": "gsm8k", "limt": 3}]}, **BASE}, "eval.tasks[0].limt", "Did you mean 'limit'"),
        ({"eval": {"tasks": ["gsm8k", "gsm8k"]}, **BASE}, "eval.tasks", "'gsm8k' appears twice"),
        ({"eval": {"ks": [0, 16]}, **BASE}, "eval.ks", "positive integers"),
        ({"eval": {"samples": 0}, **BASE}, "eval.samples", "must be >= 1"),
        ({"checkpoint": {"snapshots": [0, 5]}, **BASE}, "checkpoint.snapshots", "integers >= 1"),
        ({"algorithm": "grpo", "grpo": {"micro_batch_size": 0, "updates": 3}}, "grpo.micro_batch_size", ">= 1"),
        ({"algorithm": "grpo", "grpo": {"micro_batch_size": 2.5, "updates": 3}}, "grpo.micro_batch_size", "int"),
        ({"algorithm": "grpo", "grpo": {"iterations": 0, "updates": 3}}, "grpo.iterations", "must be >= 1"),
        ({"algorithm": "grpo", "grpo": {"iterations": None, "updates": 3}}, "grpo.iterations", "must be set"),
    ],
)
def test_bad_values_are_rejected_with_the_key_and_reason(data, path, words):
    errs = errors_of(data)
    assert any(e.startswith(path + ":") and words in e for e in errs), errs


def test_all_problems_are_reported_at_once():
    errs = errors_of({"es": {"sigma": 0, "alpha": -1, "normalisation": "zscore", "updates": 3}})
    assert {e.split(":")[0] for e in errs} == {"es.sigma", "es.alpha", "es.normalisation"}


def test_overrides_are_parsed_as_yaml_and_merged(tmp_path):
    assert parse_overrides(["es.sigma=0.01", "task.params.operators=['+','-']", "run.name=x"]) == {
        "es": {"sigma": 0.01},
        "task": {"params": {"operators": ["+", "-"]}},
        "run": {"name": "x"},
    }
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"es": {"updates": 2, "sigma": 0.5}}))
    cfg = load_config(str(f), ["es.sigma=0.02", "es.population_size=4"])
    assert cfg.es.sigma == 0.02 and cfg.es.population_size == 4 and cfg.es.updates == 2
    with pytest.raises(ConfigError, match="es.sigmaa: unknown key"):
        load_config(str(f), ["es.sigmaa=1"])
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        parse_overrides(["es.sigma"])


def test_unknown_config_name_suggests_builtin():
    with pytest.raises(ConfigError, match="Did you mean 'quickstart'"):
        load_config("quikstart")


def test_total_updates_from_epochs_uses_keep_tail_batches():
    cfg = config_from_dict({"es": {"epochs": 2, "batch_size": 4}})
    assert cfg.total_updates(10) == 6


def test_grpo_budget_counts_optimizer_steps_mu_per_generated_batch():
    """TRL: max_steps counts optimizer steps (global_step); an epoch generates every prompt once, mu steps each."""
    cfg = config_from_dict({"algorithm": "grpo", "grpo": {"epochs": 2, "batch_size": 4, "iterations": 3}})
    assert cfg.total_updates(10) == 6 * 3  # 2 epochs x ceil(10 / 4) batches x mu
    cfg = config_from_dict({"algorithm": "grpo", "grpo": {"updates": 7, "iterations": 3}})
    assert cfg.total_updates(10) == 7  # updates are optimizer steps: the last batch serves one
    cfg = config_from_dict({"algorithm": "grpo", "grpo": {"epochs": 2, "batch_size": 4}})
    assert cfg.total_updates(10) == 6 and cfg.grpo.iterations == 1 and cfg.grpo.micro_batch_size is None


def test_flatten_for_mlflow_params():
    flat = flatten(config_from_dict(BASE).to_dict())
    assert flat["es.sigma"] == 1e-3 and flat["model.name"] == "smollm2-135m-instruct"


def test_validate_cli_exit_codes(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(BASE))
    bad.write_text(yaml.safe_dump({"es": {"sigma": -1, "updates": 3}}))
    assert main(["validate", str(good)]) == 0
    assert main(["validate", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "es.sigma: must be > 0" in err
    assert main(["validate", "--schema"]) == 0
    assert "es.population_size" in capsys.readouterr().out


def test_train_rejects_bad_config_before_loading_any_model(tmp_path, capsys):
    assert main(["train", "--set", "es.normalization=zscor", "--set", f"run.output_dir={tmp_path}"]) == 2
    assert "Did you mean 'zscore'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


def test_an_algorithm_brings_its_own_section_as_docs_extending_says(tmp_path, tiny_model_dir):
    """The example of docs/extending.md (tests/baseline_algo.py, verbatim): named as "package.module:Class",
    its section is validated like a built-in one and the run trains with it."""
    from baseline_algo import BaselineConfig
    from toy import toy_config

    from esbatch.train import train

    name = "baseline_algo:Baseline"
    with pytest.raises(ConfigError) as e:
        config_from_dict({"algorithm": name, "baseline": {"batch_sise": 4}})
    assert "baseline.batch_sise: unknown key. Did you mean 'batch_size'?" in str(e.value)
    with pytest.raises(ConfigError, match=r"baseline.updates / baseline.epochs: set exactly one training budget"):
        config_from_dict({"algorithm": name, "baseline": {"batch_size": 4}})
    raw = toy_config(tiny_model_dir, heldout=2, es=None, algorithm=name, baseline={"batch_size": 3, "updates": 2})
    raw["run"] |= {"output_dir": str(tmp_path), "name": "b"}
    cfg = config_from_dict(raw)
    assert cfg.section(BaselineConfig) == BaselineConfig(batch_size=3, updates=2)
    assert cfg.to_dict()["baseline"] == {"batch_size": 3, "updates": 2, "epochs": None}
    assert "es" in cfg.to_dict() and cfg.inert_sections() == ("es", "grpo", "pipeline")
    summary = train(cfg, tmp_path / "b", progress=False)
    log = (tmp_path / "b" / "log.jsonl").read_text().splitlines()
    assert len(log) == 2 and summary["updates"] == 2


@pytest.mark.parametrize(("n", "ks", "bad"), [(4, [1, 4], []), (4, [1, 5], [5]), (2, [1, 16, 32], [16, 32])])
def test_k_above_the_sample_count_is_refused_not_dropped(n, ks, bad):
    """Pass@K with K samples exactly is valid; one more is refused by validation (it used to vanish from the
    tables), in eval configs and in in-training evaluations with tasks."""
    from esbatch.config.eval import eval_config_from_dict

    task = {"name": "arithmetic", "limit": 2}
    cases = [
        (lambda: eval_config_from_dict({"sampling": {"n": n}, "ks": ks, "tasks": [task]}), "ks", "sampling.n"),
        (
            lambda: config_from_dict({"es": {"updates": 1}, "eval": {"samples": n, "ks": ks, "tasks": [task]}}),
            "eval.ks",
            "eval.samples",
        ),
    ]
    for build, ks_key, n_key in cases:
        if not bad:
            build()
            continue
        with pytest.raises(ConfigError) as e:
            build()
        want = f"{ks_key}: K = {', '.join(map(str, bad))} exceed {n_key} = {n}"
        assert want in str(e.value) and f"raise {n_key} to {max(bad)}" in str(e.value)
    config_from_dict(
        {"es": {"updates": 1}, "eval": {"samples": n, "ks": ks}}
    )  # no tasks: nothing is sampled, nothing to check


@pytest.mark.parametrize(("snapshots", "ok"), [([3, 4], True), ([5], False), ([2, 9], False)])
def test_a_snapshot_after_the_last_update_is_refused(snapshots, ok):
    for algo, budget in (("es", {"es": {"updates": 4}}), ("grpo", {"grpo": {"updates": 4}})):
        raw = {"algorithm": algo, **budget, "checkpoint": {"snapshots": snapshots}}
        if ok:
            config_from_dict(raw)
            continue
        late = ", ".join(str(t) for t in snapshots if t > 4)
        with pytest.raises(
            ConfigError, match=rf"checkpoint.snapshots: {late} lie after the last update \({algo}.updates: 4\)"
        ):
            config_from_dict(raw)
    config_from_dict(
        {"es": {"epochs": 1}, "checkpoint": {"snapshots": [999]}}
    )  # epochs: the budget depends on the data


def test_a_pipeline_stage_keeps_the_snapshots_within_its_own_budget(tmp_path):
    """Snapshots are counted in a stage's own updates; those past it were never written and would fail the
    stage's validation, so the stage config drops them."""
    from esbatch.pipeline import stage_configs

    cfg = config_from_dict(
        {
            "algorithm": "pipeline",
            "pipeline": {"stages": ["es", "grpo"], "updates": 5, "split": [2, 3]},
            "checkpoint": {"snapshots": [1, 3]},
        }
    )
    stages = [sc for _, sc in stage_configs(cfg, tmp_path, None)]
    assert [s.checkpoint.snapshots for s in stages] == [[1], [1, 3]]
    for s in stages:  # each stage validates (the second one's init_weights is the first one's future center)
        s.model.init_weights = None
        assert config_from_dict(s.to_dict()).checkpoint.snapshots == s.checkpoint.snapshots


@pytest.mark.parametrize("uri", ["file:/tmp/mlruns", "file:///tmp/mlruns", "/tmp/mlruns", "mlruns", "./mlruns"])
def test_a_file_store_uri_is_refused_before_any_work(uri, monkeypatch):
    """MLflow 3 refuses a file store only when a run logs (an eval: after all its generation): named at load."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for name in ("quickstart", "eval-quick"):
        loader = load_eval_config if name.startswith("eval") else load_config
        with pytest.raises(ConfigError, match=r"tracking.uri: .* is an MLflow file store.*sqlite:///PATH"):
            loader(name, [f"tracking.uri={uri}"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own opt-out: then it is MLflow's to open
    assert load_config("quickstart", [f"tracking.uri={uri}"]).tracking.uri == uri


STORES = ["sqlite:////tmp/m.db", "http://127.0.0.1:5000", "https://ml.example.org", "postgresql://u@h/db", "databricks"]


@pytest.mark.parametrize("uri", STORES)
def test_store_uris_mlflow_opens_are_kept(uri, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert load_config("quickstart", [f"tracking.uri={uri}"]).tracking.uri == uri
