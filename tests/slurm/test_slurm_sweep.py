"""`esbatch sweep` against a real SLURM cluster (sbatch arrays through submitit, sacct, requeue).

The sweeps are the shipped CPU quickstart shrunk to the tiny test model and toy task, so each task
takes seconds. sbatch is wrapped by a counting shim to prove one array job per sweep.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from gate import Gate
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from toy import gated, toy_config

ROOT = Path(__file__).resolve().parents[2]
# the one cluster: its fixture starts it once per session, and one xdist worker runs every test using it
pytestmark = [pytest.mark.usefixtures("slurm_cluster"), pytest.mark.xdist_group("slurm")]


def tiny_base(tmp: Path, model_dir: Path, updates: int = 4, gate: str = "", gate_update: int = 0) -> Path:
    """The toy run every SLURM test sweeps; with ``gate``, each task's scorer waits there inside ``gate_update``."""
    cfg = toy_config(model_dir, es_updates=updates, eval={"every": 2}, checkpoint={"every": 2})
    if gate:
        cfg = gated(cfg, gate, gate_update)
    p = tmp / "tiny-base.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def shrunk_quickstart(
    tmp: Path, model_dir: Path, name: str, updates: int = 4, gate: str = "", gate_update: int = 0, **changes
) -> Path:
    """sweeps/quickstart.yaml with the tiny model/toy task and the slurm-local launcher."""
    sweep = yaml.safe_load((ROOT / "sweeps/quickstart.yaml").read_text())
    sweep.update(
        name=name,
        base=str(tiny_base(tmp, model_dir, updates, gate, gate_update)),
        output_dir=str(tmp / "out"),
        launcher="slurm-local",
        launcher_overrides={"mem": "1000M"},
    )
    sweep.pop("config")
    sweep.update(changes)
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(sweep, sort_keys=False))
    return p


def cli(tmp: Path, *args: str, timeout: int = 600) -> tuple[str, int]:
    """Run `esbatch ARGS` with sbatch wrapped by a shim that counts calls; returns (output, sbatch calls)."""
    shim = tmp / "bin"
    shim.mkdir(exist_ok=True)
    count = tmp / "sbatch-calls"
    (shim / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {count}\nexec /usr/bin/sbatch "$@"\n')
    (shim / "sbatch").chmod(0o755)
    before = len(count.read_text().splitlines()) if count.exists() else 0
    env = {
        **os.environ,
        "PATH": f"{shim}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "tests"),
        "OMP_NUM_THREADS": "1",
    }
    p = subprocess.run(
        [sys.executable, "-m", "esbatch", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    after = len(count.read_text().splitlines()) if count.exists() else 0
    return out, after - before


def sacct_state(job: str) -> str:
    out = subprocess.run(["sacct", "-X", "-n", "-P", "--format=State", "-j", job], capture_output=True, text=True)
    return (out.stdout.split() or ["?"])[0]


def wait_for(cond, timeout: float, what: str, every: float = 1.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_sweep(sweep_dir: Path, timeout: float = 1800) -> dict:
    """Until every array task and the aggregator job have ended. ``timeout`` is a safety limit only (a sweep here
    takes minutes; a loaded machine, several): the tests assert what happened, never how fast."""
    meta = json.loads((sweep_dir / "sweep.json").read_text())
    jobs = [s["job_id"] for s in meta["submissions"]] + [
        s["aggregate_job"] for s in meta["submissions"] if s.get("aggregate_job")
    ]

    def ended():
        out = subprocess.run(
            ["sacct", "-X", "-n", "-P", "--format=JobID,State", "-j", ",".join(jobs)], capture_output=True, text=True
        ).stdout
        states = [ln.split("|")[1] for ln in out.splitlines() if ln]
        busy = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING"}
        return states and not any(s.split()[0] in busy for s in states)

    wait_for(ended, timeout, f"jobs {jobs}", every=2)
    return meta


def children(sweep_dir: Path, name: str):
    client = MlflowClient(f"sqlite:///{sweep_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("esbatch.role") == "parent"]
    kids = [r for r in runs if r.data.tags.get("esbatch.role") != "parent"]
    return client, parents, kids


def test_quickstart_sweep_runs_as_one_array_and_aggregates(tmp_path, tiny_model_dir):
    path = shrunk_quickstart(tmp_path, tiny_model_dir, "qs")
    out, calls = cli(tmp_path, "sweep", str(path))
    assert calls == 2, out  # one array job for all runs + the afterok aggregator job
    sweep_dir = tmp_path / "out" / "qs"
    meta = wait_sweep(sweep_dir)
    (sub,) = meta["submissions"]
    assert len(sub["keys"]) == 2 and sub["aggregate_job"]
    assert sacct_state(sub["aggregate_job"]) == "COMPLETED"
    script = next((sweep_dir / "slurm").glob(f"{sub['job_id']}*/*submission.sh")).read_text()
    assert "#SBATCH --array=0-1%2" in script and "#SBATCH --signal=USR2@60" in script

    client, (parent,), kids = children(sweep_dir, "qs")
    assert parent.data.tags["slurm.array_job_ids"] == sub["job_id"] and parent.info.status == "FINISHED"
    assert len(kids) == 2 and all(k.info.status == "FINISHED" for k in kids)
    for k in kids:
        t = k.data.tags
        assert t["mlflow.parentRunId"] == parent.info.run_id
        assert (
            t["slurm.array_job_id"] == sub["job_id"] and t["slurm.node"] and t["slurm.job_id"].startswith(sub["job_id"])
        )
        assert sub["keys"][int(t["slurm.array_index"])] == t["esbatch.run_key"]
        steps = [m.step for m in client.get_metric_history(k.info.run_id, "reward/mean")]
        assert sorted(steps) == [1, 2, 3, 4]
    # the aggregator job wrote the population table and plots, also as parent-run artifacts
    table = (sweep_dir / "results" / "popsize_table.md").read_text()
    assert "population_size=4" in table and "population_size=8" in table
    assert (sweep_dir / "results" / "reward_by_N.png").stat().st_size > 5000
    arts = {a.path for a in client.list_artifacts(parent.info.run_id, "results")}
    assert {"results/popsize_table.csv", "results/popsize_table.md", "results/reward_by_N.png"} <= arts

    # re-running the finished sweep submits nothing and creates no MLflow run
    out, calls = cli(tmp_path, "sweep", str(path))
    assert calls == 0 and "skipping 2 finished" in out and "nothing to submit" in out
    _, parents2, kids2 = children(sweep_dir, "qs")
    assert len(parents2) == 1 and len(kids2) == 2
    out, _ = cli(tmp_path, "status", str(sweep_dir))
    assert out.count("finished") >= 2 and "4/4" in out and f"{sub['job_id']}_0" in out


def test_max_array_size_is_read_from_the_cluster():
    from esbatch.launch.slurm import max_array_size

    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    want = next(int(ln.split("=")[1]) for ln in out.splitlines() if ln.startswith("MaxArraySize"))
    assert max_array_size() == want == 1001  # the start script keeps SLURM's default


def test_time_limit_signal_requeues_and_resumes_bit_exact(tmp_path, tiny_model_dir):
    """SLURM's time-limit warning (USR2) reaches the task while it waits at a gate inside update 3: it finishes
    that update, stops, requeues itself (submitit), and the restart trains on to the uninterrupted center."""
    with Gate() as g:
        path = shrunk_quickstart(
            tmp_path, tiny_model_dir, "rq", updates=6, gate=g.path, gate_update=3,
            grid={"es.population_size": [4]}, aggregate=None,
        )  # fmt: skip
        cli(tmp_path, "sweep", str(path))
        sweep_dir = tmp_path / "out" / "rq"
        meta = json.loads((sweep_dir / "sweep.json").read_text())
        (key,) = meta["submissions"][0]["keys"]
        sub = meta["submissions"][0]
        job = sub["job_id"]  # one run: submitit makes it a plain job, not a one-element array
        assert sub["array"] is False
        (tag,) = g.arrivals(1)
        assert tag.split()[1] == job
        # what SLURM sends signal_delay_s before the time limit (submitit's job._interrupt(timeout=True))
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        g.release(stopped=True)
    wait_sweep(sweep_dir)
    log = sweep_dir / "runs" / key / "log.jsonl"
    assert len(log.read_text().splitlines()) == 6
    first = next((sweep_dir / "slurm").glob(f"{job}*/*_log.err")).read_text()
    assert "SIGUSR2: stopping after the current update" in first, first[-2000:]
    _, _, (kid,) = children(sweep_dir, "rq")  # one MLflow run across the requeue
    assert kid.info.status == "FINISHED" and kid.data.tags["slurm.restarts"] == "1"
    steps = sorted(m.step for m in children(sweep_dir, "rq")[0].get_metric_history(kid.info.run_id, "reward/mean"))
    assert steps == list(range(1, 7))  # update 3 logged once, before the stop; the restart began at update 4

    # an uninterrupted run of the same config (same key) through the same task code, locally
    ref = tmp_path / "ref.yaml"
    ref.write_text(path.read_text().replace(str(tmp_path / "out"), str(tmp_path / "ref")))
    cli(tmp_path, "sweep", str(ref), "--launcher", "local")
    a = load_file(str(sweep_dir / "runs" / key / "center.safetensors"))
    b = load_file(str(tmp_path / "ref" / "rq" / "runs" / key / "center.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sixteen_concurrent_tasks_lose_no_mlflow_data(tmp_path, tiny_model_dir):
    """16 array tasks at once, all logging into ONE sqlite store: every run, step and artifact arrives."""
    path = shrunk_quickstart(
        tmp_path,
        tiny_model_dir,
        "c16",
        updates=3,
        grid={"run.seed": list(range(16))},
        launcher_overrides={"mem": "1000M", "array_parallelism": 16},
        aggregate=None,
    )
    out, calls = cli(tmp_path, "sweep", str(path))
    assert calls == 2, out
    sweep_dir = tmp_path / "out" / "c16"
    wait_sweep(sweep_dir)
    client, (parent,), kids = children(sweep_dir, "c16")
    assert len(kids) == 16 and all(k.info.status == "FINISHED" for k in kids)
    for k in kids:
        for m in ("reward/mean", "update/l2", "time/generation_s"):
            assert sorted(x.step for x in client.get_metric_history(k.info.run_id, m)) == [1, 2, 3], m
        assert sorted(x.step for x in client.get_metric_history(k.info.run_id, "heldout/accuracy")) == [0, 2, 3]
        assert {"config.yaml", "log.jsonl", "eval.jsonl"} <= {a.path for a in client.list_artifacts(k.info.run_id)}
    # they really ran at the same time: all 16 SLURM tasks were running at one instant (sacct), and
    # most of their MLflow runs were open (logging) at one instant too
    meta = json.loads((sweep_dir / "sweep.json").read_text())
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "--format=JobID,Start,End", "-j", meta["submissions"][0]["job_id"]],
        capture_output=True,
        text=True,
    ).stdout
    spans = [ln.split("|")[1:] for ln in out.splitlines() if "_" in ln.split("|")[0]]
    assert len(spans) == 16 and peak_overlap(spans) == 16
    assert peak_overlap([(k.info.start_time, k.info.end_time) for k in kids]) >= 8


def peak_overlap(spans) -> int:
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    live, peak = 0, 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def test_offline_stores_merge_once_and_arrays_split(tmp_path, tiny_model_dir):
    """tracking: offline (no shared store on compute nodes) + max_array_size 2 (3 runs -> 2 array jobs)."""
    path = shrunk_quickstart(
        tmp_path,
        tiny_model_dir,
        "off",
        updates=2,
        grid={"es.population_size": [2, 4, 6]},
        launcher_overrides={"mem": "1000M", "tracking": "offline", "max_array_size": 2},
        aggregate=[{"kind": "scaling", "name": "popsize_table", "cols": "es.population_size", "reference": 6}],
    )
    out, calls = cli(tmp_path, "sweep", str(path), "--wait")  # --wait: returns when the aggregator is done
    assert calls == 3, out  # two arrays (2 + 1 tasks) and the aggregator, which waits on both
    sweep_dir = tmp_path / "out" / "off"
    assert "aggregator job" in out and ": COMPLETED" in out and "3 runs: 3 finished" in out, out
    assert f"results: {sweep_dir / 'results'}" in out
    meta = json.loads((sweep_dir / "sweep.json").read_text())
    assert [len(s["keys"]) for s in meta["submissions"]] == [2, 1]
    for key in sum((s["keys"] for s in meta["submissions"]), []):
        assert (sweep_dir / "runs" / key / "mlflow.db").exists()  # each task wrote its own store
    client, (parent,), kids = children(sweep_dir, "off")
    assert len(kids) == 3 and all(k.data.tags["mlflow.parentRunId"] == parent.info.run_id for k in kids)
    hist = {k.info.run_id: len(client.get_metric_history(k.info.run_id, "reward/mean")) for k in kids}
    assert set(hist.values()) == {2}
    cli(tmp_path, "aggregate", str(sweep_dir))  # merging again adds nothing
    client, _, kids2 = children(sweep_dir, "off")
    assert {k.info.run_id for k in kids2} == set(hist)
    assert {r: len(client.get_metric_history(r, "reward/mean")) for r in hist} == hist
    assert "population_size=6" in (sweep_dir / "results" / "popsize_table.md").read_text()


def sweep_two_tasks(tmp: Path, name: str, base: Path) -> tuple[Path, str]:
    """One run of ``base`` as a 2-task SLURM job; returns (sweep folder, run key) once it has finished."""
    sweep = {
        "name": name,
        "base": str(base),
        "output_dir": str(tmp / "out"),
        "launcher": "slurm-local",
        "launcher_overrides": {"mem": "1000M", "ntasks_per_node": 2, "aggregate_job": False},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out, calls = cli(tmp, "sweep", str(path), "--wait")
    assert calls == 1 and "1 runs: 1 finished" in out, out
    sweep_dir = tmp / "out" / name
    (key,) = [p.name for p in (sweep_dir / "runs").iterdir()]
    return sweep_dir, key


def test_grpo_run_with_two_slurm_tasks_is_one_two_rank_deepspeed_job(tmp_path, tiny_model_dir):
    """ntasks_per_node: 2 -> srun starts two ranks of one GRPO run (the multi-node path, on one node)."""
    base = toy_config(
        tiny_model_dir,
        heldout=2,
        gen_batch=16,
        algorithm="grpo",
        es=None,
        grpo={"group_size": 4, "batch_size": 4, "learning_rate": 1e-3, "updates": 2},
        eval={"every": 0},
    )
    (tmp_path / "grpo-base.yaml").write_text(yaml.safe_dump(base))
    sweep_dir, key = sweep_two_tasks(tmp_path, "g2", tmp_path / "grpo-base.yaml")
    log = [json.loads(x) for x in (sweep_dir / "runs" / key / "log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(len(r["param_checksums"]) == 2 and len(set(r["param_checksums"])) == 1 for r in log)
    _, _, (kid,) = children(sweep_dir, "g2")
    assert kid.data.tags["world_size"] == "2" and kid.info.status == "FINISHED"


def test_es_run_with_two_slurm_tasks_splits_the_population_and_matches_one_process(tmp_path, tiny_model_dir):
    """ntasks_per_node: 2 -> two srun ranks share one ES run's population (the multi-node path, on one
    node); the center equals a single-process run of the same config bit for bit."""
    sweep_dir, key = sweep_two_tasks(tmp_path, "es2", tiny_base(tmp_path, tiny_model_dir, updates=3))
    _, _, (kid,) = children(sweep_dir, "es2")
    assert kid.data.tags["world_size"] == "2" and kid.info.status == "FINISHED"
    # the same config in one process, outside SLURM
    single = yaml.safe_load((sweep_dir / "plan" / f"{key}.yaml").read_text())
    single["run"].update(name="single", output_dir=str(tmp_path / "single"))
    single["tracking"] = {"uri": f"sqlite:///{tmp_path / 'single.db'}"}
    (tmp_path / "single.yaml").write_text(yaml.safe_dump(single))
    cli(tmp_path, "train", str(tmp_path / "single.yaml"), "--no-progress")
    a = load_file(sweep_dir / "runs" / key / "center.safetensors")
    b = load_file(tmp_path / "single" / "single" / "center.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def algorithm_base(tmp: Path, model_dir: Path, **extra) -> Path:
    """A base whose es.updates (50) is not the budget of the GRPO runs and pipelines swept over it."""
    cfg = yaml.safe_load(tiny_base(tmp, model_dir, updates=50).read_text())
    cfg.update(
        grpo={"group_size": 4, "batch_size": 2, "learning_rate": 1e-3, "updates": 2},
        checkpoint={"every": 1},
        eval={"every": 0},
        **extra,
    )
    p = tmp / f"{extra.get('algorithm', 'es')}-base.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_grpo_and_pipeline_sweeps_finish_and_a_requeued_pipeline_resumes_its_stage(tmp_path, tiny_model_dir):
    """The pipeline's GRPO stage gets SLURM's time-limit warning while it waits at a gate inside its update 1 (4
    held-out problems, then 2 prompts per update): it finishes that update, stops, requeues, and resumes there."""
    grpo = shrunk_quickstart(tmp_path, tiny_model_dir, "gs", aggregate=None, grid={"grpo.learning_rate": [1e-3, 2e-3]})
    spec = yaml.safe_load(grpo.read_text())
    spec["base"] = str(algorithm_base(tmp_path, tiny_model_dir, algorithm="grpo"))
    grpo.write_text(yaml.safe_dump(spec))
    pipe = shrunk_quickstart(tmp_path, tiny_model_dir, "ps", aggregate=None, grid={})
    spec = yaml.safe_load(pipe.read_text())
    pipeline = {"stages": ["es", "grpo"], "updates": 10, "split": [1, 4]}
    ps = tmp_path / "out" / "ps"
    with Gate() as g:
        params = {"size": 16, "gate": g.path, "after_examples": 4 + 1 * 2, "argv": "stage2-grpo"}
        task = {"name": "toy:GatedDigitTask", "params": params, "heldout_size": 4, "few_shot": 1}
        spec["base"] = str(algorithm_base(tmp_path, tiny_model_dir, algorithm="pipeline", pipeline=pipeline, task=task))
        pipe.write_text(yaml.safe_dump(spec))
        cli(tmp_path, "sweep", str(grpo))
        cli(tmp_path, "sweep", str(pipe))
        (sub,) = json.loads((ps / "sweep.json").read_text())["submissions"]
        g.arrivals(1)
        (stage2,) = ps.glob("runs/*/stage2-grpo")
        assert (stage2 / "log.jsonl").read_bytes().count(b"\n") == 1
        stage1_log = (stage2.parent / "stage1-es" / "log.jsonl").read_bytes()
        subprocess.run(["scancel", "--signal=USR2", sub["job_id"]], check=True)
        g.release(stopped=True)
    for sweep_dir in (tmp_path / "out" / "gs", ps):
        wait_sweep(sweep_dir)
    assert (stage2.parent / "stage1-es" / "log.jsonl").read_bytes() == stage1_log  # stage 1 was not redone
    assert (stage2 / "log.jsonl").read_bytes().count(b"\n") == 8
    _, _, kids = children(ps, "ps")
    (pipe_run,) = [k for k in kids if k.data.tags.get("algorithm") == "pipeline"]
    assert pipe_run.info.status == "FINISHED" and pipe_run.data.tags["slurm.restarts"] == "1"

    for path, sweep_dir, n, budget in ((grpo, tmp_path / "out" / "gs", 2, "2/2"), (pipe, ps, 1, "10/10")):
        out, _ = cli(tmp_path, "status", str(sweep_dir))
        assert f"{n} runs: {n} finished" in out and out.count(budget) == n, out
        out, calls = cli(tmp_path, "sweep", str(path))
        assert calls == 0 and f"skipping {n} finished" in out and "nothing to submit" in out, out


def test_evals_start_per_finished_run_through_an_aftercorr_array(tmp_path, tiny_model_dir):
    """A sweep with `evaluate:` on SLURM: the base model's eval runs at once, the trained runs' evals form an
    array whose task i waits for training task i (aftercorr), and the aggregator tabulates them afterwards."""
    suite = {
        "name": "toy-suite",
        "sampling": {"n": 4, "temperature": 1.0, "max_new_tokens": 6, "batch_size": 16},
        "ks": [1, 2, 4],
        "tasks": [{"name": "toy:DigitTask", "label": "Digits", "params": {"size": 16}, "limit": 4}],
    }
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    path = shrunk_quickstart(
        tmp_path,
        tiny_model_dir,
        "ev",
        updates=2,
        evaluate={"config": str(tmp_path / "suite.yaml")},
        aggregate=[{"kind": "eval_table", "name": "passk", "metrics": ["pass@1", "pass@4"]}],
    )
    out, calls = cli(tmp_path, "sweep", str(path))
    assert calls == 4, out  # base eval array, training array, aftercorr eval array, aggregator
    sweep_dir = tmp_path / "out" / "ev"
    meta = wait_sweep(sweep_dir)
    base, train, evals = meta["submissions"]
    assert base["keys"][0].startswith("base-") and "dependency" not in base
    assert evals["dependency"] == f"aftercorr:{train['job_id']}" and evals["aggregate_job"]
    by_run = {e["source"]: e["key"] for e in meta["evals"] if e["source"]}
    assert evals["keys"] == [by_run[k] for k in train["keys"]]  # eval i evaluates run i

    def span(job: str) -> tuple[str, str]:
        out = subprocess.run(
            ["sacct", "-X", "-n", "-P", "--format=State,Start,End", "-j", job], capture_output=True, text=True
        ).stdout.split("|")
        return out[0], out[1], out[2].strip()

    for i in range(len(train["keys"])):
        t_state, _, t_end = span(f"{train['job_id']}_{i}")
        e_state, e_start, _ = span(f"{evals['job_id']}_{i}")
        assert t_state == e_state == "COMPLETED" and e_start >= t_end  # ISO times compare as strings
    assert sacct_state(evals["aggregate_job"]) == "COMPLETED"
    table = (sweep_dir / "results" / "passk.md").read_text()
    assert "| Base |" in table and "| population_size=4 |" in table and "| population_size=8 |" in table, table
    out, calls = cli(tmp_path, "status", str(sweep_dir))
    assert "2 runs: 2 finished" in out and "3 evals: 3 finished" in out, out
