"""`esbatch diagnose kappa` end to end on the tiny model: every objective's table, plot and observations (moved
from tests/unit/test_kappa.py, issue 40: it generates and scores for seconds). kappa's math on hand-built and
synthetic observations stays in the fast tier."""

import csv
import json

import pytest
from unit.test_kappa import FIXTURE, TINY, _config

from esbatch.cli import main
from esbatch.diagnose.protocol import label_ce
from esbatch.tasks.sst2 import SST2Task


def test_diagnose_kappa_end_to_end_on_the_tiny_model(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "out"
    rc = main(["diagnose", "kappa", str(_config(tmp_path, tiny_model_dir)), *TINY, "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    for name in ("kappa.csv", "kappa.md", "kappa.png", "observations.csv", "config.yaml", "protocol.json"):
        assert (out / name).stat().st_size > 0, name
    table = {(r["objective"], r["coupling"], float(r["sigma"])): r for r in csv.DictReader((out / "kappa.csv").open())}
    objectives = {"regenerated", "sst2-ce", "fixed-logprob", "fixed-seqloss", "fixed-grpo"}
    assert {k[0] for k in table} == objectives and len(table) == 2 * (2 + 1 + 3)
    assert int(table[("regenerated", "common", 0.05)]["n"]) == 3 * 2 * 2
    assert int(table[("sst2-ce", "fixed batch", 0.05)]["n"]) == 4 * 2
    assert int(table[("fixed-grpo", "fixed rollouts", 0.05)]["n"]) == 2 * 3 * 2
    obs = list(csv.DictReader((out / "observations.csv").open()))

    def cell(objective, coupling, sigma):
        return [r for r in obs if r["objective"] == objective and r["coupling"] == coupling and r["sigma"] == sigma]

    # common seeds at a scale fp32 sampling cannot notice: the same responses at all three points, so both
    # differences vanish; independent seeds regenerate different responses
    tiny_common = cell("regenerated", "common", "1e-07")
    assert all(r["plus"] == r["center"] == r["minus"] for r in tiny_common)
    assert float(table[("regenerated", "common", 1e-7)]["var_pair"]) == 0.0
    assert any(r["plus"] != r["minus"] for r in cell("regenerated", "independent", "1e-07"))
    # the frozen rollouts' GRPO surrogate at theta is -A (ratio 1); the CE is a positive scalar that moves with sigma
    big = cell("sst2-ce", "fixed batch", "0.05")
    assert all(float(r["center"]) > 0 for r in big) and any(r["plus"] != r["center"] for r in big)
    grpo = cell("fixed-grpo", "fixed rollouts", "0.05")
    assert abs(sum(float(r["center"]) for r in grpo)) < 1e-5  # advantages are centred per prompt
    # the CE of the first example at theta equals the hand computation's function on the same model
    from esbatch.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")
    task = SST2Task(str(FIXTURE))
    ex = task.splits(4, 0, 0, 0)["train"][0]
    p = tok(tok.apply_chat_template(task.messages(ex, []), tokenize=False, add_generation_prompt=True))["input_ids"]
    want = label_ce(model, [(p, tok(ex.answer, add_special_tokens=False)["input_ids"])], 1)[0]
    first = next(r for r in big if r["item"] == "0")
    assert float(first["center"]) == pytest.approx(want, rel=1e-6)
    assert "kappa_pair" in (out / "kappa.md").read_text()
    assert json.loads((out / "protocol.json").read_text())["seeds"] == 2
