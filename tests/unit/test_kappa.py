"""The Appendix E kappa diagnostic: the estimator against known variances, the SST-2 task, the CE objective
against a hand computation on the tiny model, the fixed-rollout objectives on hand-built tensors, and the
`esbatch diagnose kappa` command end to end on the tiny model."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from esbatch.cli import main
from esbatch.diagnose.kappa import kappa_stats
from esbatch.diagnose.protocol import KappaProtocol, completion_logprobs, fixed_objectives, label_ce
from esbatch.tasks import TASKS, Verdict
from esbatch.tasks.sst2 import SST2Task

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sst2_tiny.jsonl"


# ----------------------------------------------------------------------------- the estimator


def _synthetic(rng, rho: float, sigma: float, noise_sd: float, k: int = 8, n_items: int = 500, n_dirs: int = 400):
    """J(theta) = a . theta + noise at theta = +sigma eps, 0, -sigma eps; the three noises have variance
    noise_sd^2 and pairwise correlation rho (rho = 1: common random numbers, 0: independent seeds)."""
    a = rng.standard_normal(k)
    eps = rng.standard_normal((n_dirs, 1, k))  # one direction per d, shared by its items
    shared = rng.standard_normal((n_dirs, n_items))
    noise = [np.sqrt(rho) * shared + np.sqrt(1 - rho) * rng.standard_normal((n_dirs, n_items)) for _ in range(3)]
    signal = sigma * (eps @ a)  # [dirs, 1]: a . (sigma eps_d)
    plus, center, minus = signal + noise_sd * noise[0], noise_sd * noise[1], -signal + noise_sd * noise[2]
    s2 = sigma**2 * float(a @ a)  # Var[a . sigma eps] for eps ~ N(0, I)
    v = noise_sd**2
    want_base = (s2 + 2 * v * (1 - rho)) / (s2 + v)
    want_pair = (4 * s2 + 2 * v * (1 - rho)) / (s2 + v)
    return plus.ravel(), center.ravel(), minus.ravel(), want_base, want_pair


@pytest.mark.parametrize(
    "rho,sigma,noise_sd",
    [(0.0, 0.1, 1.0), (0.9, 0.1, 1.0), (0.5, 0.3, 0.5), (1.0, 0.2, 1.0), (0.0, 1.0, 1e-3)],
)
def test_kappa_recovers_known_ratios_of_a_synthetic_objective(rho, sigma, noise_sd):
    """200,000 pooled observations: the sample ratios are within 5% of the population ones (a ratio of two
    sample variances of this size has a relative sd near 0.5%, plus the direction sampling of the signal)."""
    plus, center, minus, want_base, want_pair = _synthetic(np.random.default_rng(7), rho, sigma, noise_sd)
    got = kappa_stats(plus, center, minus)
    assert got.n == plus.size == 200_000
    assert got.kappa_base == pytest.approx(want_base, rel=0.05)
    assert got.kappa_pair == pytest.approx(want_pair, rel=0.05)
    if rho == 0.0 and noise_sd == 1.0:  # weakly coupled noise: pairing doubles the raw variance
        assert got.kappa_pair > 1.5
        assert abs(got.corr_pair) < 0.05


def test_kappa_of_hand_built_lists():
    plus, center, minus = [1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]
    got = kappa_stats(plus, center, minus)
    var_p = np.var(plus, ddof=1)  # 14/3
    assert got.var_raw == pytest.approx(var_p)
    assert got.kappa_base == pytest.approx(1.0)  # J0 constant: subtracting it changes nothing
    assert got.kappa_pair == pytest.approx(1.0)
    assert math.isnan(got.corr_base)
    got = kappa_stats([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert got.kappa_base == 0.0 and got.corr_base == pytest.approx(1.0)
    assert got.kappa_pair == pytest.approx(4.0) and got.corr_pair == pytest.approx(-1.0)  # Var[2 J+] / Var[J+]
    assert math.isnan(kappa_stats([1.0, 1.0], [0.0, 1.0], [2.0, 0.0]).kappa_pair)  # constant J+: no ratio


@pytest.mark.parametrize(
    "args,msg",
    [
        (([1.0], [1.0], [1.0]), "at least 2"),
        (([1.0, 2.0], [1.0], [1.0, 2.0]), "equally long"),
        (([1.0, float("nan")], [1.0, 2.0], [1.0, 2.0]), "finite"),
    ],
)
def test_kappa_rejects_bad_observations(args, msg):
    with pytest.raises(ValueError, match=msg):
        kappa_stats(*args)


def test_protocol_defaults_are_table_13_and_bad_settings_are_named():
    p = KappaProtocol()
    assert (p.prompts, p.seeds, p.directions) == (16, 16, 4)
    assert (p.fixed_prompts, p.fixed_seeds, p.fixed_directions) == (16, 8, 4)
    assert p.sst2_examples * p.sst2_directions == 128
    assert p.sigmas == [1e-4, 1e-3, 1e-2] and p.seed_modes == ["common", "independent"]
    assert p.errors() == []
    errs = KappaProtocol(sigmas=[0.0], objectives=["regen", "fixed"], seed_modes=[], seeds=0, fixed_seeds=1).errors()
    text = " ".join(errs)
    for needle in ("--sigmas: 0.0", "--objectives: unknown 'regen'", "--seed-modes: give at least", "--seeds: 0"):
        assert needle in text, text
    assert "--fixed-seeds: 1" in text


# ----------------------------------------------------------------------------- SST-2


def test_sst2_loads_the_local_fixture_and_scores_exact_labels(tmp_path):
    task = TASKS.get("sst2")(str(FIXTURE))
    exs = task.splits(None, 2, 1, 0)
    assert [len(exs[k]) for k in ("train", "heldout", "demo")] == [9, 2, 1]
    first = exs["demo"][0]
    assert first.question == "it 's a charming and often affecting journey ." and first.answer == "positive"
    assert exs["train"][0].answer == "negative" and task.target(exs["train"][0]) == "negative"
    msgs = task.messages(exs["train"][0], [])
    assert msgs[0]["role"] == "system" and "positive or negative" in msgs[0]["content"]
    assert "unflinchingly bleak" in msgs[-1]["content"]
    ex = exs["train"][0]
    assert task.score("negative", ex) is Verdict.CORRECT
    assert task.score("  Negative.\n", ex) is Verdict.CORRECT
    assert task.score("positive", ex) is Verdict.WRONG
    assert task.score("it is negative", ex) is Verdict.MISSING  # exact label match, not a substring search
    # the same rows from parquet
    import datasets

    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "sst2.parquet"))
    again = SST2Task(str(tmp_path / "sst2.parquet")).eval_examples(None)
    assert [e.answer for e in again] == [("negative", "positive")[r["label"]] for r in rows]


def test_sst2_reads_the_hub_id_and_its_splits(monkeypatch):
    import datasets

    calls = []

    def fake_load(path, name=None, split=None, revision=None, **kw):
        calls.append((path, name, split))
        return [{"idx": 0, "sentence": f"{split} row", "label": 1}, {"idx": 1, "sentence": "bad", "label": 0}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    sp = SST2Task().splits(1, 1, 0, 0)
    assert ("stanfordnlp/sst2", None, "train") in calls and ("stanfordnlp/sst2", None, "validation") in calls
    assert sp["train"][0].question == "train row" and sp["heldout"][0].question == "validation row"


@pytest.mark.parametrize(
    "row,msg",
    [({"sentence": "x", "label": -1}, "test split hides"), ({"text": "x", "label": 1}, "lacks the 'sentence'")],
)
def test_sst2_bad_rows_name_the_problem(tmp_path, row, msg):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=msg):
        SST2Task(str(bad)).eval_examples(None)


# ----------------------------------------------------------------------------- objectives


def test_label_ce_matches_a_log_softmax_by_hand(tiny_backend_factory):
    backend = tiny_backend_factory()
    model, tok = backend.model, backend.tok
    task = SST2Task(str(FIXTURE))
    exs = task.eval_examples(3)
    pairs = []
    for ex in exs:
        p = tok(backend.chat_prompt(task.messages(ex, [])), add_special_tokens=False)["input_ids"]
        pairs.append((p, tok(task.target(ex), add_special_tokens=False)["input_ids"]))
    assert len({len(p) for p, _ in pairs}) == 3  # different lengths: the batch is padded
    got = label_ce(model, pairs, batch_size=2)
    for (p, y), ce in zip(pairs, got):
        with torch.no_grad():
            z = model(input_ids=torch.tensor([p + y])).logits[0].double()
        want = 0.0
        for t, tok_id in enumerate(y):
            row = z[len(p) - 1 + t]
            want -= float(row[tok_id] - torch.log(torch.exp(row - row.max()).sum()) - row.max())
        assert ce == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert ce > 0


def test_fixed_objectives_on_hand_built_log_probs():
    old = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    same = fixed_objectives(old, old, [0.5, -2.0], 0.2, None)
    assert same["fixed-logprob"] == pytest.approx([-1.5, -0.5])
    assert same["fixed-seqloss"] == pytest.approx([3.0, 0.5])
    assert same["fixed-grpo"] == pytest.approx([-0.5, 2.0])  # ratio 1: -A
    moved = [old[0] + math.log(1.5), old[1] + math.log(0.5)]  # ratios 1.5 (A > 0) and 0.5 (A < 0): both clipped
    got = fixed_objectives(moved, old, [1.0, -1.0], 0.2, None)
    assert got["fixed-grpo"] == pytest.approx([-1.2, 0.8])
    assert completion_logprobs is not None


# ----------------------------------------------------------------------------- the command


def _config(tmp_path, model_dir, **extra) -> Path:
    from toy import toy_config

    cfg = toy_config(model_dir, es_updates=1, **extra)  # a valid run config; the diagnostic ignores the budget
    cfg["run"]["output_dir"] = str(tmp_path / "runs")
    path = tmp_path / "kappa.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


TINY = [
    "--sigmas", "1e-7", "0.05",
    "--prompts", "3", "--seeds", "2", "--directions", "2",
    "--fixed-prompts", "2", "--fixed-seeds", "3", "--fixed-directions", "2",
    "--sst2-examples", "4", "--sst2-directions", "2",
    "--supervised-data", str(FIXTURE), "--no-progress",
]  # fmt: skip


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--sigmas", "0"], "--sigmas: 0.0 is not a positive"),
        (["--objectives", "reward"], "--objectives: unknown 'reward'; valid: regenerated, sst2-ce, fixed"),
        (["--supervised-data", "/nope.jsonl"], "--supervised-data /nope.jsonl: no such file"),
        (["--set", "backend.name=vllm"], "backend.name: vllm cannot run objectives fixed, sst2-ce"),
        (["--prompts", "500", "--objectives", "regenerated"], "--prompts 500 > generation.batch_size 8"),
        (["--prompts", "8", "--set", "task.params.size=5", "--objectives", "regenerated"], "needs 8 prompts"),
    ],
)
def test_diagnose_kappa_bad_input_exits_2(tmp_path, tiny_model_dir, capsys, extra, msg):
    rc = main(["diagnose", "kappa", str(_config(tmp_path, tiny_model_dir)), "--no-progress", *extra])
    assert rc == 2
    assert msg in capsys.readouterr().err


def test_diagnose_kappa_bad_sst2_file_exits_2(tmp_path, tiny_model_dir, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"sentence": "fine", "label": 7}\n' * 3)
    args = ["--objectives", "sst2-ce", "--sst2-examples", "2", "--supervised-data", str(bad), "--no-progress"]
    rc = main(["diagnose", "kappa", str(_config(tmp_path, tiny_model_dir)), *args])
    assert rc == 2
    assert "SST-2 label 7 is not 0 (negative) or 1 (positive)" in capsys.readouterr().err
