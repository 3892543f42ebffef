"""Every ES validation rule (esbatch/es/config.py) holds for a pipeline's ES stage too: a config breaking it is
refused with the same message as a plain ES run and as a pipeline [es, grpo]. A rule added to es/config.py
without a case here fails test_every_es_rule_has_a_case."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest

import esbatch.es.config as es_config
from esbatch.config import ConfigError, config_from_dict

CASES = {  # name: (overrides breaking one rule, the start of its message)
    "odd antithetic N": ({"es": {"population_size": 3, "estimator": "antithetic"}}, "es.population_size: antithetic"),
    "antithetic seeds, one-point": (
        {"es": {"estimator": "one_point", "generation_seeds": "antithetic_pairs"}},
        "es.generation_seeds: 'antithetic_pairs' needs es.estimator: antithetic",
    ),
    "inplace, center on host": ({"es": {"restore": "inplace", "master": "host"}}, "es.master: host cannot go with"),
    "inplace with diversity": (
        {"es": {"restore": "inplace", "diversity": {"every": 1}}},
        "es.diversity.every: 1 cannot run with es.restore: inplace",
    ),
    "lowrank, center on host": (
        {"es": {"perturbation": "lowrank", "master": "host"}},
        "es.perturbation: lowrank needs es.master: device",
    ),
    "lowrank inplace": (
        {"es": {"perturbation": "lowrank", "restore": "inplace"}},
        "es.perturbation: lowrank needs es.restore: exact",
    ),
    "diversity samples, greedy": (
        {"es": {"diversity": {"samples": 2, "every": 1}}, "generation": {"temperature": 0}},
        "es.diversity.samples: 2 responses per member",
    ),
}
BASES = {
    "es run": {"es": {"updates": 4}},
    "pipeline es -> grpo": {"algorithm": "pipeline", "pipeline": {"stages": ["es", "grpo"], "updates": 4}},
    "pipeline grpo -> es": {"algorithm": "pipeline", "pipeline": {"stages": ["grpo", "es"], "updates": 4}},
}


def merged(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("case", list(CASES))
def test_an_es_rule_is_enforced_in_a_run_and_in_each_pipeline(base, case):
    overrides, message = CASES[case]
    with pytest.raises(ConfigError) as e:
        config_from_dict(merged(BASES[base], overrides))
    assert any(m.startswith(message) for m in e.value.errors), e.value.errors


@pytest.mark.parametrize("base", list(BASES))
def test_the_bases_are_valid(base):
    config_from_dict(copy.deepcopy(BASES[base]))


def test_every_es_rule_has_a_case():
    tree = ast.parse(Path(es_config.__file__).read_text())
    appends = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "append"
    ]  # each `errors.append(...)` is one rule
    assert len(appends) == len(CASES)
