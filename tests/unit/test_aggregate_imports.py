"""esbatch/aggregate/report.py spells eval.jsonl's per-problem verdicts key (``heldout/correct``) itself: importing it
from esbatch/train/problems.py imported torch (esbatch/backends/base.py) into every CLI command (issue 40). The
spelling training writes and the one the report reads must stay the same."""

from esbatch.aggregate import report
from esbatch.train import problems


def test_the_report_reads_the_verdicts_key_training_writes():
    assert report.HELDOUT_CORRECT == problems.HELDOUT_CORRECT == "heldout/correct"
