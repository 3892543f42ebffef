"""Write tests/durations.json, each test's seconds (setup + call + teardown), from pytest's ``--durations``
lines in the logs given (e.g. a `bash scripts/test.sh` or `.ci/run` output): tests/conftest.py orders the
xdist scopes by them, longest first, when pytest runs with --no-loadscope-reorder. A test in several logs gets
its mean; a test in none counts 0 there. Only the order matters, so a log from any machine will do.

    python scripts/test_durations.py ci.log [more.log ...]
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S+::\S+)\s*$")
OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def main(logs: list[str]) -> None:
    per_log: dict[str, list[float]] = defaultdict(list)
    for log in logs:
        seen: dict[str, float] = defaultdict(float)
        for line in Path(log).read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                seen[m.group(2).split("@")[0]] += float(m.group(1))  # the xdist group suffix is not the test's id
        for nodeid, s in seen.items():
            per_log[nodeid].append(s)
    if not per_log:
        sys.exit(f"no --durations lines in {', '.join(logs)}")
    means = {k: round(sum(v) / len(v), 1) for k, v in sorted(per_log.items())}
    OUT.write_text(json.dumps(means, indent=0) + "\n")
    print(f"{OUT}: {len(means)} tests, {sum(means.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
