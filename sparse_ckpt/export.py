"""Pickle-free export of a checkpoint's optimizer part (safetensors + JSON) and its loader: the
public name of `sparse_ckpt.tools.export`, where it lives with the other checkpoint tools."""

from __future__ import annotations

from .tools import export as _implementation
from .tools.export import *  # the public names, exactly those of __all__

__all__ = list(_implementation.__all__)
