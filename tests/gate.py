"""A gate: "B happens while A runs", by construction instead of by sleeping and hoping.

The code under test (in another process: a training run, a sweep task, a rank) calls ``wait_at(path, tag)`` at
the moment the test wants to act in (tests/toy.py's ``GatedDigitTask`` does it inside a scorer, so the process
is mid-update). The test holds a ``Gate``: ``arrivals(n)`` returns once n processes wait at it, the test acts
(a signal, a kill, a cancel from another shell), and ``release()`` lets them go on. Nothing is timed: the
waiting process blocks on a socket until the test answers, and a signal handler that only sets a flag (the
stop policy) does not end that wait (PEP 475 retries it). The only clock is the safety limit that fails a
test whose processes never arrive.

Once the gate is closed its socket is gone and ``wait_at`` passes at once, so a resumed run is not held again.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile


def wait_at(path: str, tag: str) -> str:
    """Block until the test releases the gate at ``path``; pass at once if there is none (closed, or never
    opened). ``tag`` tells the test who arrived (e.g. a pid). Returns the test's word: "go", "stop" (go on once
    a stop signal has arrived: ``Gate.release(stopped=True)``), or "" (no gate, or it closed)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError:
        s.close()
        return ""
    with s:
        try:
            s.sendall(f"{tag}\n".encode())
            return s.recv(16).decode().strip()  # "" when the test closed its end or ended
        except OSError:  # the gate closed between our connect and its accept
            return ""


def gate_path() -> str:
    """A fresh path for a gate, short enough for a Unix socket: write it into a config before the gate opens
    (a run started before that, e.g. an undisturbed reference, passes it)."""
    return os.path.join(tempfile.mkdtemp(prefix="esbatch-gate-"), "gate")


class Arrival:
    """One process waiting at a gate: its tag, and ``release`` for it alone."""

    def __init__(self, tag: str, conn: socket.socket) -> None:
        self.tag, self._conn = tag, conn

    def release(self, stopped: bool = False) -> None:
        """Let it go on (nothing happens if it was killed meanwhile); ``stopped``: see ``Gate.release``."""
        try:
            self._conn.sendall(b"stop\n" if stopped else b"go\n")
        except OSError:
            pass
        self._conn.close()


class Gate:
    """The test's side: a listening Unix socket at ``path`` (default: a new ``gate_path()``; socket paths are
    limited to about 100 characters, which pytest's tmp_path can exceed)."""

    def __init__(self, path: str | None = None, limit_s: float = 900) -> None:
        self.path = path or gate_path()
        self.dir = os.path.dirname(self.path)
        self.limit_s = limit_s
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(128)
        self._server.settimeout(limit_s)
        self._waiting: list[Arrival] = []

    def next(self) -> Arrival | None:
        """The next process to arrive, waiting for it (up to the safety limit: AssertionError); None once the
        gate is closed (another thread may close it to end a loop over arrivals)."""
        try:
            conn, _ = self._server.accept()
        except TimeoutError as e:
            raise AssertionError(f"no process reached the gate within {self.limit_s} s") from e
        except OSError:  # closed
            return None
        conn.settimeout(self.limit_s)
        return Arrival(conn.makefile("r").readline().strip(), conn)

    def arrivals(self, n: int) -> list[str]:
        """Wait until ``n`` processes in all wait at the gate; their tags in order of arrival."""
        while len(self._waiting) < n:
            try:
                a = self.next()
            except AssertionError as e:
                got = [w.tag for w in self._waiting]
                raise AssertionError(f"{len(got)} of {n} processes reached the gate: {got}; {e}") from e
            if a is None:
                break
            self._waiting.append(a)
        return [w.tag for w in self._waiting]

    def release(self, stopped: bool = False) -> None:
        """Let every process waiting now go on (one that was killed meanwhile is skipped). ``stopped``: each goes
        on only once its stop flag is set (the signal the test sent, possibly through a launcher that passes it
        on, has arrived), so the update it is in is the last one it runs."""
        for a in self._waiting:
            a.release(stopped)
        self._waiting.clear()

    def close(self) -> None:
        """Release the waiting processes and remove the gate: later ``wait_at`` calls pass at once."""
        self.release()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept
        except OSError:
            pass
        self._server.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
