"""The package version: the one place it is written.

``sparse_ckpt/__init__.py`` imports it; ``setup.py`` reads this file as text (the isolated build
environment has no torch, so it must not import the package). Keep the single line below in the
form ``__version__ = "X.Y.Z"``.
"""

__version__ = "0.1.0"
