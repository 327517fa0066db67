"""Process-group questions, answered in one place: is there a default process group, this rank,
its world size, and whether a given group is the default one."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["initialised", "is_default_group", "multi_rank", "world_and_rank"]


def initialised() -> bool:
    """Whether torch.distributed is available and its default process group initialised."""
    return dist.is_available() and dist.is_initialized()


def world_and_rank() -> tuple[int, int]:
    """``(world size, rank)`` in the default process group; ``(1, 0)`` without one."""
    if not initialised():
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def multi_rank() -> bool:
    """Whether this process is one rank of an initialised default process group of several ranks."""
    return world_and_rank()[0] > 1


def is_default_group(group: Any) -> bool:
    """Whether ``group`` (``None`` means the default) is the default process group."""
    return group is None or group is dist.group.WORLD
