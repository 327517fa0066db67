"""The optimizer dicts this integration hands out, and how a trainer's own ``dcp.load`` fills them.

Every dict that :func:`~sparse_ckpt.integrations.dsd.get_optimizer_state_dict` returns is a
:class:`DsdStateDict`: a plain ``dict`` in DSD's layout, *marked* by its class (a subclass of
:class:`~sparse_ckpt.dcp.SparseStateDict` carrying the model and optimizers it was built from).
A trainer that resumes builds its load target that way (``get_optimizer_state_dict`` on the fresh
optimizer, then ``dcp.load({"optim": osd, ...})``); the target of a fresh optimizer lacks the
checkpoint's state keys, and DSD's own target invents them with a synthetic step.

:func:`rebuild_marked` runs in ``DefaultLoadPlanner.set_up_planner`` (patched by ``install()``,
so it reaches ``planner=None``, ``DefaultLoadPlanner()`` and every subclass that calls
``super().set_up_planner``; :class:`~sparse_ckpt.SparseLoadPlanner` does it itself): each marked
dict in the load target is rebuilt from the checkpoint's metadata, exactly as the library's planner
rebuilds its own targets -- the state the checkpoint has (this rank's parameters), every group's
settings, tables of a sparse_ckpt checkpoint -- so state that exists reaches the optimizer and
state that does not stays absent. Unmarked dicts (DSD's own, anything else) are planned as DCP
plans them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ..._dcp_paths import metadata_path
from ..._torch_compat import dcp_storage_reader
from ...dcp import SparseOptimizerState, SparseStateDict, _rebuild_target

__all__ = ["DsdStateDict", "marked_targets", "rebuild_marked"]


class DsdStateDict(SparseStateDict):
    """A DSD-layout optimizer dict made by ``integrations.dsd``: a ``dict`` whose class marks it as a
    load target :func:`rebuild_marked` may rebuild. Pickles and copies as a plain ``dict`` of its
    items (no origin record: DSD's dicts carry none, and a full state dict is meant to travel)."""

    __slots__ = ()

    def __init__(self, items: Mapping[str, Any], owner: SparseOptimizerState) -> None:
        super().__init__(items, owner)
        self.origin = None

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (dict, (), None, None, iter(dict(self).items()))


def marked_targets(node: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], DsdStateDict]]:
    """Every :class:`DsdStateDict` below ``node`` (dicts and lists), with its DCP object path."""
    if isinstance(node, DsdStateDict):
        yield path, node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from marked_targets(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from marked_targets(value, (*path, i))


def rebuild_marked(state_dict: Any, metadata: Metadata | None, frame: Any = None) -> int:
    """Rebuild every marked dict in the load target ``state_dict`` from ``metadata`` (see the
    module doc); returns how many. ``frame``: the caller of ``set_up_planner`` (to reach the
    load's storage reader for ``state_layout="buffers"`` checkpoints)."""
    if metadata is None:
        return 0
    targets = list(marked_targets(state_dict))
    if not targets:
        return 0
    paths = {key: metadata_path(metadata, key) for key in metadata.state_dict_metadata}
    reader = dcp_storage_reader(frame if frame is not None else sys._getframe(1))
    for path, target in targets:
        _rebuild_target(path, target, metadata, paths, reader)
    return len(targets)
