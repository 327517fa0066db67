"""The resume drill (resume.py and its ranks) and the reliability sweeps: damaged files, interrupted
loads, lost items."""
