"""State layouts: how a leaf's parameter-shaped state tensors become DCP items.

``per_tensor`` (default): one item per state tensor (``state.{fqn}.{key}``), written and read by the
core's flat keys. ``buffers``: per leaf, rank and dtype a few 1-D buckets plus a layout table; its
save, load and inspection views are :mod:`.bucketed` (save), :mod:`.bucketed_load` and
:mod:`.bucketed_view`. Keys: docs/formats.md (*State layout*).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["DEFAULT_STATE_LAYOUT", "STATE_LAYOUTS", "StateLayout", "check_state_layout"]

StateLayout = Literal["per_tensor", "buffers"]
STATE_LAYOUTS = ("per_tensor", "buffers")
DEFAULT_STATE_LAYOUT: StateLayout = "per_tensor"
"""The state layout of :class:`~sparse_ckpt.SparseOptimizerState` and ``MultiOptimizer`` when none is given."""


def check_state_layout(state_layout: object, format: str = "packed") -> StateLayout:
    """``state_layout`` validated: ``"per_tensor"`` or ``"buffers"`` (the latter only with
    ``format="packed"``: torch DSD's flat layout has one item per state value)."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if state_layout == "buffers" and format != "packed":
        raise ValueError("state_layout='buffers' needs format='packed' (the flat format is torch DSD's layout)")
    return state_layout  # type: ignore[return-value]
