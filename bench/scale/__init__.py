"""The state layouts at scale: ``python -m bench.scale`` (scale.py) and its modes."""
