"""`esbatch sweep --dry-run` (and a real submission) on a profile with an apptainer ``container:`` warns, before
anything is submitted, when the .sif does not exist where this machine (the login node) sees it; the exact
`apptainer exec` line is printed beside it. No process, no store: the checks read the file system only."""

from __future__ import annotations

import io

import yaml

from esbatch.config.launcher import load_profile
from esbatch.launch import submit
from esbatch.launch.slurm import image_warning
from esbatch.launch.submit import dry_run
from esbatch.launch.sweep import load_sweep


def _profile(image: str, runtime: str = "apptainer", name: str = "a100"):
    return load_profile(name, {"container": {"runtime": runtime, "image": image}})


def test_a_missing_sif_is_named_with_the_profile(tmp_path):
    w = image_warning(_profile(str(tmp_path / "esbatch.sif")), "a100")
    assert w is not None and w.startswith("warning: container.image of the launcher profile a100: ")
    assert f"{tmp_path / 'esbatch.sif'} does not exist on this machine" in w


def test_an_existing_sif_is_fine_and_a_folder_is_not(tmp_path):
    (tmp_path / "esbatch.sif").write_bytes(b"SIF")
    assert image_warning(_profile(str(tmp_path / "esbatch.sif")), "a100") is None
    w = image_warning(_profile(str(tmp_path)), "a100")
    assert w is not None and "is not a file" in w


def test_variables_expand_with_this_machines_environment(tmp_path):
    (tmp_path / "containers").mkdir()
    prof = _profile("$HOME/containers/esbatch.sif")
    w = image_warning(prof, "a100", environ={"HOME": str(tmp_path)})
    assert w is not None and f"(here: {tmp_path}/containers/esbatch.sif) does not exist" in w
    (tmp_path / "containers" / "esbatch.sif").write_bytes(b"SIF")
    assert image_warning(prof, "a100", environ={"HOME": str(tmp_path)}) is None
    # a variable this machine lacks: said, not guessed
    w = image_warning(_profile("${SCRATCH}/esbatch.sif"), "a100", environ={})
    assert w is not None and "names $SCRATCH, unset here" in w


def test_registry_images_docker_and_local_profiles_are_not_checked(tmp_path):
    assert image_warning(_profile("docker://ghcr.io/x/esbatch:1"), "a100") is None
    assert image_warning(_profile("oras://ghcr.io/x/esbatch:1"), "a100") is None
    assert image_warning(_profile("esbatch:0.1.0", runtime="docker"), "a100") is None
    # the local launcher runs no container
    assert image_warning(_profile(str(tmp_path / "x.sif"), name="local"), "local") is None


def test_dry_run_prints_the_apptainer_line_and_the_warning(tmp_path, monkeypatch):
    # the cost plan (model configs, the throughput table) is not what this checks, and takes seconds
    monkeypatch.setattr(submit, "print_plan", lambda *a, **k: None)
    sif = tmp_path / "missing" / "esbatch.sif"
    spec = {
        "name": "t",
        "base": "quickstart",
        "output_dir": str(tmp_path / "out"),
        "launcher": "a100",
        "launcher_overrides": {"container": {"runtime": "apptainer", "image": str(sif)}},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    out = io.StringIO()
    assert dry_run(load_sweep(str(tmp_path / "s.yaml")), out) == 0
    text = out.getvalue()
    assert f"apptainer exec --nv --bind {tmp_path / 'out'}" in text and f" {sif} python -u -m submitit" in text
    assert f"warning: container.image of the launcher profile a100: {sif} does not exist" in text
    assert not (tmp_path / "out").exists()  # nothing written, nothing submitted
