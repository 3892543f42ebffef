"""In-training evaluation on other tasks (paper Figure 2(a-b)), `esbatch center` and GRPO snapshots, end to end
on the tiny model: evals log eval/<label>/... without moving the ES center by a bit, any ES center is rebuilt
bit for bit from theta_0 and the seed log, and GRPO keeps evaluable snapshots."""

import json
import shutil
from pathlib import Path

import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors import safe_open
from safetensors.torch import load_file
from toy import run_esbatch, toy_config

TASK_EVAL = {
    "every": 1,
    "tasks": [{"name": "toy:DigitTask", "label": "Digits", "params": {"size": 8}, "limit": 3, "few_shot": 1}],
    "samples": 4,
    "temperature": 1.0,
    "ks": [2, 4],
}


def train(tmp: Path, model_dir: Path, name: str, *extra: str, **sections) -> Path:
    cfg = toy_config(
        model_dir,
        run={"name": name, "seed": 3, "output_dir": str(tmp / "runs"), "threads": 1},
        tracking={"experiment": "intrain"},
        **sections,
    )
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = run_esbatch("train", str(path), "--no-progress", *extra)
    assert p.returncode == 0, p.stdout + p.stderr
    return tmp / "runs" / name


def resume(rd: Path, *sets: str) -> None:
    p = run_esbatch("train", "--resume", str(rd), "--no-progress", *[a for s in sets for a in ("--set", s)])
    assert p.returncode == 0, p.stdout + p.stderr


def same_center(a: Path, b: Path) -> None:
    sa, sb = load_file(a), load_file(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def center(capsys, *args: str) -> tuple[int, str]:
    """`esbatch center ARGS` in this process (the CLI's own main(): its exit code and stderr), not a subprocess that
    imports torch, transformers and mlflow again for a replay of milliseconds; the training runs are subprocesses."""
    from esbatch.cli import main

    capsys.readouterr()
    rc = main(["center", *args])
    return rc, capsys.readouterr().err


def t_of(path: Path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return int(f.metadata()["t"])


def evals(rd: Path) -> list[dict]:
    return [json.loads(line) for line in (rd / "eval.jsonl").read_text().splitlines()]


def test_es_in_training_evals_leave_the_center_alone_and_center_rebuilds_it(tmp_path, tiny_model_dir, capsys):
    # with task evals every update, killed-free but resumed after 1 update (evals at t=0, 1 before, 2 after)
    with_evals = train(tmp_path, tiny_model_dir, "evals", es_updates=1, eval=TASK_EVAL, checkpoint={"every": 1})
    at1 = tmp_path / "center-at-1.safetensors"
    shutil.copyfile(with_evals / "center.safetensors", at1)
    resume(with_evals, "es.updates=2")
    plain = train(tmp_path, tiny_model_dir, "plain", es_updates=2, eval={"every": 0})

    # the evals did not perturb training: same rewards, same center bit for bit
    rewards = [
        [json.loads(x)["rewards"] for x in (rd / "log.jsonl").read_text().splitlines()] for rd in (with_evals, plain)
    ]
    assert rewards[0] == rewards[1]
    same_center(with_evals / "center.safetensors", plain / "center.safetensors")

    # every evaluation logged the task's metrics next to the held-out ones, in eval.jsonl and MLflow
    ev = evals(with_evals)
    assert [e["t"] for e in ev] == [0, 1, 2]
    names = {"pass_at_1", "pass_at_2", "pass_at_4", "maj_at_2", "maj_at_4", "entropy", "format"}
    for e in ev:
        assert {f"eval/Digits/{n}" for n in names} <= e.keys() and "heldout/accuracy" in e
        assert 0 <= e["eval/Digits/pass_at_1"] <= e["eval/Digits/pass_at_2"] <= e["eval/Digits/pass_at_4"] <= 1
        assert e["eval/Digits/entropy"] > 0
    assert all("eval/" not in k for e in evals(plain) for k in e)  # no tasks: today's evaluation only
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    run_id = json.loads((with_evals / "run.json").read_text())["mlflow_run_id"]
    hist = client.get_metric_history(run_id, "eval/Digits/pass_at_4")
    assert sorted(h.step for h in hist) == [0, 1, 2]
    assert {h.step: h.value for h in hist} == {e["t"]: e["eval/Digits/pass_at_4"] for e in ev}

    # esbatch center: theta_0, the center after 1 update (saved before the resume) and after 2, bit for bit
    for t, saved in ((1, at1), (2, plain / "center.safetensors")):
        out = tmp_path / f"rebuilt-{t}.safetensors"
        rc, err = center(capsys, str(plain), "--at", str(t), "--out", str(out))
        assert rc == 0, err
        same_center(out, saved)
        assert t_of(out) == t
    rc, err = center(capsys, str(plain), "--at", "0")  # default: the run's snapshots folder
    assert rc == 0, err
    theta0 = load_file(plain / "snapshots" / "center-0.safetensors")
    from esbatch.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")
    params = dict(model.named_parameters())
    assert theta0.keys() == params.keys() and all(torch.equal(theta0[k], params[k].detach()) for k in params)
    rc, err = center(capsys, str(plain), "--at", "5")
    assert rc == 2 and "log.jsonl records 2 update(s) (the last is update 1)" in err, err
    assert "--at 2" in err


def test_grpo_snapshots_and_in_training_evals(tmp_path, tiny_model_dir, capsys):
    rd = train(
        tmp_path,
        tiny_model_dir,
        "grpo",
        algorithm="grpo",
        grpo={"group_size": 4, "batch_size": 4, "learning_rate": 1e-3, "updates": 2},
        eval={**TASK_EVAL, "every": 0},
        checkpoint={"every": 5, "snapshots": [1]},
        es=None,
    )
    snap = rd / "snapshots" / "center-1.safetensors"
    assert t_of(snap) == 1 and t_of(rd / "center.safetensors") == 2
    a, b = load_file(snap), load_file(rd / "center.safetensors")
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)  # a center of its own
    assert [e["t"] for e in evals(rd)] == [0, 2] and all("eval/Digits/pass_at_4" in e for e in evals(rd))

    out = tmp_path / "g1.safetensors"
    rc, err = center(capsys, str(rd), "--at", "1", "--out", str(out))
    assert rc == 0, err
    same_center(out, snap)
    rc, err = center(capsys, str(rd), "--at", "0")
    assert rc == 2 and "GRPO centers come from snapshots" in err and "[1]" in err, err

    # esbatch eval takes the snapshot (--at T) like a final center
    ecfg = {
        "name": "snap1",
        "output_dir": str(tmp_path / "evals"),
        "sampling": {"n": 2, "temperature": 1.0, "max_new_tokens": 4, "batch_size": 8},
        "ks": [1, 2],
        "tasks": [{"name": "toy:DigitTask", "limit": 2}],
    }
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(ecfg))
    p = run_esbatch("eval", str(tmp_path / "e.yaml"), "--checkpoint", str(rd), "--at", "1", "--no-progress")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "center after update 1" in p.stdout
