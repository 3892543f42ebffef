"""Chaos on the real cluster: tasks of a 12-run sweep are SIGKILLed, requeued (`scontrol requeue`) and sent USR2
at random moments until a quarter of them were hit. The sweep (re-run until nothing is left to submit) ends
with every run finished, every center bit-identical to an undisturbed run of the same config, and every
metric step in MLflow exactly once. A hung run requeues itself and finishes too."""

import json
import random
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_slurm_sweep import children, cli, shrunk_quickstart, wait_for, wait_sweep

from esbatch.launch.state import SweepDir
from esbatch.train import train

pytestmark = pytest.mark.usefixtures("slurm_cluster")
RUNS, UPDATES = 12, 6


def running_tasks(job: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-j", job, "-t", "R", "-o", "%i"], capture_output=True, text=True).stdout
    return [x for x in out.split() if "_" in x and "[" not in x]


def hit(task: str, action: str) -> subprocess.Popen:
    """Start the hit without waiting: scancel can block for most of a minute while a task is requeueing itself,
    and the array must not run out of live tasks meanwhile."""
    cmd = {
        "kill": ["scancel", "--signal=KILL", "--full", task],  # every process of the task, no warning
        "requeue": ["scontrol", "requeue", task],  # the scheduler takes the node back (preemption)
        "usr2": ["scancel", "--signal=USR2", task],  # the time-limit warning: stop, then submitit requeues
    }[action]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finished_or_idle(tmp: Path, sweep_dir: Path) -> str | None:
    """ "finished" once every run is, "idle" when none is queued or running (resubmit then), else None."""
    out, _ = cli(tmp, "status", str(sweep_dir))
    if f"{RUNS} runs: {RUNS} finished" in out:
        return "finished"
    return None if ("running" in out or "queued" in out) else "idle"


def reference_centers(sweep_dir: Path, tmp: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each planned run trained undisturbed, in this process, from the same plan file."""
    sd, out = SweepDir(sweep_dir), {}
    for r in sd.read()["runs"]:
        cfg = sd.plan_config(r["key"])
        cfg.tracking.uri = f"sqlite:///{tmp / 'ref.db'}"
        rd = tmp / "ref" / r["key"]
        train(cfg, rd, progress=False)
        out[r["key"]] = load_file(str(rd / "center.safetensors"))
    return out


def test_kills_requeues_and_usr2_at_random_lose_nothing(tmp_path, tiny_model_dir):
    path = shrunk_quickstart(
        tmp_path,
        tiny_model_dir,
        "chaos",
        updates=UPDATES,
        grid={"run.seed": list(range(RUNS))},
        # three at a time: four waves keep live tasks around long enough for a quarter to be hit
        launcher_overrides={"mem": "1000M", "array_parallelism": 3},
        aggregate=None,
    )
    sweep_dir = tmp_path / "out" / "chaos"
    rng, hits, rounds = random.Random(0), {"kill": 0, "requeue": 0, "usr2": 0}, 0
    tasks_hit: set[str] = set()
    pending_hits: list[subprocess.Popen] = []
    order = rng.sample(sorted(hits), len(hits))
    while True:
        out, calls = cli(tmp_path, "sweep", str(path))
        if "nothing to submit" in out:  # finished, or still active (a requeued task waiting for its restart)
            status = wait_for(lambda: finished_or_idle(tmp_path, sweep_dir), 600, "the active runs to end")
            if status == "finished":
                break
            continue
        rounds += 1
        assert rounds <= 4, out
        job = json.loads((sweep_dir / "sweep.json").read_text())["submissions"][-1]["job_id"]
        while len(tasks_hit) < RUNS // 4 and rounds == 1:  # chaos in the first round only
            running = [t for t in running_tasks(job) if t not in tasks_hit]
            if not running:
                if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
                    break  # the array ended before a quarter was hit
                time.sleep(0.5)
                continue
            time.sleep(rng.uniform(0.5, 4.0))  # a random moment of the task's life
            task, action = rng.choice(running), order[len(tasks_hit) % len(order)]  # each kind of hit, in turn
            pending_hits.append(hit(task, action))
            hits[action] += 1
            tasks_hit.add(task)
        for p in pending_hits:
            p.wait(timeout=180)  # slurmctld can be slow under load
        wait_sweep(sweep_dir, timeout=900)
    print(f"\nchaos: {hits} on {len(tasks_hit)} of {RUNS} tasks; {rounds} submission round(s)")
    assert len(tasks_hit) >= RUNS // 4

    client, _, kids = children(sweep_dir, "chaos")
    assert len(kids) == RUNS and all(k.info.status == "FINISHED" for k in kids)  # resumes reuse their MLflow run
    for k in kids:
        steps = sorted(m.step for m in client.get_metric_history(k.info.run_id, "reward/mean"))
        assert steps == list(range(1, UPDATES + 1)), (k.data.tags["esbatch.run_key"], steps)
    refs = reference_centers(sweep_dir, tmp_path)
    for key, ref in refs.items():
        got = load_file(str(sweep_dir / "runs" / key / "center.safetensors"))
        assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref), key


def test_a_hung_task_requeues_itself_and_finishes_bit_exact(tmp_path, tiny_model_dir):
    marker = tmp_path / "hang-once"
    marker.touch()
    path = shrunk_quickstart(tmp_path, tiny_model_dir, "hang", updates=4, aggregate=None)
    spec = yaml.safe_load(path.read_text())
    base = yaml.safe_load(Path(spec["base"]).read_text())
    base["task"] = {**base["task"], "name": "toy:HangingDigitTask"}
    base["task"]["params"] = {**base["task"].get("params", {}), "marker": str(marker), "hang_after": 40}
    base["run"]["hang_timeout_s"] = 20
    Path(spec["base"]).write_text(yaml.safe_dump(base))
    spec["grid"] = {}
    path.write_text(yaml.safe_dump(spec))
    cli(tmp_path, "sweep", str(path))
    sweep_dir = tmp_path / "out" / "hang"
    wait_for(lambda: not marker.exists(), 300, "the scorer to hang")
    wait_sweep(sweep_dir, timeout=600)
    (key,) = [r["key"] for r in json.loads((sweep_dir / "sweep.json").read_text())["runs"]]
    meta = json.loads((sweep_dir / "runs" / key / "run.json").read_text())
    assert meta["status"] == "finished" and meta["hang_requeues"] == 1
    _, _, (kid,) = children(sweep_dir, "hang")
    assert kid.data.tags["slurm.restarts"] == "1" and kid.info.status == "FINISHED"
    (ref,) = reference_centers(sweep_dir, tmp_path).values()
    got = load_file(str(sweep_dir / "runs" / key / "center.safetensors"))
    assert all(torch.equal(got[n], ref[n]) for n in ref)
