"""State layouts: how a leaf's parameter-shaped state tensors become DCP items.

``auto`` (default): per tensor, the ``buffers`` layout for small chunks and one item of its own for
a chunk of at least :data:`AUTO_OWN_ITEM_BYTES` (:data:`AUTO_ASYNC_OWN_ITEM_BYTES` inside
``dcp.async_save``; what ``per_tensor`` writes for every tensor).
``per_tensor``: one item per state tensor (``state.{fqn}.{key}``), written and read by the core's
flat keys. ``buffers``: per leaf, rank and dtype a few 1-D buckets plus a layout table; its save,
load and inspection views are :mod:`.bucketed` (save), :mod:`.bucketed_load` (which tables a load reads) and
:mod:`.bucketed_scatter` (their buckets into state tensors), :mod:`.bucketed_view`. ``auto`` writes
nothing ``buffers`` and ``per_tensor`` do not: its
checkpoints are buffers-layout checkpoints with some state left per item, which the buffers layout
always allowed. Keys: docs/formats.md (*State layout*).
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "AUTO_ASYNC_OWN_ITEM_BYTES",
    "AUTO_OWN_ITEM_BYTES",
    "DEFAULT_STATE_LAYOUT",
    "STATE_LAYOUTS",
    "StateLayout",
    "check_state_layout",
    "own_item_bytes",
]

StateLayout = Literal["auto", "per_tensor", "buffers"]
STATE_LAYOUTS = ("auto", "per_tensor", "buffers")
DEFAULT_STATE_LAYOUT: StateLayout = "auto"
"""The state layout of `sparse_state_dict`, :class:`~sparse_ckpt.SparseOptimizerState` and
``MultiOptimizer`` when none is given."""

AUTO_OWN_ITEM_BYTES = 4 << 20
"""``state_layout="auto"`` in a blocking save: a state tensor whose largest chunk (over the ranks)
has at least this many bytes is an item of its own; smaller ones go into buffers. Measured with
``python -m bench.scale threshold`` (bench/README.md, *Threshold*): one item per tensor saves at
least as fast as bucketing from 2-4 MiB (two sweeps; below, DCP's per-item cost exceeds the copy
into a bucket on huge pages); bucketed state loads faster at every size (one read per bucket, on
huge pages), by 1.8-2.5x at 4 MiB and 1.03-1.1x at 64 MiB, so the threshold favours the save,
which runs far more often, and keeps the copies a save makes (and the host memory they take while
DCP writes) to the small tensors."""

AUTO_ASYNC_OWN_ITEM_BYTES = 1 << 20
"""The same inside ``dcp.async_save``, which stages (copies) the whole state dict before it returns
(sharing the buckets, copies made for that save, instead of copying them again; the capture copies
the large tensors into pooled host buffers). Measured so (``python -m bench.scale threshold
--async``, bench/README.md *Threshold*): one item per tensor blocks the training loop no longer
than bucketing from 1 MiB on (0.97x; 1.8x at 256 KiB, 3.7-6.9x at 4-64 KiB)."""


def own_item_bytes(state_layout: StateLayout, staged: bool = False) -> int | None:
    """For a layout that buffers (``auto``, ``buffers``): the chunk size from which a
    parameter-shaped state tensor is an item of its own instead (``None``: never, ``buffers``).
    ``staged``: the save is ``dcp.async_save`` (:data:`AUTO_ASYNC_OWN_ITEM_BYTES`)."""
    if state_layout != "auto":
        return None
    return AUTO_ASYNC_OWN_ITEM_BYTES if staged else AUTO_OWN_ITEM_BYTES


def check_state_layout(state_layout: object, format: str = "packed") -> StateLayout:
    """``state_layout`` validated: one of :data:`STATE_LAYOUTS` (``"buffers"`` only with
    ``format="packed"``: torch DSD's flat layout has one item per state value, which is what
    ``"auto"`` means there)."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if state_layout == "buffers" and format != "packed":
        raise ValueError("state_layout='buffers' needs format='packed' (the flat format is torch DSD's layout)")
    return state_layout  # type: ignore[return-value]
