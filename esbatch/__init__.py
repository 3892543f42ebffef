"""esbatch: Evolution Strategies and GRPO post-training for LLM reasoning, batch-ready for HPC clusters."""

from esbatch import importgc

__version__ = "0.1.0"

importgc.install()  # the collector pauses while modules import (importgc.py)
