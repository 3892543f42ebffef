"""Durable writes of run-state files: a reader sees the old file or the new one, never a partial one.

Every function writes ``<name>.tmp<pid>`` in the target's folder, flushes and fsyncs it, renames it over the
target (``os.replace``: atomic on POSIX file systems, NFS and Lustre included) and fsyncs the folder where the
file system allows it. On any exception (a full disk, an interrupt) the tmp file is removed and the exception
re-raised: the target keeps its old bytes (or stays absent) and nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["open_text", "replacing", "tmp_path", "write_bytes", "write_text"]


def tmp_path(path: str | os.PathLike[str]) -> Path:
    """The temporary file beside ``path`` that this process writes before the rename."""
    p = Path(path)
    return p.with_name(f"{p.name}.tmp{os.getpid()}")


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder: the rename is still atomic
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield the tmp path for the block to write (e.g. a library's ``save(tmp)``); after the block, fsync it and
    rename it over ``path``. An exception in the block or in the rename removes the tmp file and propagates."""
    target = Path(path)
    tmp = tmp_path(target)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename in (None, str(tmp)):
            e.filename = str(target)  # a write() error names no file: name the one that was being replaced
        os_error = as_os_error(e, target)
        if os_error is not None:
            raise os_error from e
        raise
    _fsync_folder(target.parent)


def as_os_error(e: BaseException, path: str | os.PathLike[str]) -> OSError | None:
    """The OSError behind a library's write error that gives the errno only in its message (safetensors: "I/O
    error: No space left on device (os error 28)"), naming ``path``; None when ``e`` is an OSError or has none."""
    m = None if isinstance(e, OSError) else re.search(r"\(os error (\d+)\)", str(e))
    return OSError(int(m[1]), os.strerror(int(m[1])), str(path)) if m else None


@contextlib.contextmanager
def open_text(
    path: str | os.PathLike[str], *, newline: str | None = None, encoding: str = "utf-8"
) -> Iterator[IO[str]]:
    """A text file handle (e.g. for ``csv.writer``) whose content replaces ``path`` when the block ends without
    an exception; with one, ``path`` is left as it was and the tmp file removed."""
    with replacing(path) as tmp, open(tmp, "w", newline=newline, encoding=encoding) as f:
        yield f


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Replace ``path`` by ``data`` durably; returns ``path``."""
    target = Path(path)
    with replacing(target) as tmp, open(tmp, "wb") as f:
        f.write(data)
    return target


def write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8", newline: str | None = None) -> Path:
    """Replace ``path`` by ``text`` durably (``Path.write_text``'s arguments); returns ``path``."""
    target = Path(path)
    with open_text(target, newline=newline, encoding=encoding) as f:
        f.write(text)
    return target
