"""Process-group questions, answered in one place: is there a default process group, this rank,
its world size, and whether a given group is the default one; and `agree_on_refusal`, the one
collective that makes a load's refusal on one rank a refusal on every rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["agree_on_refusal", "initialised", "is_default_group", "multi_rank", "world_and_rank"]


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


_SUMMARY_CHARS = 2000
"""How much of a refusing rank's message travels to the other ranks."""


def agree_on_refusal(error: BaseException | None, what: str) -> None:
    """Every rank of the default process group calls this at the same decision point of a load,
    before anything is mutated, with the error it met (``None``: it would go on). One
    ``all_gather_object`` of a short summary; if any rank refused, every rank raises: the refusing
    rank its own ``error`` (its message naming the other refusing ranks, if any), the others a
    `sparse_ckpt.errors.SparseCheckpointError` of the first refusing rank's class naming the refusing
    rank(s) and their messages. So no rank goes on alone (and hangs or crashes in the next
    collective). ``what`` names the load (``"set_optimizer_state_dict"``). Without a process group
    of several ranks it only re-raises ``error``."""
    if not multi_rank():
        if error is not None:
            raise error
        return
    from . import errors

    world, rank = world_and_rank()
    mine = None if error is None else (type(error).__name__, str(error)[:_SUMMARY_CHARS])
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    refused = [(r, s) for r, s in enumerate(gathered) if s is not None]
    if not refused:
        return
    names = ", ".join(str(r) for r, _s in refused)
    if error is not None:
        if isinstance(error, errors.SparseCheckpointError):
            error.args = (f"{what} refused on rank(s) {names} of {world} (this rank, {rank}, among them): {error}",
                          *error.args[1:])
        raise error
    first_cls = getattr(errors, refused[0][1][0], None)
    cls = first_cls if isinstance(first_cls, type) and issubclass(first_cls, errors.SparseCheckpointError) else (
        errors.CheckpointMismatchError
    )
    detail = "; ".join(f"rank {r}: {name}: {msg}" for r, (name, msg) in refused)
    raise cls(
        f"{what} refused on rank(s) {names} of {world}, so no rank loads anything (this rank, {rank}, had "
        f"nothing to refuse; its optimizer is as it was): {detail}"
    )
