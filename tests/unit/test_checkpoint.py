import pytest
import torch

from esbatch.train.rundir import RunDir


def test_torn_last_log_line_is_dropped_and_cut_off(tmp_path):
    rd = RunDir(tmp_path)
    rd.append_update({"t": 0, "x": 1})
    rd.append_update({"t": 1, "x": 2})
    with open(rd.log, "a") as f:
        f.write('{"t": 2, "x"')  # killed mid-write
    assert [r["t"] for r in rd.updates()] == [0, 1]
    rd.repair_log()  # what a resuming trainer does first (readers never cut a file)
    rd.append_update({"t": 2, "x": 3})  # appending after the cut gives a clean log
    assert [r["t"] for r in rd.updates()] == [0, 1, 2]


def test_out_of_order_log_is_refused(tmp_path):
    rd = RunDir(tmp_path)
    rd.append_update({"t": 1})
    with pytest.raises(RuntimeError, match="corrupt"):
        rd.updates()


def test_center_checkpoint_roundtrip_is_exact_and_atomic(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.load_center() is None
    state = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    rd.save_center(state, 7)
    got, t = rd.load_center()
    assert t == 7 and all(torch.equal(got[k], state[k]) for k in state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["center.safetensors"]  # no temp files left


def test_meta_merges_fields(tmp_path):
    rd = RunDir(tmp_path)
    rd.write_meta(a=1)
    rd.write_meta(b=2)
    assert rd.read_meta() == {"a": 1, "b": 2}
