"""Where runs execute: sweep files expanded into runs (sweep.py), the launcher interface and registry
(base.py) with its local (local.py) and SLURM (slurm.py) implementations, the per-task entry point
(task.py), and the submit/status logic every launcher shares (submit.py, state.py)."""
