"""One rank's optimizer dict must never be loaded on another rank (the cross-rank hazard).

In a process group of several ranks, the dict a sparse_ckpt ``Stateful`` returns holds *that
rank's* state: its FSDP2 shards (DTensors whose local tensors are this rank's slices), its
experts. DCP keeps it apart from other ranks' dicts. Pickled as a whole and loaded on another
rank -- what Hugging Face Accelerate's ``register_for_checkpointing`` does: ``save_state``
pickles ``obj.state_dict()`` on the main process only and ``load_state`` hands that one file to
every rank -- it would silently give rank 1 the shards of rank 0.

So the dict records where it was made: pickled (or deep-copied) in a group of more than one
rank, it carries :data:`ORIGIN_KEY` = ``{"rank": r, "world_size": w}``, and every load refuses a
dict whose origin is another rank or another world size (:func:`strip_origin`). Dicts saved
through DCP never carry it (DCP flattens the dict, it does not pickle it), and a single process
never adds it. On the save side, a ``state_dict()`` called by Accelerate's custom-object
checkpointing in a group of several ranks is refused before anything is written
(:func:`refuse_rank0_only_save`).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .._dist import world_and_rank
from .._torch_internals import called_by_accelerate_custom_save
from ..errors import CrossRankStateError

__all__ = [
    "ORIGIN_KEY",
    "USE_INSTEAD",
    "OriginDict",
    "origin_here",
    "refuse_rank0_only_save",
    "strip_origin",
    "with_origin",
]

ORIGIN_KEY = "__sparse_ckpt__.origin"
"""Key of the origin record in a pickled sparse_ckpt dict (never written by DCP)."""

USE_INSTEAD = (
    "save and load it through DCP instead, where every rank writes and reads its own part: with Hugging Face "
    "Accelerate call sparse_ckpt.integrations.accelerate.install() (save_state/load_state then checkpoint the "
    "optimizer sparsely) and do not register_for_checkpointing a sparse_ckpt object; otherwise put it into "
    "dcp.save/dcp.load with planner=sparse_ckpt.SparseLoadPlanner()"
)
"""What the cross-rank errors tell the user to do."""


def origin_here() -> tuple[int, int] | None:
    """``(rank, world size)`` in an initialised process group of more than one rank, else ``None``."""
    world, rank = world_and_rank()
    return (rank, world) if world > 1 else None


class OriginDict(dict):
    """A sparse_ckpt optimizer dict that records where it was made (:data:`ORIGIN_KEY`).

    In memory it is a plain ``dict`` of its items. Pickled, it is an ``OrderedDict`` (what module
    ``state_dict()``s pickle as: ``torch.load``'s default ``weights_only`` unpickler reads it, where
    it refuses a GLOBAL ``builtins.dict``); pickled or (deep) copied in a group of more than one
    rank, it carries the origin record too, so a load on another rank refuses it. Subclasses
    choose the plain items through :meth:`copy`."""

    __slots__ = ("origin",)

    def __init__(self, items: Mapping[str, Any] = (), origin: tuple[int, int] | None = None) -> None:  # type: ignore[assignment]
        super().__init__(items)
        self.origin = origin
        """``(rank, world size)`` that made it, in a group of several ranks (`origin_here`)."""

    def copy(self) -> dict[str, Any]:  # type: ignore[override]
        """A plain ``dict`` with the same items."""
        return dict(self)

    def _detached(self) -> dict[str, Any]:
        """The plain items a pickle or copy carries: `copy` plus, in a group of several ranks, the
        origin record (a load on another rank must refuse one rank's state)."""
        items = self.copy()
        if self.origin is not None:
            items[ORIGIN_KEY] = {"rank": self.origin[0], "world_size": self.origin[1]}
        return items

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (OrderedDict, (), None, None, iter(self._detached().items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)

    def __copy__(self) -> dict[str, Any]:
        return self._detached()

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return copy.deepcopy(self._detached(), memo)


def with_origin(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` as an `OriginDict` recording this rank in a group of more than one rank; else ``sd``
    itself (a single process's dict loads anywhere)."""
    here = origin_here()
    return sd if here is None else OriginDict(sd, here)


def strip_origin(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` without its origin record, after checking that it was made on this rank.

    :class:`~sparse_ckpt.errors.CrossRankStateError` when the record names another rank or world
    size (a dict made by one rank and loaded by another); a malformed record is refused too.
    A dict without a record is returned as it is.
    """
    if ORIGIN_KEY not in state_dict:
        return state_dict
    record = state_dict[ORIGIN_KEY]
    rank = record.get("rank") if isinstance(record, Mapping) else None
    world = record.get("world_size") if isinstance(record, Mapping) else None
    if type(rank) is not int or type(world) is not int:
        raise CrossRankStateError(f"the dict's {ORIGIN_KEY!r} entry is malformed ({record!r}); {USE_INSTEAD}")
    here = origin_here() or (0, 1)
    if (rank, world) != here:
        raise CrossRankStateError(
            f"this sparse_ckpt optimizer dict was made on rank {rank} of {world} and is being loaded on rank "
            f"{here[0]} of {here[1]}: a rank's dict holds only that rank's optimizer state (its FSDP2 shards, its "
            "experts), so it cannot move to another rank (as with a file that one rank pickled and every rank "
            f"loads: Accelerate's register_for_checkpointing); {USE_INSTEAD}"
        )
    return {k: v for k, v in state_dict.items() if k != ORIGIN_KEY}


def refuse_rank0_only_save(optimizer: object) -> None:
    """Raise when a sparse_ckpt ``state_dict()`` (of ``optimizer``) is being called by Accelerate's
    custom-object checkpointing (which pickles the main process's dict only) in a group of several ranks."""
    if origin_here() is None:
        return
    if called_by_accelerate_custom_save(2):  # from the caller of our caller's state_dict() up
        raise CrossRankStateError(
            f"a sparse_ckpt Stateful of a {type(optimizer).__name__} is registered with Accelerate's "
            "register_for_checkpointing, which saves the state_dict() "
            "of the main process only and loads that one file on every rank: every other rank would get the "
            f"main process's optimizer state; {USE_INSTEAD}"
        )
