"""The bench suite's parts (``python -m bench``, bench/run.py): fixtures, methods, timing, reports."""
