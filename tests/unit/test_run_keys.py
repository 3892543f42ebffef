"""A run's key (esbatch/launch/sweep.py:run_key), as a property over every key of the run config and every
built-in algorithm: changing a key outside budgets and bookkeeping (RESUME_OVERRIDABLE, run.name,
run.output_dir, tracking.*) changes the run's key, unless its section is one the algorithm does not read
(Algorithm.inert); changing a key inside them does not. So `esbatch sweep` never takes two different runs for
one, nor retrains a run whose budget or bookkeeping changed."""

from __future__ import annotations

import copy

import pytest
from config_keys import changed, field_of

from esbatch.config import RESUME_OVERRIDABLE, Config, config_from_dict
from esbatch.launch.sweep import run_key
from esbatch.schema import describe

KEYS = [k for k, *_ in describe(Config) if "[]" not in k]  # eval.tasks[].x: inside the list eval.tasks
BASES = {
    "es": {"es": {"updates": 4}, "eval": {"ks": [1, 2]}},
    "grpo": {"algorithm": "grpo", "grpo": {"updates": 4}},
    "pipeline": {"algorithm": "pipeline", "pipeline": {"stages": ["es", "grpo"], "updates": 4}},
}


def budget_or_bookkeeping(key: str) -> bool:
    return key in RESUME_OVERRIDABLE or key in ("run.name", "run.output_dir") or key.startswith("tracking.")


@pytest.mark.parametrize("algorithm", list(BASES))
@pytest.mark.parametrize("key", KEYS)
def test_every_key_outside_budgets_and_bookkeeping_changes_the_run_key(algorithm, key):
    cfg = config_from_dict(copy.deepcopy(BASES[algorithm]))
    before = run_key(cfg)
    obj, f = field_of(cfg, key)
    inert = key.split(".")[0] in cfg.inert_sections()
    # algorithm: another registered one (any name is allowed by its type, but only those can be looked up)
    value = next(a for a in BASES if a != algorithm) if key == "algorithm" else changed(getattr(obj, f.name), f)
    setattr(obj, f.name, value)
    if budget_or_bookkeeping(key) or inert:
        assert run_key(cfg) == before, (key, "inert" if inert else "budget/bookkeeping")
    else:
        assert run_key(cfg) != before, key


def test_the_algorithms_read_their_own_sections():
    """The property above would hold vacuously if every section were inert."""
    inert = {a: set(config_from_dict(copy.deepcopy(b)).inert_sections()) for a, b in BASES.items()}
    assert "es" not in inert["es"] and "grpo" in inert["es"]
    assert "grpo" not in inert["grpo"] and "es" in inert["grpo"]
    assert not {"es", "grpo", "pipeline"} & inert["pipeline"]
