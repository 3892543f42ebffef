"""esbatch/analyze: drift statistics and thresholded checkpoints on hand-built weights with known deltas.

Every delta below is a power of two added to a base value that keeps it exact in fp32, so each count, sum and
maximum has one right answer, computed here by hand (plain Python), never by the code under test."""

import csv
import json
import math
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from esbatch.analyze.drift import analyze_drift, drift_stats, log_edges, param_type, table4_rows
from esbatch.analyze.threshold import threshold_run
from esbatch.cli import main
from esbatch.config import config_from_dict
from esbatch.models import SafetensorsReader
from esbatch.train.rundir import RunDir

E = 2.0**-6  # the maximum update
# name -> (base value, deltas): every (base + delta) is exact in fp32
WEIGHTS = {
    "model.embed_tokens.weight": (1.0, [[0, -(2**-20)], [0, 0], [0, 0]]),
    "model.layers.0.input_layernorm.weight": (1.0, [E, E, 0, -(2**-20)]),
    "model.layers.0.mlp.down_proj.weight": (2.0, [[2**-9, -(2**-8)], [0, 0]]),
    "model.layers.1.self_attn.q_proj.weight": (0.5, [[2**-10, 0, 0], [-(2**-14), 2**-17, 0]]),
    "model.layers.1.self_attn.k_proj.bias": (1.0, [-E, 2**-12]),
}
TAUS = [1e-6, 1e-5, 1e-4, 1e-3]


def _flat(x):
    return [v for row in x for v in (row if isinstance(row, list) else [row])]


def _states():
    base, center = {}, {}
    for name, (b, d) in WEIGHTS.items():
        delta = torch.tensor(d, dtype=torch.float32)
        base[name] = torch.full_like(delta, b)
        center[name] = base[name] + delta
    return base, center


def _model_dir(tmp_path, base):
    """A folder that passes as an HF model: config.json and the base weights in safetensors."""
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text("{}")
    save_file(base, str(d / "model.safetensors"))
    return d


def _run(tmp_path, model_dir, center, name="run", algorithm="es", t=5, dtype="float32"):
    """A run folder as a trainer leaves it: config.yaml naming the base model, center.safetensors after t updates."""
    cfg = config_from_dict(
        {
            "algorithm": algorithm,
            "model": {"name": str(model_dir), "dtype": dtype},
            "task": {"name": "gsm8k"},
            algorithm: {"updates": t},
        }
    )
    rd = RunDir(tmp_path / name)
    rd.path.mkdir(parents=True)
    rd.config.write_text(cfg.to_yaml())
    rd.save_center(center, t)
    return rd


# ----------------------------------------------------------------------------- parameter types


@pytest.mark.parametrize(
    "name, want",
    [
        # Qwen2 (q/k/v biases)
        ("model.layers.3.self_attn.q_proj.weight", ("attn_q", 3)),
        ("model.layers.3.self_attn.k_proj.bias", ("attn_bias", 3)),
        ("model.layers.12.self_attn.v_proj.bias", ("attn_bias", 12)),
        ("model.layers.0.self_attn.o_proj.weight", ("attn_o", 0)),
        ("model.layers.27.post_attention_layernorm.weight", ("norm", 27)),
        ("model.layers.1.mlp.gate_proj.weight", ("mlp", 1)),
        ("model.norm.weight", ("norm", None)),
        ("lm_head.weight", ("lm_head", None)),
        # Llama / SmolLM2
        ("model.embed_tokens.weight", ("embed", None)),
        ("model.layers.5.input_layernorm.weight", ("norm", 5)),
        ("model.layers.5.self_attn.k_proj.weight", ("attn_k", 5)),
        ("model.layers.5.self_attn.v_proj.weight", ("attn_v", 5)),
        ("model.layers.5.mlp.up_proj.weight", ("mlp", 5)),
        ("model.layers.5.mlp.down_proj.weight", ("mlp", 5)),
        ("model.rotary_emb.inv_freq", ("other", None)),  # a buffer, never trained
        ("model.some_new_thing", ("other", None)),
        # two-part names (GPT-2 style, no model. prefix): the module is the first part
        ("wte.weight", ("embed", None)),
        ("ln_f.bias", ("norm", None)),
        ("c_fc.weight", ("mlp", None)),
        ("q_proj.bias", ("attn_bias", None)),
        ("weight", ("other", None)),
    ],
)
def test_param_type_maps_hf_names_to_type_and_layer(name, want):
    assert param_type(name) == want


# ----------------------------------------------------------------------------- the statistics


def _expected_bin(v, per_decade):
    """The bin (lo, hi] of log_edges(per_decade) holding v > 0, counted by hand: the smallest k with
    v <= 10^(k / per_decade), from k = -12 * per_decade."""
    k = -12 * per_decade
    while v > 10 ** (k / per_decade):
        k += 1
    return k + 12 * per_decade


def test_drift_statistics_match_a_hand_count(tmp_path):
    base, center = _states()
    torch_names = list(WEIGHTS)
    b_file, c_file = tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    save_file(base, str(b_file))
    save_file(center, str(c_file))
    st = drift_stats(SafetensorsReader([c_file]), SafetensorsReader([b_file]), taus=TAUS, top_k=4, edges=log_edges(1))

    deltas = {n: [abs(x) for x in _flat(d)] for n, (_, d) in WEIGHTS.items()}
    every = [v for n in torch_names for v in deltas[n]]
    nonzero = [v for v in every if v > 0]
    assert st.n_total == 4 + 6 + 2 + 6 + 4 == len(every)
    assert st.n_nonzero == 11 == len(nonzero)
    sq_theta0 = sum(WEIGHTS[n][0] ** 2 * len(deltas[n]) for n in torch_names)
    assert st.rel_l2 == pytest.approx(math.sqrt(sum(v * v for v in every) / sq_theta0), rel=1e-12)
    # s_tau: 2^-20 (twice) <= 1e-6; + 2^-17 <= 1e-5; + 2^-14 <= 1e-4; + 2^-12, 2^-10 <= 1e-3
    assert st.below == [2, 3, 4, 6]
    assert st.s_tau() == [2 / 11, 3 / 11, 4 / 11, 6 / 11]
    assert st.max_abs == E and st.max_count == 3
    assert st.max_tensors == {"model.layers.0.input_layernorm.weight": 2, "model.layers.1.self_attn.k_proj.bias": 1}

    # histograms: one bin per decade, per type
    want = {}
    for n in torch_names:
        h = want.setdefault(param_type(n)[0], [0] * 14)
        for v in deltas[n]:
            if v > 0:
                h[_expected_bin(v, 1)] += 1
    assert st.hist == want
    assert st.hist["norm"][_expected_bin(E, 1)] == 2 and sum(st.hist["norm"]) == 3  # 2^-6 in (1e-2, 1e-1]
    assert st.n_by_type == {"embed": 6, "norm": 4, "mlp": 4, "attn_q": 6, "attn_bias": 2}

    # top 4: the three maxima (file order among equals), then 2^-8 in the MLP
    assert [(r["tensor"], r["index"], r["abs_delta"]) for r in st.top] == [
        ("model.layers.0.input_layernorm.weight", 0, E),
        ("model.layers.0.input_layernorm.weight", 1, E),
        ("model.layers.1.self_attn.k_proj.bias", 0, E),
        ("model.layers.0.mlp.down_proj.weight", 1, 2**-8),
    ]
    assert st.top_by_type_layer() == {("norm", 0): 2, ("attn_bias", 1): 1, ("mlp", 0): 1}


def test_finer_bins_and_bf16_rounding_of_the_final_weights(tmp_path):
    base, center = _states()
    save_file(base, str(tmp_path / "b.safetensors"))
    save_file(center, str(tmp_path / "c.safetensors"))
    readers = (SafetensorsReader([tmp_path / "c.safetensors"]), SafetensorsReader([tmp_path / "b.safetensors"]))
    st = drift_stats(*readers, taus=TAUS, edges=log_edges(4))
    deltas = [abs(x) for _, d in WEIGHTS.values() for x in _flat(d) if x != 0]
    counts = [0] * (len(log_edges(4)) + 1)
    for v in deltas:
        counts[_expected_bin(v, 4)] += 1
    assert [sum(col) for col in zip(*st.hist.values())] == counts

    # bf16 keeps 8 significant bits: 1 + 2^-20 -> 1 (those updates vanish), 2 + 2^-9 -> 2, 0.5 + 2^-14 -> 0.5 ...
    bf = drift_stats(*readers, taus=TAUS, as_dtype="bfloat16")
    want = [abs(float(torch.tensor(b + x).bfloat16().float()) - b) for b, d in WEIGHTS.values() for x in _flat(d)]
    assert bf.n_nonzero == sum(v > 0 for v in want) and bf.max_abs == max(want) == E


def test_the_analysis_holds_one_tensor_at_a_time(tmp_path):
    base, center = _states()
    save_file(base, str(tmp_path / "b.safetensors"))
    save_file(center, str(tmp_path / "c.safetensors"))
    live = []  # weak references to every tensor handed out

    class Counting(SafetensorsReader):
        def get(self, name):
            alive = [n for n, r in live if r() is not None and n != name]
            assert not alive, f"reading {name} while {alive} are still held"
            t = super().get(name)
            live.append((name, weakref.ref(t)))
            return t

    st = drift_stats(Counting([tmp_path / "c.safetensors"]), Counting([tmp_path / "b.safetensors"]), taus=TAUS)
    assert [n for n, _ in live] == [n for name in sorted(WEIGHTS) for n in (name, name)]  # each once per file
    assert st.n_nonzero == 11


# ----------------------------------------------------------------------------- run folders, files, CLI


def test_threshold_zeroes_exactly_the_small_updates_and_keeps_the_rest_bit_exact(tmp_path):
    base, center = _states()
    rd = _run(tmp_path, _model_dir(tmp_path, base), center)
    folders = threshold_run(rd.path, [1e-4, 1e-6])
    assert [f.name for f in folders] == ["tau-1e-06", "tau-0.0001"]
    for tau, folder in zip([1e-6, 1e-4], folders):
        got = load_file(str(folder / "center.safetensors"))
        assert sorted(got) == sorted(center)
        for name in WEIGHTS:
            d = center[name] - base[name]
            small = (d.abs() > 0) & (d.abs() <= tau)
            assert torch.equal(got[name][small], base[name][small])  # theta_i := theta0_i
            assert torch.equal(got[name][~small], center[name][~small])  # every other coordinate bit-exact
        with safe_open(str(folder / "center.safetensors"), framework="pt") as f:
            assert f.metadata()["t"] == "5" and f.metadata()["tau"] == f"{tau:g}"
        s = json.loads((folder / "s_tau.json").read_text())
        zeroed = {1e-6: 2, 1e-4: 4}[tau]
        assert (s["zeroed"], s["nonzero"], s["total"]) == (zeroed, 11, 22)
        assert s["s_tau"] == zeroed / 11 and s["kept_share_of_all"] == (11 - zeroed) / 22
        assert RunDir(folder).center_t() == 5 and RunDir(folder).exists()  # evaluable like a run folder
        meta = RunDir(folder).read_meta()
        assert (meta["status"], meta["tau"], meta["done"]) == ("thresholded", tau, 5)  # what status reads
    # the thresholded checkpoint's own drift: exactly the kept updates
    st = drift_stats(
        SafetensorsReader([folders[1] / "center.safetensors"]),
        SafetensorsReader([rd.path.parent / "base" / "model.safetensors"]),
        taus=[1e-4],
    )
    assert st.n_nonzero == 7 and st.below == [0]


def test_a_bf16_run_is_compared_in_bf16_by_default_and_threshold_counts_as_drift_does(tmp_path):
    """s_tau of a bf16 model counts the deployed (bf16) weights' changes unless fp32 is asked for, and a thresholded
    checkpoint zeroes exactly the coordinates drift counts, also for a |delta| exactly at tau (the tie rule)."""
    base, center = _states()
    rd = _run(tmp_path, _model_dir(tmp_path, base), center, dtype="bfloat16")
    # by hand: each coordinate's |bf16(theta_final) - theta_0| (theta_0 is exact in bf16), and the fp32 one
    in_bf16 = [abs(float(torch.tensor(b + x).bfloat16().float()) - b) for b, d in WEIGHTS.values() for x in _flat(d)]
    in_fp32 = [abs(x) for _, d in WEIGHTS.values() for x in _flat(d)]
    assert sum(v > 0 for v in in_bf16) < sum(v > 0 for v in in_fp32)  # bf16 rounding drops some updates
    taus = sorted({v for v in in_bf16 + in_fp32 if v > 0} | {1.5e-3})  # every tau exactly at some |delta|
    for as_dtype, want in ((None, in_bf16), ("float32", in_fp32)):
        ((_, st, _),) = analyze_drift([rd.path], taus=taus, as_dtype=as_dtype, mlflow=False)
        assert st.delta_dtype == (as_dtype or "bfloat16")
        assert st.n_nonzero == sum(v > 0 for v in want)
        assert st.below == [sum(0 < v <= tau for v in want) for tau in taus]
        for folder in threshold_run(rd.path, taus, as_dtype=as_dtype):
            s = json.loads((folder / "s_tau.json").read_text())
            j = taus.index(s["tau"])
            assert (s["zeroed"], s["nonzero"], s["delta_dtype"]) == (st.below[j], st.n_nonzero, st.delta_dtype)


def test_bad_inputs_exit_2_with_a_clear_message(tmp_path, capsys):
    base, center = _states()
    rd = _run(tmp_path, _model_dir(tmp_path, base), center)
    cases = [
        (["analyze", "drift", str(tmp_path / "nope")], "no such run folder"),
        (["analyze", "drift", str(tmp_path / "base")], "not a run folder"),
        (["analyze", "drift", str(rd.path), "--tau", "0"], "must be finite numbers > 0"),
        (["threshold", str(rd.path), "--tau", "1e-6", "-0.001"], "must be finite numbers > 0"),
        (["threshold", str(tmp_path / "nope"), "--tau", "1e-6"], "no such run folder"),
    ]
    empty = RunDir(tmp_path / "empty")
    empty.path.mkdir()
    empty.config.write_text(rd.config.read_text())
    cases.append((["threshold", str(empty.path), "--tau", "1e-6"], "no center.safetensors"))
    other = dict(center, **{"model.extra.weight": torch.zeros(2)})
    wrong = _run(tmp_path, tmp_path / "base", other, "wrong")
    cases.append((["analyze", "drift", str(wrong.path)], "model.extra.weight of the center is not in the base"))
    for argv, words in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err, (argv, err)
    assert not (rd.path / "thresholded").exists()


def test_table4_row_carries_the_hand_counted_statistics(tmp_path):
    base, center = _states()
    b_file, c_file = tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    save_file(base, str(b_file))
    save_file(center, str(c_file))
    st = drift_stats(SafetensorsReader([c_file]), SafetensorsReader([b_file]), taus=TAUS, top_k=4, edges=log_edges(1))
    (row,) = table4_rows([st], None)
    assert row["rel_l2_x1e-2"] == round(100 * st.rel_l2, 6) and row["ratio_to_reference"] == ""
    assert [row[f"s_tau@{t:g} (%)"] for t in TAUS] == [round(100 * k / 11, 4) for k in (2, 3, 4, 6)]
    assert row["nonzero_share (%)"] == round(100 * 11 / 22, 4)
    assert (row["max_abs_delta"], row["n_at_max"]) == (E, 3)
    (twice,) = table4_rows([st], st)
    assert twice["ratio_to_reference"] == 1.0


def test_a_model_folder_is_a_reference_as_a_run_is(tmp_path, capsys):
    """Table 4's GRPO side given as a model (a released checkpoint's folder), not a run: its drift from the runs'
    base model divides theirs; a reference that is neither a run nor a model is named."""
    base, center = _states()
    model_dir = _model_dir(tmp_path, base)
    rd = _run(tmp_path, model_dir, center)
    half = {n: base[n] + (center[n] - base[n]) / 2 for n in base}  # every delta halved: exact in fp32
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text("{}")
    save_file(half, str(released / "model.safetensors"))
    done = analyze_drift([rd.path], released, taus=TAUS, mlflow=False)
    (none, ref, no_folder), (_, st, _) = done
    assert none is None and no_folder is None and ref.label == str(released)
    assert ref.rel_l2 == pytest.approx(st.rel_l2 / 2, rel=1e-12)
    row = table4_rows([st], ref)[0]
    assert row["ratio_to_reference"] == 2.0
    table = (rd.path / "analysis" / "drift" / "table4.md").read_text()
    assert str(released) in table  # the reference's row beside the run's
    assert main(["analyze", "drift", str(rd.path), "--reference", str(tmp_path / "nothing"), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert f"reference {tmp_path / 'nothing'}: neither a run folder" in err, err
    (released / "model.safetensors").write_bytes(b"x" * 7)  # a damaged file: named, no traceback
    assert main(["analyze", "drift", str(rd.path), "--reference", str(released), "--no-mlflow"]) == 2
    err = capsys.readouterr().err
    assert f"reference {released}: its weights cannot be read" in err and "Traceback" not in err, err


def test_the_sweep_drift_analysis_tabulates_each_panel_against_its_reference(tmp_path):
    """aggregate kind `drift` (Table 4 in a sweep's results): the reference method's run first, the ratio of each
    run to it, unfinished runs named; a model as reference gets its own first row."""
    from esbatch.aggregate.drift import write_drift
    from esbatch.aggregate.report import _selected
    from esbatch.aggregate.results import RunResult
    from esbatch.config.aggregate import parse_specs
    from esbatch.launch.state import SweepDir

    base, center = _states()
    model_dir = _model_dir(tmp_path, base)
    half = {n: base[n] + (center[n] - base[n]) / 2 for n in base}
    sd = SweepDir(tmp_path / "sw")
    _run(sd.run_dir("k-es").path.parent, model_dir, center, name="k-es")
    _run(sd.run_dir("k-grpo").path.parent, model_dir, half, name="k-grpo", algorithm="grpo")
    point = {"model.name": "m"}
    runs = [
        RunResult("k-es", "ES", "finished", {**point, "method": "ES"}, 5),
        RunResult("k-grpo", "GRPO", "finished", {**point, "method": "GRPO"}, 5),
        RunResult("k-pipe", "ES->GRPO", "failed", {**point, "method": "ES->GRPO"}, 5),
    ]
    (a,) = parse_specs([{"kind": "drift", "name": "t4", "reference": "GRPO", "taus": TAUS, "top_k": 4}])
    out = tmp_path / "results"
    out.mkdir()
    write_drift(runs, a, out, sd.path)
    rows = list(csv.DictReader((out / "t4.csv").open()))
    assert [r["run"] for r in rows] == ["GRPO", "ES"]  # the reference first
    es = rows[1]
    assert float(es["ratio_to_reference"]) == 2.0 and es["delta_dtype"] == "float32"
    assert es["top_by_type"] == "norm 2, attn_bias 1, mlp 1"  # |delta| E three times (2 norm, 1 bias), then 2^-8
    assert es["s_tau@1e-06 (%)"] == str(round(100 * 2 / 11, 4))  # the hand count of the first test
    md = (out / "t4.md").read_text()
    assert "ES->GRPO (k-pipe): failed, not analysed" in md
    released = tmp_path / "released"
    released.mkdir()
    save_file(half, str(released / "model.safetensors"))
    (released / "config.json").write_text("{}")
    (b,) = parse_specs([{"kind": "drift", "name": "t4m", "reference": str(released), "select": {"method": ["ES"]}}])
    write_drift(_selected(runs, b), b, out, sd.path)  # as write_report calls it: the runs its select keeps
    rows = list(csv.DictReader((out / "t4m.csv").open()))
    assert [r["run"] for r in rows] == [str(released), "ES"] and float(rows[1]["ratio_to_reference"]) == 2.0
