"""``sparse_state_dict``: the exact, sparse optimizer state dict (DESIGN §2-§3)."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import torch
from torch import nn

from . import _backend
from ._core_py import PACKED_MARKER
from ._gc import gc_paused
from ._tensor_parts import tensor_to_parts
from .capture import capture_packed
from .errors import CheckpointMismatchError
from .fqn import FqnMap, build_fqn_map
from .leaves import named_leaves

Format = Literal["packed", "flat"]
FORMATS = ("packed", "flat")


def table_digest(table: bytes) -> str:
    """Content hash used in a packed table's key (16 hex digits of BLAKE2b)."""
    return hashlib.blake2b(table, digest_size=8).hexdigest()


def packed_table_key(leaf: str, table: bytes) -> str:
    """``param_groups.__packed__.{leaf}.{digest}``."""
    return f"param_groups.{PACKED_MARKER}.{leaf}.{table_digest(table)}"


def capture_leaf(
    leaf: str, optimizer: torch.optim.Optimizer, fmap: FqnMap
) -> tuple[list[tuple[dict, list[str]]], dict[str, Any]]:
    """Capture one leaf as ``(groups_fqn, state_fqn)``."""
    packed, id_to_param = capture_packed(leaf, optimizer)
    return _backend.core.remap_to_fqns(leaf, packed["param_groups"], packed["state"], id_to_param, fmap.fqn_of)


def sparse_state_dict(model: nn.Module, optimizer: Any, *, format: Format = "packed") -> dict[str, Any]:
    """Return the optimizer's exact state as a flat ``dict[str, value]`` that DCP can save.

    Only state that exists is emitted (``state.{fqn}.{key}``); every group's settings are kept,
    also for leaves that never stepped. ``format="packed"`` (default) stores each leaf's groups
    as one binary table ``param_groups.__packed__.{leaf}.{digest}``; ``format="flat"`` uses torch
    DSD's ``param_groups.{fqn}.{key}`` layout. Nothing is mutated and no step is run.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    with gc_paused():
        return _sparse_state_dict(model, optimizer, format)


def _sparse_state_dict(model: nn.Module, optimizer: Any, format: Format) -> dict[str, Any]:
    core = _backend.core
    fmap = build_fqn_map(model)
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for leaf, opt in named_leaves(optimizer):
        groups_fqn, state_fqn = capture_leaf(leaf, opt, fmap)
        for _settings, fqns in groups_fqn:
            for fqn in fqns:
                prev = owner.setdefault(fqn, leaf)
                if prev != leaf:
                    raise CheckpointMismatchError(
                        f"parameter {fqn!r} is in both leaf {prev!r} and leaf {leaf!r}"
                    )
        out.update(core.flatten_state(state_fqn))
        if format == "flat":
            out.update(core.flatten_groups(groups_fqn))
        else:
            table = core.encode_table(leaf, groups_fqn, torch.Tensor, tensor_to_parts)
            out[packed_table_key(leaf, table)] = table
    return out
