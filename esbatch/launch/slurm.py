"""SLURM through submitit: one array job per sweep (split past MaxArraySize), one batched sacct per poll.

Each array task runs ``SweepTask(sweep_dir)(key)`` with submitit's python command, which is replaced by
``apptainer exec --nv --bind ... IMAGE python`` (or ``docker run ...``) when the profile names a container.
An aggregator job (``esbatch aggregate``) waits on the arrays with ``--dependency=afterok``. A sweep's evals
(esbatch/launch/evals.py) go in arrays whose task i waits for training task i (``--dependency=aftercorr``).

``--dry-run`` prints the sbatch script submitit will write, made by submitit's own (private)
``_make_sbatch_string``: submitit is pinned (pyproject.toml) and tests/unit/test_sweep.py fails when the
installed version or that function's signature changes, before the golden script would drift.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from esbatch.config.launcher import LauncherProfile
from esbatch.launch.base import Launcher
from esbatch.launch.evals import is_eval_key
from esbatch.launch.state import SweepDir, now

SUBMITIT_VERSION = "1.5.4"  # the pinned version whose private _make_sbatch_string render_sbatch calls

_SAFE = re.compile(r"[\w@%+=:,./${}-]+")


def _q(arg: str) -> str:
    """Shell-quote, but leave $VAR / ${VAR} to the job's shell (image and bind paths under $HOME)."""
    return arg if _SAFE.fullmatch(arg) else shlex.quote(arg)


def python_command(profile: LauncherProfile, sweep_dir: Path) -> str:
    """The interpreter submitit runs the task with: this venv's python, or python inside the container."""
    c = profile.container
    if c.runtime == "none":
        return shlex.quote(sys.executable)
    binds = [str(sweep_dir), *c.binds]
    gpus = c.gpus and profile.gpus_per_node > 0
    if c.runtime == "apptainer":
        args = ["apptainer", "exec"] + (["--nv"] if gpus else [])
        for b in binds:
            args += ["--bind", b]
        for k, v in c.env.items():
            args += ["--env", f"{k}={v}"]
        return " ".join(_q(a) for a in [*args, *c.options, c.image, "python"])
    # docker: run as the submitting user, share the host network (MLflow server, rendezvous)
    args = ["docker", "run", "--rm", "--network", "host"] + (["--gpus", "all"] if gpus else [])
    for b in binds:
        src, _, dst = b.partition(":")
        args += ["-v", f"{src}:{dst or src}"]
    for k, v in c.env.items():
        args += ["-e", f"{k}={v}"]
    args += ["-e", "SLURM_JOB_ID", "-e", "SLURM_ARRAY_JOB_ID", "-e", "SLURM_ARRAY_TASK_ID", "-e", "SLURMD_NODENAME"]
    quoted = " ".join(_q(a) for a in [*args, *c.options])
    return f'{quoted} --user "$(id -u):$(id -g)" -w {_q(str(sweep_dir))} {_q(c.image)} python'


# image references apptainer pulls or looks up itself, not a file on a shared file system
_IMAGE_URI = re.compile(
    r"^(docker|docker-archive|docker-daemon|oci|oci-archive|oras|library|shub|http|https|instance)://"
)


def image_warning(profile: LauncherProfile, launcher: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the profile's apptainer image may not be found by its tasks, or None: a .sif path that does not exist
    here, on the machine that submits (the login node sees the cluster's shared file systems as the compute nodes
    do). $VARS are expanded with this machine's environment (``environ``), as the job's shell will on the node."""
    c = profile.container
    if profile.cluster != "slurm" or c.runtime != "apptainer" or not c.image or _IMAGE_URI.match(c.image):
        return None  # (the local launcher runs no container)
    env = os.environ if environ is None else environ
    where = f"container.image of the launcher profile {launcher}"
    unset = [v for v in re.findall(r"\$\{?(\w+)\}?", c.image) if v not in env]
    if unset:
        names = ", ".join("$" + v for v in dict.fromkeys(unset))
        return f"warning: {where}: {c.image} names {names}, unset here, so whether the image exists is not checked"
    path = Path(re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], c.image)).expanduser()
    if path.is_file():
        return None
    shown = c.image if str(path) == c.image else f"{c.image} (here: {path})"
    what = "is not a file" if path.exists() else "does not exist"
    return (
        f"warning: {where}: {shown} {what} on this machine, so `apptainer exec` would fail in every task; build or "
        "copy the .sif there first (docs/containers.md), or point image: at it"
    )


def sbatch_parameters(profile: LauncherProfile, job_name: str) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for the array job."""
    p: dict[str, Any] = {
        "job_name": job_name,
        "time": profile.time_minutes(),
        "nodes": profile.nodes,
        "ntasks_per_node": profile.ntasks_per_node,
        "cpus_per_task": profile.cpus_per_task,
        "signal_delay_s": profile.signal_delay_s,
        "array_parallelism": profile.array_parallelism,
        "setup": [*profile.setup, *(f"export {k}={_q(str(v))}" for k, v in profile.container.env.items())],
    }
    for key in ("partition", "account", "qos", "mem"):
        if getattr(profile, key):
            p[key] = getattr(profile, key)
    if profile.gpus_per_node:
        p["gpus_per_node"] = profile.gpus_per_node
    if profile.extra_sbatch:
        p["additional_parameters"] = dict(profile.extra_sbatch)
    return p


def render_sbatch(profile: LauncherProfile, sweep_dir: Path, job_name: str, n_tasks: int) -> str:
    """The sbatch script the array submission will write (for --dry-run and the golden test)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = sweep_dir / "slurm" / "%j"
    command = " ".join([python_command(profile, sweep_dir), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    params = sbatch_parameters(profile, job_name)
    params["array_parallelism"] = min(profile.array_parallelism, n_tasks)
    return _make_sbatch_string(command=command, folder=folder, map_count=n_tasks, **params)


def max_array_size() -> int:
    """The cluster's MaxArraySize (an array may hold at most this many tasks; default 1001)."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 1001
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", out, re.M)
    return int(m.group(1)) if m else 1001


def chunks(keys: list[str], size: int) -> list[list[str]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


def _executor(profile: LauncherProfile, sd: SweepDir, job_name: str) -> Any:
    import submitit

    ex = submitit.SlurmExecutor(
        folder=sd.slurm / "%j", max_num_timeout=profile.max_requeues, python=python_command(profile, sd.path)
    )
    ex.update_parameters(**sbatch_parameters(profile, job_name))
    return ex


def _array(
    profile: LauncherProfile, sd: SweepDir, job_name: str, keys: list[str], dependency: str | None = None
) -> dict[str, Any]:
    """One array job running ``SweepTask(sweep)(key)`` per key; returns its submission record."""
    from esbatch.launch.task import SweepTask

    ex = _executor(profile, sd, job_name)
    if dependency:
        extra = {**(profile.extra_sbatch or {}), "dependency": dependency, "kill-on-invalid-dep": "yes"}
        ex.update_parameters(additional_parameters=extra)
    jobs = ex.map_array(SweepTask(str(sd.path)), keys)
    array = "_" in jobs[0].job_id  # submitit submits a one-element "array" as a plain job (id without _index)
    record = {"kind": "slurm", "job_id": jobs[0].job_id.split("_")[0], "array": array, "keys": keys, "time": now()}
    return {**record, "dependency": dependency} if dependency else record


def _task_id(record: dict[str, Any], i: int) -> str:
    return f"{record['job_id']}_{i}" if record.get("array", True) else record["job_id"]


def submit(
    profile: LauncherProfile, sd: SweepDir, name: str, keys: list[str], after: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Submit ``keys`` as array job(s) (+ the afterok aggregator job); returns submission records.

    Evals that wait for a training submitted now go in an array whose task i starts when training task i has
    succeeded (``--dependency=aftercorr``); one waiting for an earlier submission's task gets ``afterok`` on it.
    """
    from esbatch.launch.task import CLIJob

    after = after or {}
    size = profile.max_array_size or max_array_size()
    waiting: dict[str, list[str]] = {}  # run -> its evals (one per eval config)
    for k, dep in after.items():
        waiting.setdefault(dep, []).append(k)
    train = [k for k in keys if not is_eval_key(k)]
    ready = [k for k in keys if is_eval_key(k) and k not in after]  # base models, runs already trained
    records = [_array(profile, sd, f"esbatch-{name}-eval", part) for part in chunks(ready, size)]
    for part in chunks(train, size):
        rec = _array(profile, sd, f"esbatch-{name}", part)
        records.append(rec)
        mine = [waiting.pop(k, []) for k in part]
        for j in range(max(map(len, mine), default=0)):  # the j-th eval config's evals of this part
            evals = [e[j] for e in mine if len(e) > j]
            if len(evals) == len(part):  # aligned: eval i after run i
                dep = f"aftercorr:{rec['job_id']}" if rec["array"] else f"afterok:{rec['job_id']}"
                records.append(_array(profile, sd, f"esbatch-{name}-eval", evals, dep))
                continue
            for k in evals:
                dep = f"afterok:{_task_id(rec, part.index(after[k]))}"
                records.append(_array(profile, sd, f"esbatch-{name}-eval", [k], dep))
    earlier = sd.last_submission()
    for k in (k for ks in waiting.values() for k in ks):  # the run was queued by an earlier `esbatch sweep`
        sub = earlier.get(after[k])
        if sub and sub.get("kind", "slurm") == "slurm":  # else: submitted by the next `esbatch sweep`
            dep = f"afterok:{_task_id(sub, sub['array_index'])}"
            records.append(_array(profile, sd, f"esbatch-{name}-eval", [k], dep))
    if profile.aggregate_job and records:
        ex = _executor(profile, sd, f"esbatch-{name}-aggregate")
        deps = ":".join(r["job_id"] for r in records)
        ex.update_parameters(
            array_parallelism=1,
            gpus_per_node=None,
            cpus_per_task=1,
            time=30,
            additional_parameters={"dependency": f"afterok:{deps}", "kill-on-invalid-dep": "yes"},
        )
        job = ex.submit(CLIJob("aggregate", str(sd.path)))
        records[-1]["aggregate_job"] = job.job_id
    return records


_ARRAY = re.compile(r"^(\d+)_(\d+|\[([^\]]+)\])$")


def scheduler_states(submissions: list[dict[str, Any]]) -> dict[tuple[str, int], str]:
    """(array job id, index) -> SLURM state, from ONE sacct call covering every submitted array
    (plus one squeue call for jobs so fresh that accounting has not recorded them yet)."""
    ids = sorted({s["job_id"] for s in submissions if s.get("kind") == "slurm"})
    if not ids:
        return {}
    states = _parse_states(_query(["sacct", "-X", "-n", "-P", "--format=JobID,State", "-j", ",".join(ids)]))
    # accounting lags a few seconds behind a fresh submission: ask the queue about jobs sacct does not know yet
    unknown = [j for j in ids if not any(k[0] == j for k in states)]
    if unknown:
        states.update(_parse_states(_query(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(unknown)])))
    return states


def _query(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _parse_states(text: str) -> dict[tuple[str, int], str]:
    states: dict[tuple[str, int], str] = {}
    for line in text.splitlines():
        jid, _, state = line.partition("|")
        jid = jid.strip()
        if jid.isdigit():  # a plain job: a one-run submission, or the aggregator
            states[(jid, 0)] = state.strip()
            continue
        m = _ARRAY.match(jid)
        if not m:
            continue
        if m.group(3):  # a pending range "123_[4-63%16]" or "123_[1,3,5-7]"
            for part in m.group(3).split("%")[0].split(","):
                a, _, b = part.partition("-")
                for i in range(int(a), int(b or a) + 1):
                    states[(m.group(1), i)] = state.strip()
        else:
            states[(m.group(1), int(m.group(2)))] = state.strip()
    return states


def job_state(job_id: str) -> str | None:
    """The state of one plain job (the aggregator), or None while the scheduler does not know it yet."""
    return scheduler_states([{"kind": "slurm", "job_id": job_id}]).get((job_id, 0))


class SlurmLauncher(Launcher):
    kind = "slurm"

    def submit(
        self, sd: SweepDir, name: str, keys: list[str], after: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        records = submit(self.profile, sd, name, keys, after)
        with sd.locked() as meta:
            meta.setdefault("submissions", []).extend(records)
        return records

    def states(self, sd: SweepDir, submissions: list[dict[str, Any]]) -> dict[str, str]:
        sched = scheduler_states(submissions)
        out = {}
        for sub in submissions:
            for i, key in enumerate(sub["keys"]):
                state = sched.get((sub["job_id"], i if sub.get("array", True) else 0))
                if state:
                    out[key] = state
        return out

    def cancel(self, sd: SweepDir, submissions: list[dict[str, Any]]) -> None:
        ids = sorted(
            {s["job_id"] for s in submissions} | {s["aggregate_job"] for s in submissions if s.get("aggregate_job")}
        )
        if ids:
            subprocess.run(["scancel", *ids], check=False)

    def describe(self, sd: SweepDir, name: str, n_tasks: int) -> str:
        script = render_sbatch(self.profile, sd.path, f"esbatch-{name}", max(n_tasks, 1))
        return f"# sbatch script for {n_tasks} task(s) (one array job; nothing submitted):\n\n{script}"
