"""Sweep files: a base run config plus the axes to vary (expanded into runs by esbatch/launch/sweep.py).

name: popsize                     # the sweep folder is <output_dir>/<name>
base: gsm8k-qwen                  # built-in config name or a path (relative to this file)
config: {es: {updates: 300}}      # overrides applied to every run
grid:                             # cartesian product (W&B-style {values: [...]} also accepted)
  es.population_size: [8, 16, 32, 64]
zip:                              # values that go together, one group per entry
  - model.name: [qwen2.5-0.5b-instruct, qwen2.5-1.5b-instruct]
    es.sigma: [0.001, 0.0005]
seeds: [0]                        # run.seed values (another grid axis)
launcher: a100                    # a launcher profile; fields overridable below
launcher_overrides: {time: "12:00:00"}
aggregate: [...]                  # tables and plots (esbatch/config/aggregate.py)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from esbatch.config.schema import ConfigError, Schema, folder_name, setting


@dataclass
class SweepFile(Schema):
    unknown_key: ClassVar[str] = "unknown sweep key"

    name: str = setting(help="Sweep name; its folder is <output_dir>/<name>.", check=folder_name)
    description: str = setting("", "Free text shown by `esbatch status` and in the report.")
    base: str = setting("quickstart", "Built-in run config name or YAML path every run starts from.")
    config: dict = setting({}, "Nested overrides applied to every run.")
    grid: dict = setting({}, "{config.key: [values]}: the cartesian product of the lists.")
    zip: list = setting([], "[{config.key: [values], ...}]: keys in one group vary together.")
    seeds: list | None = setting(None, "run.seed values, one more grid axis.")
    launcher: str | None = setting(None, "Launcher profile name or path (default: local).")
    launcher_overrides: dict = setting({}, "Fields of the launcher profile changed for this sweep.")
    output_dir: str | None = setting(None, "Where the sweep folder goes (default: the base config's run.output_dir).")
    experiment: str | None = setting(None, "MLflow experiment (default: the sweep name).")
    aggregate: list | None = setting(None, "Tables and plots of `esbatch aggregate` (docs/sweeps-and-slurm.md).")
    max_runs: int = setting(
        1000, "Refuse to expand to more runs than this (a guard against a grid typo); raise it for big sweeps.", ge=1
    )

    def validate(self, path: str, errors: list[str]) -> None:
        if self.aggregate is not None:
            from esbatch.config.aggregate import parse_specs

            try:
                parse_specs(self.aggregate, "aggregate")
            except ConfigError as e:
                errors.extend(e.errors)


SWEEP_KEYS = {f.name: f.metadata["help"] for f in dataclasses.fields(SweepFile)}
