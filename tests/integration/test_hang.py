"""No hang without a deadline: a scorer that never returns, and a rank that stops answering (its peer waits in
a collective), end the run with a named error and exit code 75 well within 120 s; the resumed run finishes
with the center of an undisturbed run, bit for bit."""

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from toy import ROOT, run_esbatch, toy_config

from esbatch.train.watchdog import EXIT_HUNG

UPDATES = 4
# The watchdog's limit: far above a tiny-model phase (milliseconds; seconds on a loaded machine), and what the
# hung run waits before it ends. That the watchdog (not the subprocess timeout) ended it shows in exit code 75
# and its message naming this limit.
HANG_S = 20
# The two hangs share the module's undisturbed reference run: one worker runs both, so it is trained once (two
# workers each trained it: a module fixture is per process).
pytestmark = pytest.mark.xdist_group("hang")


def write(tmp: Path, model_dir: Path, name: str, marker: Path, nproc: int = 1) -> Path:
    """A run whose scorer blocks forever in update 2 on the last rank while ``marker`` exists (16 scores per
    update over the ranks)."""
    cfg = toy_config(
        model_dir,
        heldout=0,
        es_updates=UPDATES,
        task={
            "name": "toy:HangingDigitTask",
            "params": {"size": 16, "marker": str(marker), "hang_after": 32 // nproc, "rank": str(nproc - 1)},
            "heldout_size": 0,
            "few_shot": 1,
        },
        run={"name": name, "seed": 3, "output_dir": str(tmp / "runs"), "threads": 1, "hang_timeout_s": HANG_S},
        checkpoint={"every": 1},
        eval={"every": 0},
    )
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def center(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "center.safetensors"))


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir) -> dict[str, torch.Tensor]:
    """The undisturbed run's center (one process: two ranks give the same bits, tests/integration/
    test_es_distributed.py)."""
    tmp = tmp_path_factory.mktemp("ref")
    p = run_esbatch("train", str(write(tmp, tiny_model_dir, "ref", tmp / "absent")), "--no-progress", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return center(tmp / "runs" / "ref")


@pytest.mark.parametrize("nproc", [1, 2], ids=["scorer-never-returns", "rank-stops-answering"])
def test_a_hang_ends_the_run_with_a_named_error_and_it_resumes_bit_exact(tmp_path, tiny_model_dir, reference, nproc):
    marker = tmp_path / "hang-once"
    marker.touch()
    cfg = write(tmp_path, tiny_model_dir, "hung", marker, nproc)  # 2 ranks: rank 1 hangs, rank 0 waits for it
    p = run_esbatch("train", str(cfg), "--no-progress", "--set", f"run.nproc_per_node={nproc}", timeout=300)
    assert p.returncode != 0 and not marker.exists(), p.stderr[-3000:]
    if nproc == 1:
        assert p.returncode == EXIT_HUNG
    assert "esbatch: hung: update 2 (generation, scoring" in p.stderr, p.stderr[-3000:]
    assert f"run.hang_timeout_s = {HANG_S} s" in p.stderr
    run_dir = tmp_path / "runs" / "hung"
    assert (run_dir / "log.jsonl").read_text().count("\n") == 2  # updates 0 and 1 done, 2 hung

    # The resumed run is about bit-exactness, not the watchdog: a limit a loaded machine cannot reach (a resume may
    # change it: esbatch/config/run.py:RESUME_OVERRIDABLE)
    p = run_esbatch("train", "--resume", str(run_dir), "--no-progress", "--set", "run.hang_timeout_s=3600", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert same(center(run_dir), reference)


def test_the_hang_message_names_what_each_thread_waits_on_and_before_exit_hooks_run():
    """What the vLLM backend relies on: the call a thread blocks in (an engine RPC) is named, and the hooks
    registered with before_exit (the backend kills its engine processes there) run before exit code 75."""
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from esbatch.train import watchdog\n"
        "watchdog.before_exit(lambda what: print('hook ran for', what, flush=True))\n"
        "gone = lambda what: print('forgotten hook ran', flush=True)\n"
        "watchdog.before_exit(gone); watchdog.forget(gone)\n"
        "wd = watchdog.Watchdog(0.5)\n"
        "with wd.phase('update 7'), watchdog.waiting_on('vLLM engine 1: RPC es_perturb'):\n"
        "    threading.Event().wait()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == EXIT_HUNG, p.stderr
    assert "esbatch: hung: update 7 did not finish within run.hang_timeout_s = 0.5 s" in p.stderr
    assert "esbatch: hung: waiting on vLLM engine 1: RPC es_perturb\n" in p.stderr
    assert p.stdout == "hook ran for update 7\n"
