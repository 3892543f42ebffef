"""scripts/gpu_check.py with `--device cpu` on the tiny model, end to end in a process of its own: one table,
exit 0; without CUDA the default device exits 2. (The table's bounds and rows: tests/unit/test_gpu_check_table.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_check(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path and the no-CUDA exit")
def test_gpu_check_on_cpu_prints_one_table_and_exits_2_without_cuda(tiny_model_dir):
    p = run_check("--device", "cpu", "--model", str(tiny_model_dir))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    final = p.stdout.split("## GPU check")[1]
    table = [line for line in final.splitlines() if line.startswith("|")]
    assert table[0] == "| quantity | measured | bound / reference | ratio | ok |"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert len(rows) == 14 and all(len(r) == 5 for r in rows)
    status = {r[0].split(" (")[0].split(",")[0]: r[4] for r in rows}
    assert status["ES noise"] == "n/a: no CUDA"
    assert status["perturb"] == status["update"] == "info"
    assert status["peak memory"].startswith("n/a: cpu")
    assert status["eval generation"] == status["GRPO step"] == "n/a: --device cpu"
    assert "gpu check passed" in p.stdout
    assert run_check("--model", str(tiny_model_dir)).returncode == 2  # default --device cuda, no GPU here
