"""`uv pip install` into a virtual environment with pip's own settings, for scripts/setup.sh and setup-vllm.sh.

    python scripts/uv_pip.py VENV ARGS...     # e.g. .venv -c constraints.txt -e ".[dev]"

uv installs the same packages as pip in a fraction of the time (it downloads, unpacks and compiles in parallel),
but reads neither pip.conf nor the PIP_* variables. On a machine whose pip is pointed at a wheel folder, extra
indexes or a constraint file (this project's CI machines: the CPU torch in a local folder, a cap on torch), uv would
resolve differently from pip, or download a CUDA torch. So this passes pip's settings on (`pip config list`: its
files and PIP_* variables; find-links, index and extra index URLs and constraints are all kept, the certificate goes
to SSL_CERT_FILE unless that is set) and keeps pip's behaviour where uv's default differs: every index is searched for
the best version (--index-strategy unsafe-best-match), and bytecode is compiled at install (--compile-bytecode:
where PYTHONDONTWRITEBYTECODE is set, a process cannot write the .pyc files it imports, and compiles torch's
modules again at every start). uv itself is pip-installed into VENV, pinned (UV_VERSION).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

UV_VERSION = "0.13.9"
# pip's option -> uv's flag; the values of each are whitespace-separated lists, all of them kept
FLAGS = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "constraint": "--constraint"}


def pip_settings(python: str) -> tuple[list[str], dict[str, str]]:
    """uv's flags and environment for the settings of ``python``'s pip."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    return uv_options(out, os.environ)


def uv_options(config_list: str, environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's flags and environment for pip's settings as ``pip config list`` prints them (``origin.name='value'``,
    the origin ``:env:`` for a PIP_* variable)."""
    flags: list[str] = []
    seen: set[tuple[str, str]] = set()
    env: dict[str, str] = {}
    index_url: dict[bool, str] = {}
    for line in config_list.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        origin, _, name = key.rpartition(".")
        value = str(ast.literal_eval(raw))
        if name in FLAGS:
            for item in value.split():
                if (name, item) not in seen:  # a PIP_FIND_LINKS variable may repeat pip.conf's folder
                    seen.add((name, item))
                    flags += [FLAGS[name], item]
        elif name == "index-url":  # one index: a PIP_INDEX_URL variable wins over the files, as in pip
            index_url[origin == ":env:"] = value
        elif name == "cert" and "SSL_CERT_FILE" not in environ:
            env["SSL_CERT_FILE"] = value
    if index_url:
        flags += ["--index-url", index_url.get(True, index_url.get(False, ""))]
    return flags, env


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    venv, args = Path(argv[0]), argv[1:]
    python = str(venv / "bin" / "python")
    uv = venv / "bin" / "uv"
    if not uv.exists():
        subprocess.run([python, "-m", "pip", "install", "-qq", f"uv=={UV_VERSION}"], check=True)  # -qq: no warnings
    flags, env = pip_settings(python)
    cmd = [str(uv), "pip", "install", "-q", "--python", python, "--index-strategy", "unsafe-best-match"]
    cmd += ["--compile-bytecode", *flags, *args]
    return subprocess.run(cmd, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
