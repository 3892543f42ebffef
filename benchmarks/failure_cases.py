"""What each I/O failure leaves behind: the real `esbatch train` (a tiny model, the toy task) run into a full disk, a
permission error, an immutable file, a read-only file system, a locked, damaged or missing MLflow store and a
damaged model or data file. Prints one markdown row per case: the exit code, the first line of the error, the state
of run.json, of the MLflow run and of tmp files afterwards (issue 29's table).

Needs root: it mounts small tmpfs file systems, sets the immutable attribute, and drops the capability to override
file modes for the permission cases. About 3 minutes on 2 cores, 40 s of it a sqlite lock held on purpose.

    .venv/bin/python benchmarks/failure_cases.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from toy import make_tiny_model, toy_config  # noqa: E402

ESBATCH = str(ROOT / ".venv" / "bin" / "esbatch")


def write_config(base: Path, model: Path, output_dir: Path, db: Path, **task) -> Path:
    cfg = toy_config(model, es_updates=2, run={"name": "r", "seed": 0, "threads": 1, "output_dir": str(output_dir)})
    if task:
        cfg["task"] = {**task, "heldout_size": 4, "few_shot": 1}
    cfg["tracking"] = {"uri": f"sqlite:///{db}"}
    path = base / "r.yaml"
    path.write_text(yaml.safe_dump(cfg))
    os.chmod(base, 0o755)
    os.chmod(path, 0o644)
    return path


def esbatch(*args: str, as_user: bool = False) -> tuple[int, str]:
    """``esbatch ARGS``; ``as_user``: as root without the capability to override file modes, so they apply as they
    do to an ordinary user (the interpreter here lives under /root, which no other user may enter)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    cmd = [ESBATCH, *args, "--no-progress"]
    if as_user:
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", "--", *cmd]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return p.returncode, p.stderr


def first_message(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "warning:", "Traceback"))]
    if any(ln.startswith("Traceback") for ln in err.splitlines()):
        return "TRACEBACK: " + err.strip().splitlines()[-1][:150]
    return (lines[0] if lines else "-")[:170]


def run_state(run: Path) -> str:
    try:
        meta = json.loads((run / "run.json").read_text())
    except FileNotFoundError:
        return "none"
    except (OSError, ValueError) as e:
        return f"unreadable ({type(e).__name__})"
    reason = f", reason: {meta['reason'][:60]}…" if meta.get("reason") else ""
    return f"{meta.get('status')}{reason}"


def mlflow_state(db: Path, run: Path) -> str:
    try:
        rid = json.loads((run / "run.json").read_text()).get("mlflow_run_id")
    except (OSError, ValueError):
        rid = None
    if rid is None:
        return "no run created"
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            row = con.execute("SELECT status FROM runs WHERE run_uuid = ?", (rid,)).fetchone()
    except sqlite3.Error as e:
        return f"store unreadable ({e})"
    spool = run / "tracking.pending.jsonl"
    pending = (
        f"; {len(spool.read_text().splitlines())} writes spooled" if spool.exists() and spool.stat().st_size else ""
    )
    return (row[0] if row else "not in store") + pending


def tmp_left(*roots: Path) -> str:
    left = [str(p) for r in roots if r.exists() for p in r.rglob("*") if ".tmp" in p.name or ".seed" in p.name]
    return ", ".join(left) or "none"


MOUNTS: list[Path] = []  # unmounted after each case's row is read


def tmpfs(path: Path, size: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    MOUNTS.append(path)
    return path


def finished_run(base: Path, model: Path, out: Path, db: Path) -> Path:
    """A run that trained 2 updates and finished: later cases resume it with a larger budget."""
    rc, err = esbatch("train", str(write_config(base, model, out, db)))
    assert rc == 0, err
    return out / "r"


CASES: dict[str, Callable[[Path, Path], tuple[int, str, Path, Path, list[Path]]]] = {}


def case(name: str):
    def reg(f):
        CASES[name] = f
        return f

    return reg


@case("disk full (a 64 KiB tmpfs: the center export does not fit)")
def disk_full(base, model):
    mnt = tmpfs(base / "small", "64k")
    db = base / "mlflow.db"
    rc, err = esbatch("train", str(write_config(base, model, mnt, db)))
    return rc, err, mnt / "r", db, [mnt]


@case("no permission: output_dir mode 0555")
def no_permission(base, model):
    out = base / "out"
    out.mkdir(mode=0o555)
    db = base / "mlflow.db"
    rc, err = esbatch("train", str(write_config(base, model, out, db)), as_user=True)
    return rc, err, out / "r", db, [out]


@case("no permission: the run folder made mode 0555, resumed with a larger budget")
def no_permission_resume(base, model):
    db, out = base / "mlflow.db", base / "out"
    run = finished_run(base, model, out, db)
    os.chmod(run, 0o555)
    rc, err = esbatch("train", "--resume", str(run), "--set", "es.updates=3", as_user=True)
    os.chmod(run, 0o755)
    return rc, err, run, db, [out]


@case("immutable run.json (chattr +i), resumed with a larger budget")
def immutable(base, model):
    db, out = base / "mlflow.db", base / "out"
    run = finished_run(base, model, out, db)
    subprocess.run(["chattr", "+i", str(run / "run.json")], check=True)
    try:
        rc, err = esbatch("train", "--resume", str(run), "--set", "es.updates=3")
    finally:
        subprocess.run(["chattr", "-i", str(run / "run.json")], check=True)
    return rc, err, run, db, [out]


@case("read-only file system, resumed with a larger budget")
def read_only(base, model):
    mnt = tmpfs(base / "ro", "16m")
    db = base / "mlflow.db"
    run = finished_run(base, model, mnt, db)
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    rc, err = esbatch("train", "--resume", str(run), "--set", "es.updates=3")
    return rc, err, run, db, [mnt]


@case("sqlite store write-locked for 40 s when the run starts")
def locked_store(base, model):
    db = base / "mlflow.db"
    rc, err = esbatch("train", str(write_config(base, model, base / "warm", db)))  # the store exists
    assert rc == 0, err
    con = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    con.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(40.0, lambda: (con.execute("COMMIT"), con.close()))
    release.start()
    rc, err = esbatch("train", str(write_config(base, model, base / "out", db)))
    release.join()
    return rc, err, base / "out" / "r", db, [base]


def _damaged_store(base, model, damage):
    db = base / "mlflow.db"
    rc, err = esbatch("train", str(write_config(base, model, base / "warm", db)))
    assert rc == 0, err
    damage(db)
    rc, err = esbatch("train", str(write_config(base, model, base / "out", db)))
    return rc, err, base / "out" / "r", db, [base]


@case("MLflow store truncated to half")
def truncated_store(base, model):
    return _damaged_store(base, model, lambda db: db.write_bytes(db.read_bytes()[: db.stat().st_size // 2]))


@case("MLflow store overwritten with zeros")
def zeroed_store(base, model):
    return _damaged_store(base, model, lambda db: db.write_bytes(bytes(db.stat().st_size)))


@case("MLflow store deleted, run resumed with a larger budget")
def missing_store(base, model):
    db, out = base / "mlflow.db", base / "out"
    run = finished_run(base, model, out, db)
    db.unlink()
    rc, err = esbatch("train", "--resume", str(run), "--set", "es.updates=3")
    return rc, err, run, db, [base]


@case("model.safetensors torn (first 100 bytes)")
def torn_model(base, model):
    torn = Path(shutil.copytree(model, base / "model"))
    (torn / "model.safetensors").write_bytes((torn / "model.safetensors").read_bytes()[:100])
    db = base / "mlflow.db"
    rc, err = esbatch("train", str(write_config(base, torn, base / "out", db)))
    return rc, err, base / "out" / "r", db, [base]


@case("data file torn (gsm8k jsonl cut 30 bytes short)")
def torn_data(base, model):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{2 * i}\n#### {2 * i}"} for i in range(12)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (base / "gsm8k.jsonl").write_text(text[:-30])
    db = base / "mlflow.db"
    rc, err = esbatch(
        "train", str(write_config(base, model, base / "out", db, name="gsm8k", data_path=str(base / "gsm8k.jsonl")))
    )
    return rc, err, base / "out" / "r", db, [base]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="write the cases' folders here and keep them")
    ap.add_argument("-k", help="only cases whose name contains this")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks/failure_cases.py needs root (tmpfs mounts, chattr, runuser)")
    top = Path(args.keep or tempfile.mkdtemp(prefix="esbatch-failures-"))
    top.mkdir(parents=True, exist_ok=True)
    os.chmod(top, 0o755)
    model = make_tiny_model(top / "model")
    for p in [model, *model.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    print("| case | exit | message (first line) | run.json | MLflow run | tmp files left |")
    print("|---|---:|---|---|---|---|")
    for i, (name, fn) in enumerate(CASES.items()):
        if args.k and args.k not in name:
            continue
        base = top / f"case{i}"
        base.mkdir()
        try:
            rc, err, run, db, roots = fn(base, model)
            row = [str(rc), first_message(err), run_state(run), mlflow_state(db, run), tmp_left(*roots)]
        finally:
            while MOUNTS:
                subprocess.run(["umount", "-l", str(MOUNTS.pop())], check=False)
        cells = [c.replace("|", "\\|").replace("\n", " ") for c in [name, *row]]
        print("| " + " | ".join(cells) + " |", flush=True)
    if not args.keep:
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    main()
