"""Chaos on the real cluster: half of a 6-run sweep's tasks are hit inside an update, each kind in turn:
SIGKILL of every process, `scontrol requeue` (the scheduler takes the node back), and USR2 (the time-limit
warning); the stress tier (ESBATCH_STRESS=N, tests/stress.py) hits N tasks of each kind in a sweep of 3N + 3
runs (before issue 40: 3 hits in 12 runs). The sweep (re-run until nothing is left to submit) ends with every
run finished, every center bit-identical to an undisturbed run of the same config, and every metric step in
MLflow exactly once. A hung run requeues itself and finishes too.

Every hit lands in a live task by construction: each task's scorer waits at a gate (tests/gate.py) inside update
2 until the test has hit it, or lets it go on at once (the tasks not hit, and the hit tasks' restarts)."""

import json
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import yaml
from gate import Gate
from safetensors.torch import load_file
from stress import stress
from test_slurm_sweep import children, cli, shrunk_quickstart, wait_for, wait_sweep

from esbatch.launch.state import SweepDir
from esbatch.train import train

# the one cluster: its fixture starts it once per session, and one xdist worker runs every test using it
pytestmark = [pytest.mark.usefixtures("slurm_cluster"), pytest.mark.xdist_group("slurm")]
HITS = 3 * stress()  # N of each kind
RUNS, UPDATES = HITS + 3, 6  # 3 tasks are never hit


def hit(task: str, action: str) -> subprocess.Popen:
    """Start the hit without waiting: scancel can block for most of a minute while a task is requeueing itself."""
    cmd = {
        "kill": ["scancel", "--signal=KILL", "--full", task],  # every process of the task, no warning
        "requeue": ["scontrol", "requeue", task],  # the scheduler takes the node back (preemption)
        "usr2": ["scancel", "--signal=USR2", task],  # the time-limit warning: stop, then submitit requeues
    }[action]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Chaos:
    """Serves the gate from a thread: the first ``n`` distinct tasks to arrive are hit, the kinds in turn (a
    killed task is let go once scancel has returned; a USR2 one once its stop flag is set); every other arrival
    goes on at once."""

    KINDS = ("kill", "requeue", "usr2")

    def __init__(self, gate: Gate, n: int) -> None:
        self.gate, self.n = gate, n
        self.hits: dict[str, str] = {}  # SLURM task -> kind
        self.calls: list[subprocess.Popen] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                a = self.gate.next()
            except AssertionError:  # no arrival within the gate's limit: the sweep may be between rounds
                continue
            if a is None:  # closed
                return
            task = a.tag.split()[1]
            if len(self.hits) >= self.n or task in self.hits:
                a.release()
                continue
            kind = self.KINDS[len(self.hits) % len(self.KINDS)]
            self.hits[task] = kind
            self.calls.append(hit(task, kind))
            if kind == "kill":
                self.calls[-1].wait(timeout=180)
            a.release(stopped=kind == "usr2")

    def stop(self) -> None:
        self.gate.close()
        self.thread.join(timeout=60)
        for p in self.calls:
            p.wait(timeout=180)  # slurmctld can be slow under load


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


@pytest.mark.stress
def test_kills_requeues_and_usr2_inside_updates_lose_nothing(tmp_path, tiny_model_dir):
    gate = Gate()
    path = shrunk_quickstart(
        tmp_path,
        tiny_model_dir,
        "chaos",
        updates=UPDATES,
        gate=gate.path,
        gate_update=2,
        grid={"run.seed": list(range(RUNS))},
        launcher_overrides={"mem": "1000M", "array_parallelism": 3},
        aggregate=None,
    )
    sweep_dir = tmp_path / "out" / "chaos"
    chaos, rounds = Chaos(gate, HITS), 0
    try:
        while True:
            out, calls = cli(tmp_path, "sweep", str(path))
            if "nothing to submit" in out:  # finished, or still active (a requeued task waiting for its restart)
                status = wait_for(lambda: finished_or_idle(tmp_path, sweep_dir), 900, "the active runs to end")
                if status == "finished":
                    break
                continue
            rounds += 1
            assert rounds <= 3 + HITS // 3, out  # 4 at N = 1, as before issue 40
            wait_sweep(sweep_dir)
    finally:
        chaos.stop()
    print(f"\nchaos: {chaos.hits}; {rounds} submission round(s)")
    assert sorted(chaos.hits.values()) == sorted(Chaos.KINDS * (HITS // 3))

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
    wait_sweep(sweep_dir)
    (key,) = [r["key"] for r in json.loads((sweep_dir / "sweep.json").read_text())["runs"]]
    meta = json.loads((sweep_dir / "runs" / key / "run.json").read_text())
    assert meta["status"] == "finished" and meta["hang_requeues"] == 1
    _, _, (kid,) = children(sweep_dir, "hang")
    assert kid.data.tags["slurm.restarts"] == "1" and kid.info.status == "FINISHED"
    (ref,) = reference_centers(sweep_dir, tmp_path).values()
    got = load_file(str(sweep_dir / "runs" / key / "center.safetensors"))
    assert all(torch.equal(got[n], ref[n]) for n in ref)
