"""Launchers: where a sweep's runs execute, behind one interface, chosen by the profile's ``cluster``.

A launcher submits a list of runs (each runs ``SweepTask(sweep_dir)(key)``, which trains or resumes one
run), reports what the scheduler knows of them, and cancels them. ``local`` runs the tasks as subprocesses
here, in the foreground; ``slurm`` submits one array job through submitit. A new launcher is one module
implementing ``Launcher`` and one line in ``LAUNCHERS`` (docs/extending.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from esbatch.config.launcher import LauncherProfile
from esbatch.launch.state import ACTIVE_STATES, SweepDir
from esbatch.registry import Registry


class Launcher(ABC):
    kind: ClassVar[str] = ""
    foreground: ClassVar[bool] = False  # submit() returns only when the runs have ended

    def __init__(self, profile: LauncherProfile) -> None:
        self.profile = profile

    @abstractmethod
    def submit(
        self, sd: SweepDir, name: str, keys: list[str], after: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Start ``keys`` (recording each submission in sweep.json as it is made); returns the records.

        ``after`` maps a key to the key whose task must end successfully first (an eval after its training)."""

    @abstractmethod
    def states(self, sd: SweepDir, submissions: list[dict[str, Any]]) -> dict[str, str]:
        """Run key -> scheduler state (SLURM words: RUNNING, PENDING, COMPLETED, ...) for the runs it knows."""

    @abstractmethod
    def cancel(self, sd: SweepDir, submissions: list[dict[str, Any]]) -> None:
        """Stop what these submissions still run; the runs stay resumable."""

    @abstractmethod
    def describe(self, sd: SweepDir, name: str, n_tasks: int) -> str:
        """What submit() would do, for --dry-run (the SLURM launcher: the exact sbatch script)."""


__all__ = ["ACTIVE_STATES", "LAUNCHERS", "Launcher", "launcher_for"]

LAUNCHERS: Registry[type[Launcher]] = Registry("launcher")
LAUNCHERS.register("local", "esbatch.launch.local:LocalLauncher", help="subprocesses on this machine")
LAUNCHERS.register("slurm", "esbatch.launch.slurm:SlurmLauncher", help="one SLURM array job through submitit")


def launcher_for(profile: LauncherProfile) -> Launcher:
    return LAUNCHERS.get(profile.cluster)(profile)
