"""es.master: host | disk (esbatch/perturb/offload.py): the fp32 center kept away from the weights gives the
same bits as es.master: device for every perturbation, restore, update, load and saved center, and a run
stopped and resumed with the center on disk ends on the uninterrupted device-layout run's center."""

import os

import pytest
import torch
from noise_reference import eps_tensor

from esbatch.config import ConfigError, config_from_dict
from esbatch.perturb import CenteredWeights, OffloadedWeights, UpdateSpec, weights_for
from esbatch.perturb.offload import DiskStore

SHAPES = {
    "embed.weight": (1100, 1000),  # 1.1M elements: two noise chunks (noise.CHUNK = 2^20)
    "layer.q.weight": (48, 40),
    "layer.norm.weight": (40,),
    "head.bias": (7,),
}


def _tensors(dtype):
    g = torch.Generator().manual_seed(3)
    out = {n: (torch.randn(s, generator=g) * 0.05).to(dtype) for n, s in SHAPES.items()}
    # a non-contiguous view, as a vLLM engine's fused tensors can hand out (esbatch/backends/layout.py)
    out["layer.kT.weight"] = (torch.randn(40, 24, generator=g) * 0.05).to(dtype).t()
    return out


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


SPECS = [
    UpdateSpec((11, 12, 13, 14), (0.7, -1.3, 0.0, 0.6), 0.02, 4),
    UpdateSpec((21, 22), (1.0, -1.0), 0.5, 2),
]


@pytest.mark.parametrize("master", ["host", "disk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_centers_give_the_device_layouts_bits(master, dtype, tmp_path):
    ref_live, off_live = _tensors(dtype), _tensors(dtype)
    ref = CenteredWeights(ref_live, track_drift=True)
    off = weights_for(off_live, "exact", True, master=master)
    assert isinstance(off, OffloadedWeights) and off.master is None
    for seed, scale, spec in [(5, 0.01, SPECS[0]), (6, -0.03, SPECS[1])]:
        ref.perturb(seed, scale)
        off.perturb(seed, scale)
        assert _same(ref_live, off_live)
        assert any(not torch.equal(off_live[n], ref.master[n].to(dtype)) for n in off_live)  # it did move
        ref.restore()
        off.restore()
        assert _same(ref_live, off_live) and _same(off_live, {n: t.to(dtype) for n, t in ref.master.items()})
        assert ref.update(spec) == off.update(spec)  # (L2, changed fraction), exactly
        assert _same(ref_live, off_live) and _same(ref.state_dict(), off.state_dict())
    assert off.rel_distance() == pytest.approx(ref.rel_distance(), rel=1e-12) and off.rel_distance() > 0
    assert off.checksum() == pytest.approx(ref.checksum(), rel=1e-12)
    state = {n: t + 0.25 for n, t in ref.state_dict().items()}
    ref.load(state)
    off.load(state)
    assert _same(ref_live, off_live) and _same(off.state_dict(), state)
    report = off.memory_report()
    n = sum(t.numel() for t in off_live.values())
    assert report["master_bytes"] == report["theta0_bytes"] == 4 * n
    assert report["device_copy_bytes"] == (n * off_live["head.bias"].element_size() if master == "host" else 0)
    off.close()


def test_the_stored_center_moves_by_the_explicit_update(tmp_path):
    """Independent of centered.py: the center read back from the file is theta + alpha/N sum_i w_i eps_i, with eps
    from the numpy reference generator (tests/noise_reference.py)."""
    live = _tensors(torch.float32)
    theta = {n: t.double().clone() for n, t in live.items()}
    off = OffloadedWeights(live, track_drift=False, master="disk", folder=tmp_path)
    spec = SPECS[0]
    off.update(spec)
    got = off.state_dict()
    for name, t0 in theta.items():
        if name == "embed.weight":
            continue  # the reference generator is slow on 1.1M elements; its bits equal the device layout's above
        step = sum(w * eps_tensor(s, name, tuple(t0.shape)).double() for s, w in zip(spec.seeds, spec.weights))
        torch.testing.assert_close(got[name].double(), t0 + spec.alpha / spec.n * step, rtol=0, atol=1e-7)


def test_the_disk_center_lives_in_an_unlinked_file_and_reads_back_at_any_offset(tmp_path):
    src = _tensors(torch.float32)
    store = DiskStore(src, folder=tmp_path)
    assert os.listdir(tmp_path) == []  # nothing to clean up after a SIGKILL
    assert store.nbytes() == 4 * sum(t.numel() for t in src.values())
    cpu = torch.device("cpu")
    for name, t in src.items():
        flat = t.reshape(-1)
        for s, e in [(0, flat.numel()), (1, flat.numel() - 1), (flat.numel() // 3, flat.numel() // 2)]:
            assert torch.equal(store.read(name, s, e, cpu), flat[s:e]), (name, s, e)
    store.write("head.bias", 2, torch.tensor([9.0, 8.0]))
    assert store.read("head.bias", 0, 7, cpu)[1:5].tolist() == [
        src["head.bias"][1].item(),
        9.0,
        8.0,
        src["head.bias"][4].item(),
    ]
    assert torch.equal(store.read("layer.norm.weight", 0, 40, cpu), src["layer.norm.weight"])  # the neighbours stay
    fd = store.fd
    store.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_scratch_folder_that_cannot_hold_the_file_is_named(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(OSError, match=r"es.master: disk: cannot create the center's scratch file in .*no/such"):
        DiskStore(_tensors(torch.float32), folder=missing)


@pytest.mark.parametrize(
    ("es", "match"),
    [
        ({"master": "disk", "restore": "inplace"}, "es.master: disk cannot go with es.restore: inplace"),
        ({"master": "host", "perturbation": "lowrank"}, "es.perturbation: lowrank needs es.master: device"),
        ({"master": "ram"}, "es.master"),
    ],
)
def test_layouts_that_cannot_work_are_refused_by_validation(tiny_model_dir, es, match):
    from toy import toy_config

    d = toy_config(tiny_model_dir)
    d["es"] = {**d["es"], **es}
    with pytest.raises(ConfigError, match=match):
        config_from_dict(d)


@pytest.mark.parametrize("master", ["host", "disk"])
def test_a_vllm_worker_with_an_offloaded_center_matches_the_device_worker(tmp_path, master):
    """The worker extension's rpcs on a fused (vLLM-layout) model, without vLLM: es_setup(..., master) makes an
    offloaded center, and perturb / restore / update / es_save give the device layout's bits."""
    from types import SimpleNamespace

    from safetensors.torch import load_file
    from test_layout import _tiny
    from toy import fuse

    from esbatch.backends.vllm_worker import ESWorkerExtension

    hf = _tiny("qwen2")
    shapes = {n: list(t.shape) for n, t in hf.items()}
    workers = {}
    for layout in ("device", master):
        engine = fuse({n: t.clone() for n, t in hf.items()})
        w = ESWorkerExtension()
        w.model_runner = SimpleNamespace(model=SimpleNamespace(named_parameters=lambda e=engine: iter(e.items())))
        assert "error" not in w.es_setup(shapes, True, "philox-gauss", layout)
        workers[layout] = (w, engine)
    for layout, (w, _) in workers.items():
        assert "error" not in w.es_perturb(5, 0.02)
        assert "error" not in w.es_restore()
        out = w.es_update(SPECS[0].to_dict())
        assert "error" not in out, out
        assert "error" not in w.es_save(str(tmp_path / f"{layout}.safetensors"))
    (_, ea), (b, eb) = workers["device"], workers[master]
    assert type(b.es) is OffloadedWeights and _same(ea, eb)
    assert _same(load_file(str(tmp_path / "device.safetensors")), load_file(str(tmp_path / f"{master}.safetensors")))
