"""esbatch: Evolution Strategies and GRPO post-training for LLM reasoning, batch-ready for HPC clusters."""

__version__ = "0.1.0"
