"""Where runs execute: sweep files (sweep.py), launcher profiles (profile.py), the SLURM array through
submitit (slurm.py) or local subprocesses (local.py), the per-task entry point (task.py), and the
submit/status logic shared by both (submit.py, state.py)."""
