"""Offline evaluation: sampled responses, scoring (incl. the code sandbox), metrics and plots."""
