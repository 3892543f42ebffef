"""`esbatch analyze diversity`: run folders whose log.jsonl holds the records the trainers write (ES records from
es_step on a stub backend, GRPO records in the trainer's format) -> CSV, Markdown and PNG with values checked by
hand; pipelines on one update axis; and the bad inputs each named with exit code 2."""

import csv
import json
import math

import pytest
import yaml
from test_diversity import StubBackend, _cfg

from esbatch.analyze.diversity import member_interval
from esbatch.cli import main
from esbatch.es.core import draw_population
from esbatch.es.trainer import es_step
from esbatch.metrics import leave_one_out, weight_covariance
from esbatch.train.problems import load_problems
from esbatch.train.rundir import RunDir

LN2 = math.log(2)


def _folder(path, algorithm, records):
    rd = RunDir(path)
    rd.path.mkdir(parents=True)
    rd.config.write_text(yaml.safe_dump({"algorithm": algorithm}))
    rd.write_meta(algorithm=algorithm)
    for r in records:
        rd.append_update(r)
    return rd.path


def _es_run(path, updates=3, every=2):
    """A run folder with the records es_step writes (stub answers: see test_diversity.StubBackend)."""
    cfg = _cfg(diversity={"every": every, "samples": 3})
    recs = []
    for t in range(updates):
        members = draw_population(cfg.run.seed, t, 4, "one_point", "independent")
        b = StubBackend({m.seed: i for i, m in enumerate(members)})
        recs.append(json.loads(json.dumps(es_step(cfg, b, load_problems(cfg, b), t))))  # as log.jsonl holds it
    return _folder(path, "es", recs)


def _grpo_run(path, shares):
    recs = [
        {"t": t, "metrics": {"reward/mean": 0.0}, "diversity": {"p": [p], "batch": [0, 1], "samples": 4}}
        for t, p in enumerate(shares)
    ]
    return _folder(path, "grpo", recs)


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_es_and_grpo_runs_tabulated_and_plotted(tmp_path, capsys):
    es = _es_run(tmp_path / "es-run")
    grpo = _grpo_run(tmp_path / "grpo-run", [[0.5, 1.0], [0.25, 0.0]])
    assert main(["analyze", "diversity", str(es), str(grpo)]) == 0
    out = es / "analysis" / "diversity"
    assert capsys.readouterr().out.split() == [str(out / f) for f in ("diversity.csv", "diversity.md", "diversity.png")]
    rows = _csv(out / "diversity.csv")
    assert [(r["run"], r["algorithm"], r["t"]) for r in rows] == [
        ("es-run", "es", "0"),  # every 2: updates 0 and 2 of 3
        ("es-run", "es", "2"),
        ("grpo-run", "grpo", "0"),
        ("grpo-run", "grpo", "1"),
    ]
    # ES: the stub's p (test_diversity): per prompt pbar = (1/3 + 0 + 1 + 2/3) / 4 = 1/2 on prompts 0 and 2, and
    # (0 + 1/3 + 2/3 + 1) / 4 = 1/2 on prompt 1; members' entropies H(1/3) twice, 0 twice per prompt
    h3 = -(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3))
    assert float(rows[0]["js"]) == pytest.approx(LN2 - h3 / 2)
    assert float(rows[0]["p_mean"]) == pytest.approx(0.5)
    assert (rows[0]["members"], rows[0]["prompts"], rows[0]["samples"]) == ("4", "3", "3")
    assert rows[0]["cov_weight"] != ""
    # leave-one-out: recomputed from the record's p, first and z, inside its member-bootstrap interval
    rec = RunDir(es).updates()[0]
    loo = leave_one_out(rec["diversity"]["p"], rec["diversity"]["first"], 3)
    want = weight_covariance(rec["z"], loo)
    assert float(rows[0]["cov_weight_loo"]) == pytest.approx(want, abs=1e-12)
    assert float(rows[0]["cov_loo_low"]) <= want <= float(rows[0]["cov_loo_high"])
    assert rows[2]["cov_weight_loo"] == rows[2]["cov_loo_low"] == ""  # GRPO: no update weights
    # GRPO: one policy -> js 0, p_mean the mean share, h_members the mean Bernoulli entropy, no cov
    assert float(rows[2]["js"]) == 0.0 and float(rows[2]["p_mean"]) == pytest.approx(0.75)
    assert float(rows[2]["h_members"]) == pytest.approx(LN2 / 2)
    assert rows[2]["cov_weight"] == "" and rows[3]["members"] == "1"
    md = (out / "diversity.md").read_text()
    assert "| es-run | es | 2 (t 0..2) | 4 x 3 x 3 |" in md and "| grpo-run | grpo | 2 (t 0..1) | 1 x 2 x 4 |" in md
    assert "0.7500 -> 0.1250 (0.4375)" in md  # GRPO p_mean: first -> last (mean)
    lo, hi = member_interval(
        [
            (r["z"], leave_one_out(r["diversity"]["p"], r["diversity"]["first"], 3))
            for r in RunDir(es).updates()
            if "diversity" in r
        ]
    )
    assert f" [{lo:.4f}, {hi:.4f}])" in md  # ES cov_weight_loo: the run's mean with its pooled interval
    png = (out / "diversity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_every_panel_ticks_whole_updates_only(tmp_path):
    """The Cov panel holds ES's few updates alone; matplotlib's default locator put ticks at 0.5, 1.5, ..."""
    import matplotlib.pyplot as plt

    from esbatch.analyze.diversity import collect, figure

    es = _es_run(tmp_path / "es-run")
    grpo = _grpo_run(tmp_path / "grpo-run", [[0.5, 1.0], [0.25, 0.0]])
    fig = figure(collect([es, grpo]))
    try:
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    finally:
        plt.close(fig)


def test_pipeline_stages_follow_each_other_and_out_is_honoured(tmp_path):
    root = tmp_path / "pipe"
    RunDir(root).path.mkdir()
    RunDir(root).config.write_text(yaml.safe_dump({"algorithm": "pipeline"}))
    _es_run(root / "stage1-es", updates=3, every=1)
    _grpo_run(root / "stage2-grpo", [[1.0, 0.0]])
    out = tmp_path / "elsewhere"
    assert main(["analyze", "diversity", str(root), "--out", str(out)]) == 0
    rows = _csv(out / "diversity.csv")
    assert [(r["run"], r["t"]) for r in rows] == [
        ("pipe/stage1-es", "0"),
        ("pipe/stage1-es", "1"),
        ("pipe/stage1-es", "2"),
        ("pipe/stage2-grpo", "3"),  # after the ES stage's 3 updates
    ]
    assert not (root / "analysis").exists()


def test_runs_of_the_same_name_are_kept_apart(tmp_path):
    a = _grpo_run(tmp_path / "a" / "run", [[0.5, 0.5]])
    b = _grpo_run(tmp_path / "b" / "run", [[1.0, 1.0]])
    assert main(["analyze", "diversity", str(a), str(b)]) == 0
    assert [r["run"] for r in _csv(a / "analysis" / "diversity" / "diversity.csv")] == ["run#1", "run#2"]


def test_bad_inputs_exit_2_naming_the_problem(tmp_path, capsys):
    def err(*runs):
        assert main(["analyze", "diversity", *map(str, runs)]) == 2
        return capsys.readouterr().err

    assert "not a run folder (no config.yaml)" in err(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    assert "not a run folder" in err(tmp_path / "file")
    plain = _folder(tmp_path / "plain", "es", [{"t": 0, "metrics": {}}])
    msg = err(plain)
    assert "no update in plain carries a `diversity` record" in msg and "es.diversity.every" in msg
    bad = _grpo_run(tmp_path / "bad", [[0.5, 1.5]])
    msg = err(bad)
    assert "log.jsonl: the diversity record of update 0 does not add up" in msg and "outside [0, 1]" in msg
    ragged = _folder(tmp_path / "ragged", "es", [{"t": 0, "z": [1, -1], "diversity": {"p": [[1.0], [0.0, 1.0]]}}])
    assert "ragged" in err(ragged)
    nop = _folder(tmp_path / "nop", "es", [{"t": 0, "diversity": [0.5]}])
    assert "not a mapping with a `p` table" in err(nop)
    wrong_z = _folder(tmp_path / "wrongz", "es", [{"t": 0, "z": [1.0], "diversity": {"p": [[1.0], [0.0]]}}])
    assert "1 weights but p has 2 members" in err(wrong_z)


def test_analyze_without_analysis_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["analyze"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["analyze", "diversity"])
    assert e.value.code == 2


def test_a_run_without_records_is_left_out_and_named_while_the_others_are_analysed(tmp_path, capsys):
    with_records = _grpo_run(tmp_path / "g", [[0.5, 0.5]])
    plain = _folder(tmp_path / "plain", "es", [{"t": 0, "metrics": {}}])
    assert main(["analyze", "diversity", str(with_records), str(plain), "--out", str(tmp_path / "out")]) == 0
    assert "warning: left out, no diversity record: plain" in capsys.readouterr().err
    assert [r["run"] for r in _csv(tmp_path / "out" / "diversity.csv")] == ["g"]
    md = (tmp_path / "out" / "diversity.md").read_text()
    assert "| g | grpo |" in md and "Left out, no update carries a `diversity` record: plain." in md


def test_member_interval_is_a_point_when_every_member_succeeds_alike_and_brackets_the_mean():
    same = ([1.0, -1.0, 0.5], [[0.5, 0.25]] * 3)
    assert member_interval([same]) == (0.0, 0.0)  # every resample: Cov = 0
    z, p = [2.0, -1.0, 0.0, -1.0], [[1.0], [0.0], [0.5], [0.0]]
    lo, hi = member_interval([(z, p)])
    assert lo <= weight_covariance(z, p) <= hi and lo < hi
