"""`esbatch aggregate` and the other commands do not load torch or transformers (issue 40): importing
esbatch/cli.py loads none of torch, transformers, mlflow, matplotlib (each is imported by the function that needs
it), and a report of every kind that reads only metrics and run folders (curves with the Wilson band,
heldout_change, scaling, final) loads neither torch nor transformers nor mlflow. torch at import cost every
command about 1.3 s of CPU (esbatch/aggregate/report.py took one string from esbatch/train/problems.py, which
imports esbatch/backends/base.py). Checked in a fresh interpreter: in pytest's own process other tests load them."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "mlflow", "matplotlib", "deepspeed", "vllm", "pandas")

CHECK = """
import json, sys
from pathlib import Path

HEAVY = {heavy!r}
loaded = lambda: sorted(m for m in HEAVY if m in sys.modules)
import esbatch.cli  # noqa: F401
at_import = loaded()

from esbatch.aggregate.report import parse_analyses, write_report
from esbatch.aggregate.results import RunResult

sweep = Path(sys.argv[1])
runs = []
for key, pop, (before, after) in (("a", 2, ("0011", "0111")), ("b", 4, ("0001", "1111"))):
    folder = sweep / "runs" / key
    folder.mkdir(parents=True)
    recs = [{{"t": t, "heldout/accuracy": v.count("1") / 4, "heldout/correct": v}}
            for t, v in ((0, before), (4, after))]
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in recs))
    params = {{"es.population_size": pop, "run.seed": 0, "task.heldout_size": 4}}
    hist = {{"reward/mean": [(s, 0.1 * s) for s in range(1, 5)], "heldout/accuracy": [(0, 0.5), (4, 0.75)]}}
    runs.append(RunResult(key, f"population_size={{pop}}", "finished", params, 4, hist))
specs = [
    {{"kind": "curves", "name": "wilson", "metric": "heldout/accuracy", "hue": "es.population_size", "band": "wilson"}},
    {{"kind": "curves", "name": "reward", "hue": "es.population_size", "smoothing": 0.5, "band_window": 3}},
    {{"kind": "heldout_change", "name": "change", "hue": "es.population_size"}},
    {{"kind": "scaling", "name": "table", "cols": "es.population_size"}},
    {{"kind": "final", "name": "final", "by": ["es.population_size"]}},
]
written = write_report(runs, parse_analyses(specs, runs=runs), sweep / "results", title="t", sweep_dir=sweep)
print(json.dumps({{"import": at_import, "report": loaded(), "written": sorted(p.name for p in written)}}))
"""


def test_the_cli_and_the_report_do_not_load_torch(tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", CHECK.format(heavy=HEAVY), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["import"] == [], got
    assert got["report"] == ["matplotlib"], got  # the PNGs; no torch, transformers or mlflow
    assert {"wilson.png", "reward.png", "change.md", "table.md", "final.md", "README.md"} <= set(got["written"]), got
