"""Normalise the ``optimizer`` argument into named leaves.

A plain ``torch.optim.Optimizer`` is one leaf named ``"optim"``; a :class:`MultiOptimizer` or
a ``Mapping[str, Optimizer]`` gives its items in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

SINGLE_LEAF = "optim"


def named_leaves(optimizer: Any) -> list[tuple[str, torch.optim.Optimizer]]:
    """``[(leaf_name, optimizer), ...]`` for any supported optimizer argument."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [(SINGLE_LEAF, optimizer)]
    items = getattr(optimizer, "leaves", None)
    if callable(items):
        pairs = list(items())
    elif isinstance(optimizer, Mapping):
        pairs = list(optimizer.items())
    else:
        raise TypeError(
            f"expected a torch.optim.Optimizer, a sparse_ckpt.MultiOptimizer or a Mapping[str, Optimizer], "
            f"got {type(optimizer).__name__}"
        )
    for name, _opt in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"leaf name {name!r} is not a non-empty string")
    return pairs
