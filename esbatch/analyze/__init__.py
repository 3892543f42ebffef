"""Analyses of run folders (`esbatch analyze ...`), reading their files only. Post-hoc diagnostics of trained
weights (paper RQ2, Section 4): drift from theta_0, the |delta| distribution
by parameter type, the largest updates, and magnitude-thresholded checkpoints (Table 4, Figure 4, Section 4.2).

Everything streams the run's center and its base model tensor by tensor (safetensors ``safe_open``), so a 7B
model needs about one tensor's worth of extra memory. Population diversity over training (Section 3.1) is
diversity.py. docs/diagnostics.md defines every number.
"""
