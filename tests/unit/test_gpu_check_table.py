"""The GPU check's table (scripts/gpu_check.py, benchmarks/es_kernels.py) on the CPU with the tiny model: the
bounds are the bytes each weight move must carry over the measured copy bandwidth, the ES memory row is judged
against inference + fp32 master + workspace. (`--device cpu` running the script's path end to end, in a process
of its own, is tests/integration/test_gpu_check_script.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def load_kernels():
    spec = importlib.util.spec_from_file_location("es_kernels", ROOT / "benchmarks" / "es_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("es_kernels", mod)
    spec.loader.exec_module(mod)
    return mod


K = load_kernels()


@pytest.fixture(scope="module")
def report(tiny_model_dir):
    torch.set_num_threads(1)
    return K.measure(
        str(tiny_model_dir), "cpu", "bfloat16", directions=3, repeat=2, copy_log2n=20, noise_log2n=16, batch=2, tokens=4
    )


def test_bounds_are_bytes_per_param_times_params_over_bandwidth(report, tiny_model_dir):
    saved = load_file(str(tiny_model_dir / "model.safetensors"))  # tied embeddings are saved once
    params = sum(t.numel() for t in saved.values())
    assert (report.params, report.tensors) == (params, len(saved))
    assert report.largest == max(t.numel() for t in saved.values())
    assert report.elt == 2  # bfloat16 live weights
    assert report.es_state_bytes == 4 * params  # the fp32 master, no theta_0
    bw = report.copy_bytes_per_s
    assert bw > 0
    # perturb and restore: read fp32 master (4 B) + write bf16 live (2 B); update: master read + write + live write
    for op, per_param in (("perturb", 6), ("restore", 6), ("update", 10)):
        assert report.bound_ms(op) == pytest.approx(per_param * params / bw * 1000, rel=1e-12)
        assert report.ms[op] > 0
    assert report.noise_ms("update") == pytest.approx(3 * params / report.noise_per_s["philox-gauss"] * 1000)


def test_rows_carry_the_measurements_and_their_ratios(report):
    rows = report.rows()
    assert [r.quantity.split(" (")[0].split(",")[0] for r in rows] == [
        "copy bandwidth",
        "noise torch.randn",
        "noise philox-gauss",
        "noise philox-rademacher",
        "perturb",
        "restore",
        "update",
        "peak memory",
        "peak memory",
    ]
    by = {r.quantity.split(" (")[0].split(",")[0]: r for r in rows}
    assert by["copy bandwidth"].measured == f"{report.copy_bytes_per_s / 1e9:.1f} GB/s"
    for op in ("perturb", "restore", "update"):
        assert by[op].ratio == pytest.approx(report.ms[op] / report.bound_ms(op))
        assert by[op].measured == f"{report.ms[op]:.3g} ms"
    assert "N=3" in by["update"].quantity
    gauss = by["noise philox-gauss"]
    assert gauss.ratio == pytest.approx(report.copy_bytes_per_s / 4 / report.noise_per_s["philox-gauss"])
    assert [r.status for r in rows if r.quantity.startswith("peak memory")] == [
        "n/a: cpu (ru_maxrss cannot be reset)"
    ] * 2
    assert not any(r.failed for r in rows)
    table = K.markdown(rows).splitlines()
    assert table[0] == "| quantity | measured | bound / reference | ratio | ok |"
    assert len(table) == 2 + len(rows) and all(line.count("|") == 6 for line in table)


def test_memory_row_allows_inference_plus_master_plus_workspace():
    rep = K.KernelReport(
        device="cuda:0",
        dtype="bfloat16",
        model="m",
        noise="philox-gauss",
        params=1000,
        tensors=3,
        largest=600,
        elt=2,
        copy_bytes_per_s=8e9,
        noise_n=1 << 20,
        noise_per_s={"torch.randn": 1e9, "philox-gauss": 2e9, "philox-rademacher": 4e9},
        directions=8,
        ms={"perturb": 0.01, "restore": 0.001, "update": 0.1},
        repeat=5,
        batch=16,
        tokens=64,
        es_state_bytes=4000,
        peak_inference=10_000_000,
    )
    assert rep.bound_ms("perturb") == pytest.approx(6 * 1000 / 8e9 * 1000)  # 7.5e-4 ms
    assert rep.bound_ms("update") == pytest.approx(10 * 1000 / 8e9 * 1000)
    assert rep.noise_ms("update") == pytest.approx(8 * 1000 / 2e9 * 1000)
    allowed = 10_000_000 + 4000 + 600 * 3 + 16 * (1 << 20) * 4  # inference + master + bf16 copy & mask + chunks
    assert rep.memory_bound() == allowed
    at = dataclasses.replace(rep, peak_es=allowed).memory_row()
    assert at.status == "ok" and at.ratio == pytest.approx(allowed / 10_000_000)
    above = dataclasses.replace(rep, peak_es=allowed + 1).memory_row()
    assert above.failed
    goal = 10_000_000 + 2 * 1000 + 600 * 3 + 16 * (1 << 20) * 4  # issue 15: inference + 2 B/param + workspace
    assert dataclasses.replace(rep, peak_es_host=goal).target_row().status == "ok"
    assert dataclasses.replace(rep, peak_es_host=goal + 1).target_row().failed
