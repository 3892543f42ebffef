"""In-training evaluation on other tasks (esbatch/train/taskeval.py) on the tiny model: fixed seeds per
(task, update), RNG states untouched, the same metrics as the offline evaluator; snapshots and `esbatch
center`'s errors; the config section's defaults leave runs unchanged."""

import random

import numpy as np
import pytest
import torch

from esbatch.config import config_from_dict
from esbatch.train.rundir import RunDir, RunFolderError
from esbatch.train.taskeval import TaskEvals, eval_seed, metric_name, rng_untouched

TASK = {"name": "toy:DigitTask", "label": "Digit s@x", "params": {"size": 8}, "limit": 3, "few_shot": 1}


def cfg_with(tiny_model_dir, **ev):
    return config_from_dict(
        {
            "model": {"name": str(tiny_model_dir)},
            "generation": {"max_new_tokens": 5, "batch_size": 8},
            "es": {"updates": 2},
            "eval": {"tasks": [TASK], "samples": 4, "temperature": 1.0, "ks": [2, 4], **ev},
        }
    )


def test_seeds_are_fixed_per_task_and_update():
    assert eval_seed(3, "GSM8K", 10) == eval_seed(3, "GSM8K", 10)
    assert len({eval_seed(3, "GSM8K", 10), eval_seed(3, "GSM8K", 11), eval_seed(3, "GPQA", 10)}) == 3
    assert metric_name("Digit s@x", "pass@16") == "Digit s_x/pass_at_16"


def test_task_evals_repeat_exactly_and_leave_the_rngs_alone(tiny_backend_factory, tiny_model_dir):
    gen = tiny_backend_factory()
    evals = TaskEvals(cfg_with(tiny_model_dir))

    def draw():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    a = evals(gen, 5)
    after = draw()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    assert draw() == after  # as if no evaluation had run
    b = evals(gen, 5)
    timing = {k for k in a if k.endswith("_s")}
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    want = {"pass_at_1", "pass_at_2", "pass_at_4", "maj_at_2", "maj_at_4", "entropy", "format", "time_s"}
    assert {f"eval/Digit s_x/{n}" for n in want} <= a.keys()
    assert 0 <= a["eval/Digit s_x/pass_at_1"] <= a["eval/Digit s_x/pass_at_4"] <= 1


def test_no_tasks_is_falsy_and_defaults_do_not_touch_run_keys(tiny_model_dir):
    from esbatch.config.run import RESUME_OVERRIDABLE, Config
    from esbatch.launch.sweep import run_key

    cfg = config_from_dict({"es": {"updates": 2}})
    assert not TaskEvals(cfg) and cfg.eval.tasks == [] and cfg.checkpoint.snapshots == []
    assert run_key(cfg) == run_key(config_from_dict({"es": {"updates": 2}, "eval": {"samples": 4}}))
    assert {"eval.tasks", "checkpoint.snapshots"} <= RESUME_OVERRIDABLE
    assert Config().to_dict()["eval"]["tasks"] == []


def test_rng_untouched_restores_after_an_exception():
    torch.manual_seed(0)
    with pytest.raises(RuntimeError), rng_untouched():
        torch.rand(5)
        raise RuntimeError
    x = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(x, torch.rand(1))


def test_snapshot_files_and_the_grpo_error(tmp_path):
    from esbatch.eval.center import stored_center

    rd = RunDir(tmp_path)
    state = {"w": torch.arange(4, dtype=torch.float32)}
    rd.save_center(state, 3, rd.snapshot(3))
    rd.save_center(state, 7, rd.snapshot(7))
    rd.save_center(state, 9)
    assert rd.snapshot_updates() == [3, 7]
    assert stored_center(rd, 3, "grpo") == rd.snapshot(3) and stored_center(rd, 9, "grpo") == rd.center
    with pytest.raises(RunFolderError, match=r"GRPO centers come from snapshots.*\[3, 7\].*update 9"):
        stored_center(rd, 5, "grpo")
