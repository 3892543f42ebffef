"""Analyses of finished or running run folders (`esbatch analyze ...`), reading their files only."""
