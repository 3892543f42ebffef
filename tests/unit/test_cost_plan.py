"""The cost plan of `esbatch sweep` (esbatch/launch/cost.py): its token counts against an explicit computation for
a small sweep of ES, GRPO and pipeline runs with an eval phase, the meta-device parameter count against a loaded
model's, the throughput table (esbatch/launch/throughput.py) and its measured overrides, and the time-limit
warning exactly when the estimate exceeds the launcher profile's limit, in --dry-run and before a submission."""

from __future__ import annotations

import importlib.util
import io
import json
import struct
import sys
from pathlib import Path

import pytest
import yaml
from toy import make_tiny_model, toy_config

from esbatch.cli import main
from esbatch.config import load_config
from esbatch.config.launcher import LauncherProfile
from esbatch.launch import slurm
from esbatch.launch.cost import Counts, count, plan_sweep, problems, time_warnings, training_parts
from esbatch.launch.disk import planned_updates as budget
from esbatch.launch.submit import submit_sweep
from esbatch.launch.sweep import load_sweep
from esbatch.launch.throughput import ASSUMED, Rate, Table, device_kind, gpu_check_rates, load_rates, size_class
from esbatch.models import load_model_and_tokenizer, meta_parameter_count, parameter_count
from esbatch.schema import ConfigError

ROOT = Path(__file__).resolve().parents[2]
L, LE = 6, 7  # generation.max_new_tokens of the runs; sampling.max_new_tokens of the eval phase


def _write_sweep(tmp_path, model_dir, *, launcher="local", overrides=None, heldout=4, evaluate=True):
    """ES (N=4, B=4, 3 updates), GRPO (G=2, B=2, 3 steps) and ES->GRPO (2 + 2) on the tiny model; evaluated on the
    toy task (5 problems, n=4 + greedy) with the base model."""
    base = toy_config(
        model_dir,
        heldout=heldout,
        es_updates=3,
        grpo={"group_size": 2, "batch_size": 2, "updates": 3},
        pipeline={"stages": ["es", "grpo"], "updates": 4},
        eval={"every": 2, "samples": 2, "ks": [1, 2], "tasks": [{"name": "toy:DigitTask", "limit": 3}]},
    )
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    ev = {
        "name": "toy-eval",
        "model": {"name": str(model_dir)},
        "sampling": {"n": 4, "greedy": True, "max_new_tokens": LE},
        "ks": [1, 4],
        "tasks": [{"name": "toy:DigitTask", "limit": 5}],
    }
    (tmp_path / "ev.yaml").write_text(yaml.safe_dump(ev))
    spec = {
        "name": "cost",
        "base": "base.yaml",
        "output_dir": str(tmp_path / "out"),
        "methods": {"ES": {"algorithm": "es"}, "GRPO": {"algorithm": "grpo"}, "ES->GRPO": {"algorithm": "pipeline"}},
        "launcher": launcher,
        "launcher_overrides": overrides or {},
    }
    if evaluate:
        spec["evaluate"] = {"config": "ev.yaml"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    return str(tmp_path / "s.yaml")


def _phase_rows(text):
    """{phase: tokens} of the plan's per-phase table in printed output."""
    rows = [line.split() for line in text.splitlines() if line.startswith(("  training ", "  evaluation ", "  total "))]
    return {r[0]: r[1] for r in rows}


def _by_label(plan):
    return {w.label: w for w in plan.work}


def test_plan_tokens_match_an_explicit_computation(tmp_path, tiny_model_dir):
    sweep = load_sweep(_write_sweep(tmp_path, tiny_model_dir))
    plan = plan_sweep(sweep)
    work = _by_label(plan)

    per_eval = 4 * L + 3 * 2 * L  # held-out: 4 greedy; eval.tasks: 3 problems x 2 samples
    assert work["method=ES"].tokens == 4 * 4 * 3 * L + 3 * per_eval  # evaluated after updates 0, 2 and 3
    assert work["method=GRPO"].tokens == 2 * 2 * 3 * L + 3 * per_eval
    # each stage: 2 of the 4 updates, evaluated after its updates 0 and 2
    assert work["method=ES->GRPO"].tokens == (4 * 4 * 2 * L + 2 * per_eval) + (2 * 2 * 2 * L + 2 * per_eval)
    evals = plan.phase("evaluation")
    assert len(evals) == 4  # the three trained runs and the base model
    assert {w.tokens for w in evals} == {5 * (4 + 1) * LE}
    assert {w.phase for w in plan.phase("training")} == {"training"} and len(plan.phase("training")) == 3
    assert plan.device == "cpu" and all(w.rate is not None for w in plan.work)  # local profile: no GPUs


def test_epochs_budgets_use_the_dataset_cards_split_sizes():
    # the builtin configs' comments: 2 epochs of GSM8K's 7,473 problems at B=32 = 468; DeepScaleR at B=64 = 630
    assert budget(load_config("easy")) == 2 * -(-7473 // 32) == 468
    assert budget(load_config("hard")) == 630
    grpo = load_config("easy", ["algorithm=grpo", "grpo.iterations=2"])
    assert budget(grpo) == 468 * 2  # optimizer steps: mu per generated batch
    assert problems("gsm8k", None) == 1319 and problems("gsm8k", 100) == 100 and problems("gsm8k", 5000) == 1319
    assert problems("arithmetic", None) == 500 and problems("arithmetic", 24) == 24  # generated: 500 by default
    assert problems("amc2023", None) == 40
    assert problems("gsm8k", None, "local.jsonl") is None and problems("gsm8k", 50, "local.jsonl") == 50


def test_a_budget_that_depends_on_an_unread_local_file_is_said_to_be_unknown(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    cfg = load_config("easy", [f"task.data_path={tmp_path / 'gsm8k.jsonl'}"])
    parts, why = training_parts(cfg)
    assert budget(cfg) is None and parts == [] and "epochs budget, is unknown" in why
    assert training_parts(load_config("easy", ["es.updates=3", "es.epochs=null"]))[1] is None


def test_rq1_cpu_plan_counts_rollouts_and_its_eval_phase():
    sweep = load_sweep("rq1-cpu")
    plan = plan_sweep(sweep)
    es = next(w for w in plan.work if w.label == "method=ES")
    # N=32 x B=4 x 8 updates x 28; held-out 16 greedy and ChainSum 8 x 16 samples after updates 0, 4, 8
    assert es.tokens == 32 * 4 * 8 * 28 + 3 * (16 * 28 + 8 * 16 * 28)
    # Add2, ChainSum, Sub2: 24 problems each, 32 samples of at most 32 tokens
    assert {w.tokens for w in plan.phase("evaluation")} == {3 * 24 * 32 * 32}
    assert len(plan.phase("evaluation")) == 5


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_meta_device_count_equals_the_loaded_models(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("ESBATCH_CACHE", str(tmp_path / "cache"))  # counted here, not read from an earlier run's cache
    path = make_tiny_model(tmp_path / kind, kind=kind)  # llama: tied embeddings; qwen2: an untied lm_head
    model, _ = load_model_and_tokenizer(str(path))
    loaded = sum(p.numel() for p in model.parameters())  # shared parameters once
    assert meta_parameter_count(str(path)) == loaded == parameter_count(str(path))
    assert meta_parameter_count(str(path), local_only=True) == loaded


def test_the_meta_count_is_kept_between_processes_and_redone_when_what_it_depends_on_changes(tmp_path, monkeypatch):
    """The count a sweep's cost plan needs is kept in $ESBATCH_CACHE (torch + transformers cost a process 5-7 s):
    read back whole, and counted again for a changed config, another transformers version, or a damaged entry."""
    import esbatch.models as models

    cache = tmp_path / "cache"
    monkeypatch.setenv("ESBATCH_CACHE", str(cache))
    path = make_tiny_model(tmp_path / "m")
    real_shapes = models.hf_parameter_shapes
    calls: list[str] = []

    def counted(model_dir, revision=None, **kwargs):
        calls.append(model_dir)
        return real_shapes(model_dir, revision, **kwargs)

    monkeypatch.setattr(models, "hf_parameter_shapes", counted)

    def fresh(**kw) -> int:  # a new process: its own memo empty, the cache on disk kept
        models._META_COUNTS.clear()
        return meta_parameter_count(str(path), **kw)

    n = fresh()
    loaded = sum(p.numel() for p in load_model_and_tokenizer(str(path))[0].parameters())
    assert n == loaded and len(calls) == 1
    (entry,) = (cache / "param-counts").iterdir()
    assert yaml.safe_load(entry.read_text()) == {"parameters": n}
    assert fresh() == n and fresh(local_only=True) == n and len(calls) == 1  # read back; local_only is not a key
    # a damaged or impossible entry is counted again and rewritten; 1 is the smallest count read back as it is
    for bad, counted_again in (
        ("", True),
        ('{"parameters": ', True),
        ('{"parameters": 0}', True),
        ('{"parameters": true}', True),
        ('{"parameters": 2.0}', True),
        ('{"n": 5}', True),
        ('{"parameters": 1}', False),
    ):
        entry.write_text(bad)
        before = len(calls)
        assert fresh() == (n if counted_again else 1), bad
        assert len(calls) == before + counted_again, bad
        if counted_again:
            assert yaml.safe_load(entry.read_text()) == {"parameters": n}, bad
    # another transformers version: another entry
    monkeypatch.setattr(models.importlib.metadata, "version", lambda dist: "0.0.1")
    assert fresh() == n and len(calls) == 8 and len(list((cache / "param-counts").iterdir())) == 2
    monkeypatch.undo()
    monkeypatch.setenv("ESBATCH_CACHE", str(cache))
    monkeypatch.setattr(models, "hf_parameter_shapes", counted)
    # a changed config (same size and mtime would not hide it: the key is its bytes): counted again
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    smaller = fresh()
    assert smaller < n and len(calls) == 9
    # a cache that cannot be written: still the count
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("ESBATCH_CACHE", str(blocked / "cache"))
    assert fresh() == smaller and fresh() == smaller and len(calls) == 11


def test_the_gguf_tensor_table_is_read_past_every_kind_of_metadata(tmp_path):
    """esbatch's header-only GGUF reader (the plan's parameter count) against gguf's own GGUFReader, on a file with
    metadata of every value type (scalars, strings, arrays of numbers, strings and arrays) and tensors of 1-3 dims;
    a GGUF v1 file or a truncated header is refused (the caller then reads it with GGUFReader)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from esbatch.models import gguf_tensor_elements

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("a.u8", 7), w.add_int16("a.i16", -3), w.add_uint32("a.u32", 9), w.add_float32("a.f32", 0.5)
    w.add_bool("a.bool", True), w.add_uint64("a.u64", 1 << 40), w.add_float64("a.f64", 0.25), w.add_string("a.s", "xyz")
    w.add_array("a.tokens", ["a", "bc", "", "d" * 300]), w.add_array("a.scores", [0.5, 1.5, 2.5])
    w.add_key_value("a.nested", [[1, 2], [3]], GGUFValueType.ARRAY, sub_type=GGUFValueType.ARRAY)
    for name, shape in [("t1", (5,)), ("t2", (3, 4)), ("t3", (2, 3, 7))]:
        w.add_tensor(name, np.ones(shape, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    want = int(sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors))
    assert gguf_tensor_elements(path) == want == 5 + 12 + 42
    data = path.read_bytes()
    (tmp_path / "v1.gguf").write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    (tmp_path / "cut.gguf").write_bytes(data[:60])
    for bad in ("v1.gguf", "cut.gguf"):
        with pytest.raises((ValueError, struct.error), match="version 1|truncated|unpack|buffer"):
            gguf_tensor_elements(tmp_path / bad)


def test_counts_fall_back_to_the_model_card_and_fetch_nothing():
    counts = Counts()
    assert counts("qwen2.5-7b-instruct") == 7_615_616_512  # not on this machine: NOMINAL_PARAMETERS
    assert counts.known[("qwen2.5-7b-instruct", None, None)][1].startswith("as its model card gives it")
    assert counts("Org/never-downloaded-model") is None


def _plan_with_rate(tmp_path, model_dir, rate, limit):
    """ES alone, 4 x 4 x 3 updates x 5 tokens = 240 tokens, no held-out set, on a SLURM profile with ``limit``."""
    base = toy_config(model_dir, heldout=0, es_updates=3)
    base["generation"]["max_new_tokens"] = 5
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    overrides = {"time": limit, "max_array_size": 10, "aggregate_job": False}
    spec = {"name": "limit", "base": "base.yaml", "output_dir": str(tmp_path / "out"), "launcher": "slurm-local"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**spec, "launcher_overrides": overrides}))
    sweep = load_sweep(str(tmp_path / "s.yaml"))
    table = Table([Rate("0.1B", "hf", "cpu", rate, ASSUMED)])
    return sweep, table, plan_sweep(sweep, table=table)


@pytest.mark.parametrize(
    "rate, limit, warns",
    [(4.0, "1", False), (3.9, "1", True), (2.0, "2", False), (1.99, "2", True), (0.05, "01:00:00", True)],
)
def test_the_time_limit_warning_appears_exactly_when_the_estimate_exceeds_it(
    tmp_path, tiny_model_dir, rate, limit, warns
):
    sweep, table, plan = _plan_with_rate(tmp_path, tiny_model_dir, rate, limit)
    (w,) = plan.work
    assert w.tokens == 240 and w.seconds == pytest.approx(240 / rate)
    lines = time_warnings(plan)
    assert bool(lines) == warns  # 240 tokens at 4/s = 60 s = the 1-minute limit: equal does not warn
    if warns:
        assert lines[0].startswith(f"warning: run {w.key} (")
        assert "launcher profile slurm-local (`time`)" in lines[0] and f"time limit {limit} " in lines[0]


def test_a_local_profile_has_no_time_limit_to_warn_about(tmp_path, tiny_model_dir):
    sweep, table, plan = _plan_with_rate(tmp_path, tiny_model_dir, 0.001, "1")
    plan.profile = LauncherProfile(cluster="local", time="1")
    assert time_warnings(plan) == []


def test_dry_run_prints_the_plan_and_the_warning(tmp_path, tiny_model_dir, capsys, monkeypatch):
    sweep, table, plan = _plan_with_rate(tmp_path, tiny_model_dir, 2.0, "1")
    rates = tmp_path / "rates.yaml"  # measured rates given as a file (as --throughput FILE takes them)
    rates.write_text(
        yaml.safe_dump(
            [{"size": "0.1B", "backend": "hf", "device": "cpu", "tokens_per_s": 2.0, "source": "measured: by hand"}]
        )
    )
    assert main(["sweep", str(tmp_path / "s.yaml"), "--dry-run", "--throughput", str(rates)]) == 0
    out = capsys.readouterr().out
    assert "cost plan (device cpu" in out
    assert _phase_rows(out) == {"training": "240", "total": "240"}
    assert "rate hf 0.1B cpu: 2 tokens/s (measured: by hand)" in out
    assert (
        f"warning: run {plan.work[0].key} (" in out and "over the time limit 1 of launcher profile slurm-local" in out
    )
    monkeypatch.setenv("ESBATCH_THROUGHPUT", str(rates))  # the same file from the environment
    assert main(["sweep", str(tmp_path / "s.yaml"), "--dry-run"]) == 0
    assert "(measured: by hand)" in capsys.readouterr().out
    (tmp_path / "bad.txt").write_text("not rates")
    assert main(["sweep", str(tmp_path / "s.yaml"), "--dry-run", "--throughput", str(tmp_path / "bad.txt")]) == 2
    assert "throughput file:" in capsys.readouterr().err


def test_dry_run_of_a_sweep_with_evals_has_both_phases(tmp_path, tiny_model_dir, capsys):
    assert main(["sweep", _write_sweep(tmp_path, tiny_model_dir), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = plan_sweep(load_sweep(str(tmp_path / "s.yaml")))
    train = sum(w.tokens for w in plan.phase("training"))
    assert _phase_rows(out) == {
        "training": count(train),
        "evaluation": count(4 * 5 * 5 * LE),
        "total": count(train + 4 * 5 * 5 * LE),
    }
    assert "rate hf 0.1B cpu: 50.3 tokens/s (measured: docs/benchmarks.md" in out


def test_the_submission_prints_the_plan_and_the_warning_before_it_submits(tmp_path, tiny_model_dir, monkeypatch):
    calls = []

    def fake_array(profile, sd, job_name, keys, dependency=None):  # the sbatch call, recorded instead of made
        calls.append(list(keys))
        return {"kind": "slurm", "job_id": "7", "array": len(keys) > 1, "keys": list(keys)}

    monkeypatch.setattr(slurm, "_array", fake_array)
    sweep, table, plan = _plan_with_rate(tmp_path, tiny_model_dir, 2.0, "1")
    out = io.StringIO()
    assert submit_sweep(sweep, out=out, table=table) == 0
    text = out.getvalue()
    assert calls == [[plan.work[0].key]]
    assert text.index("cost plan") < text.index("array job 7")
    assert f"warning: run {plan.work[0].key} (" in text and _phase_rows(text)["total"] == "240"


def _gpu_check_output(model):
    """What scripts/gpu_check.py prints at its end: its header line and table (benchmarks/es_kernels.py's markdown),
    the backends' rows as overhead_rows writes them."""
    spec = importlib.util.spec_from_file_location("es_kernels", ROOT / "benchmarks" / "es_kernels.py")
    k = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("es_kernels", k)
    spec.loader.exec_module(k)
    rows = [
        k.Row(
            f"ES overhead ratio, {name} (N=8, B=32, 128 tokens)",
            f"ES update {es:.1f} s = generation ...",
            f"same rollouts, fixed weights: {pure:.1f} s ({rate:.0f} tok/s)",
            es / pure,
        )
        for name, es, pure, rate in (("hf", 9.1, 7.9, 4150), ("vllm", 2.1, 1.4, 23405))
    ]
    where = "GPU: NVIDIA H100 80GB HBM3 x1"
    return (
        f"{where}, torch 2.6.0, model {model}\n...\n\n## GPU check: {where}, {model}, bfloat16\n\n{k.markdown(rows)}\n"
    )


def test_a_saved_gpu_check_output_replaces_the_assumed_rates(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("ESBATCH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "gpu-check.txt"
    path.write_text(_gpu_check_output(tiny_model_dir))
    rates = load_rates(path, lambda name: meta_parameter_count(name))
    assert [(r.size, r.backend, r.device, r.tokens_per_s) for r in rates] == [
        ("0.1B", "hf", "h100", 4150.0),
        ("0.1B", "vllm", "h100", 23405.0),
    ]
    assert all(r.measured and "NVIDIA H100 80GB HBM3" in r.source for r in rates)
    table = Table().with_measurements(rates)
    assert table.get(100, "hf", "h100").tokens_per_s == 4150.0
    assert table.get(2_000_000_000, "hf", "h100").source == ASSUMED  # other sizes keep the table's figure
    assert gpu_check_rates("no table here", "x", lambda n: 1) == []
    (tmp_path / "bad.yaml").write_text("just: a mapping")
    with pytest.raises(ValueError, match="neither a saved scripts/gpu_check.py output"):
        load_rates(tmp_path / "bad.yaml", lambda n: 1)


def test_size_classes_and_device_kinds():
    assert [size_class(n) for n in (135e6, 494e6, 1.5e9, 3.2e9, 7.6e9, 70e9)] == [
        "0.1B",
        "0.5B",
        "1.5B",
        "3B",
        "7B",
        None,
    ]
    assert device_kind(LauncherProfile(cluster="local")) == "cpu"
    assert device_kind(LauncherProfile(cluster="slurm", gpus_per_node=1), "a100") == "a100"
    assert device_kind(LauncherProfile(cluster="slurm", gpus_per_node=1, partition="gpu-h100"), "mine") == "h100"
    gpu = LauncherProfile(cluster="slurm", gpus_per_node=1, extra_sbatch={"constraint": "h200"})
    assert device_kind(gpu, "x") == "h200"
    assert device_kind(LauncherProfile(cluster="slurm", gpus_per_node=4), "x") == "gpu"
    builtin = Table()
    assert all(r.measured == r.source.startswith("measured") for r in builtin.rates.values())
    assert builtin.get(135_000_000, "hf", "cpu").measured and not builtin.get(1.5e9, "vllm", "h100").measured


@pytest.mark.parametrize(("engines", "gpus", "refused"), [(8, 8, False), (9, 8, True), (2, 1, True), (1, 1, False)])
def test_vllm_engines_beyond_a_tasks_gpus_are_refused_before_submitting(
    tmp_path, tiny_model_dir, engines, gpus, refused
):
    """Each vLLM engine needs a GPU: a GPU profile with fewer per task is named at planning, not on the node; the
    boundary (as many engines as GPUs) passes. CPU profiles (gpus_per_node: 0) run engines on cores: no limit."""
    base = toy_config(tiny_model_dir, es_updates=1, backend={"name": "vllm", "engines": engines})
    want = f"backend.engines: {engines} vLLM engines need a GPU each.*gpus_per_node: {gpus}"
    plan_one_run(tmp_path, base, "h100", {"gpus_per_node": gpus}, want if refused else None)
    plan_one_run(tmp_path, base, "local", {}, None)


def plan_one_run(tmp: Path, base: dict, launcher: str, overrides: dict, refused: str | None) -> None:
    """Plan a one-run sweep of ``base`` on ``launcher``: refused with an error matching ``refused``, or planned."""
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = {"name": "s", "base": "base.yaml", "output_dir": str(tmp / "out"), "launcher": launcher}
    sweep["launcher_overrides"] = overrides
    (tmp / "s.yaml").write_text(yaml.safe_dump(sweep))
    if refused:
        with pytest.raises(ConfigError, match=refused):
            load_sweep(str(tmp / "s.yaml"))
    else:
        assert len(load_sweep(str(tmp / "s.yaml")).runs) == 1


@pytest.mark.parametrize(
    ("algorithm", "engine", "transfer", "launcher", "refused"),
    [
        ("grpo", "separate", "ipc", "local", True),  # CUDA IPC on a profile without GPUs
        ("grpo", "separate", "ipc", "h100", False),
        ("grpo", "separate", "rpc", "local", False),
        ("grpo", "separate", "auto", "local", False),  # auto: rpc on CPU
        ("grpo", "in_process", "auto", "h100", False),
        ("es", "separate", "ipc", "local", False),  # ES engines take ES's own weight path, not the GRPO sync
    ],
)
def test_a_grpo_weight_transfer_the_profile_cannot_run_is_refused_before_submitting(
    tmp_path, tiny_model_dir, algorithm, engine, transfer, launcher, refused
):
    """backend.weight_transfer: ipc needs CUDA: a GRPO sweep on a launcher profile without GPUs (gpus_per_node: 0)
    is named at planning, with the key and the valid values, not when the job starts (esbatch/launch/sweep.py:
    engine_errors)."""
    backend = {"name": "vllm", "policy_engine": engine, "weight_transfer": transfer}
    grpo = {"updates": 1} if algorithm == "grpo" else None
    base = toy_config(tiny_model_dir, es_updates=1, algorithm=algorithm, backend=backend, grpo=grpo)
    want = r"backend\.weight_transfer: ipc needs CUDA.*Valid on CPU: auto, rpc \(launcher profile local: gpus_per"
    plan_one_run(tmp_path, base, launcher, {}, want if refused else None)
