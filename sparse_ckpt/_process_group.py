"""Whether a default process group is up, and whether a group is it: the two facts both `sparse_ckpt._dist`
(the collectives) and `sparse_ckpt._torch_internals` (which reads DCP's frames) need, in a module that imports
neither of them."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["initialised", "is_default_group"]


def initialised() -> bool:
    """Whether torch.distributed is available and its default process group initialised."""
    return dist.is_available() and dist.is_initialized()


def is_default_group(group: Any) -> bool:
    """Whether ``group`` (``None`` means the default) is the default process group."""
    return group is None or group is dist.group.WORLD
