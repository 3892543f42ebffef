"""A sweep whose runs or evals generate on vLLM, launched from an interpreter that cannot import vLLM, is refused
before any task starts (esbatch/launch/submit.py:missing_vllm), naming the methods and what to use instead; not
where the tasks run in a container (the image has vLLM), nor where the vLLM tasks are all done already."""

import io

import pytest
import yaml
from toy import LauncherDouble

from esbatch.launch import submit
from esbatch.launch.submit import BackendUnavailable, dry_run, missing_vllm, submit_sweep
from esbatch.launch.sweep import load_sweep


def sweep_file(tmp_path, eval_backend="hf"):
    spec = {
        "name": "mixed",
        "base": "quickstart",
        "output_dir": str(tmp_path / "out"),
        "config": {"es": {"updates": 1}, "grpo": {"updates": 1}},
        "methods": {
            "ES": {"algorithm": "es", "backend": {"name": "vllm", "kv_cache_gb": 1}},
            "GRPO": {"algorithm": "grpo"},
            "ES->GRPO": {"algorithm": "pipeline", "pipeline": {"stages": ["es", "grpo"], "updates": 2}},
        },
        "evaluate": {"config": "eval-rq1-cpu", "set": {"backend": {"name": eval_backend}}},
    }
    path = tmp_path / "mixed.yaml"
    tmp_path.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.fixture
def launcher(monkeypatch):
    double = LauncherDouble()
    monkeypatch.setattr(submit, "launcher_for", lambda profile: double)
    return double


def test_vllm_importable_asks_find_spec(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    assert not submit.vllm_importable()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert submit.vllm_importable()


def test_a_vllm_method_without_vllm_is_refused_before_anything_is_submitted(tmp_path, monkeypatch, launcher):
    monkeypatch.setattr(submit, "vllm_importable", lambda: False)
    sw = load_sweep(sweep_file(tmp_path, eval_backend="vllm"))
    with pytest.raises(BackendUnavailable) as e:
        submit_sweep(sw, out=io.StringIO())
    msg = str(e.value)
    assert launcher.submitted == []
    assert "runs ES;" in msg and "GRPO" not in msg.split("evals")[0]  # the vLLM method only
    assert "evals base smollm2-135m-instruct, method=ES (eval)" in msg
    assert ".venv-vllm/bin/esbatch" in msg and "container image" in msg and "Nothing was submitted" in msg


def test_hf_evals_are_not_named_and_the_hf_tasks_alone_go(tmp_path, monkeypatch, launcher):
    monkeypatch.setattr(submit, "vllm_importable", lambda: False)
    sw = load_sweep(sweep_file(tmp_path))
    with pytest.raises(BackendUnavailable, match="runs ES\\) needs vLLM"):
        submit_sweep(sw, out=io.StringIO())
    es = next(r.key for r in sw.runs if r.point["method"] == "ES")
    others = [r.key for r in sw.runs if r.key != es] + [e.key for e in sw.evals]
    assert missing_vllm(sw, others) is None  # the vLLM run finished elsewhere: the rest may run here
    assert "ES" in missing_vllm(sw, [es])


def test_with_vllm_or_in_a_container_the_sweep_is_submitted(tmp_path, monkeypatch, launcher):
    monkeypatch.setattr(submit, "vllm_importable", lambda: True)
    sw = load_sweep(sweep_file(tmp_path, eval_backend="vllm"))
    assert submit_sweep(sw, out=io.StringIO()) == 0
    assert len(launcher.submitted[0]) == len(sw.runs) + len(sw.evals)
    monkeypatch.setattr(submit, "vllm_importable", lambda: False)
    boxed = load_sweep(sweep_file(tmp_path / "h100", eval_backend="vllm"), launcher="h100")  # apptainer image
    assert boxed.profile.container.runtime == "apptainer" and missing_vllm(boxed) is None
    assert submit_sweep(boxed, out=io.StringIO()) == 0


def test_dry_run_says_it_would_be_refused(tmp_path, monkeypatch, launcher):
    monkeypatch.setattr(submit, "vllm_importable", lambda: False)
    out = io.StringIO()
    assert dry_run(load_sweep(sweep_file(tmp_path)), out) == 0
    assert "would be refused: sweep mixed: backend.name: vllm (runs ES) needs vLLM" in out.getvalue()
    assert launcher.submitted == []


def test_rq1_cpu_evaluates_on_vllm_and_trains_on_hf(monkeypatch):
    """The backends benchmarks/rq1_cpu_backends.py measured faster (docs/benchmarks.md): evals on vLLM, training
    on HF (within 5%; the run keys threshold-cpu and diversity-cpu share)."""
    sw = load_sweep("rq1-cpu")
    assert {r.config.backend.name for r in sw.runs} == {"hf"}
    assert len(sw.evals) == 5 and {e.config["backend"]["name"] for e in sw.evals} == {"vllm"}
    monkeypatch.setattr(submit, "vllm_importable", lambda: False)
    why = missing_vllm(sw)
    assert "(evals base smollm2-135m-instruct" in why and "method=GRPO->ES (eval)" in why
