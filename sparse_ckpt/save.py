"""``sparse_state_dict``: the exact, sparse optimizer state dict."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from . import _backend
from ._gc import gc_paused
from ._tensor_parts import tensor_to_parts
from .capture import capture_packed
from .errors import CheckpointMismatchError
from .format import packed_table_key, table_digest
from .fqn import FqnMap, build_fqn_map
from .leaves import named_leaves

Format = Literal["packed", "flat"]
FORMATS = ("packed", "flat")


__all__ = ["FORMATS", "Format", "capture_leaf", "packed_table_key", "sparse_state_dict", "table_digest"]


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
        first_group: dict[str, int] = {}
        for gi, (_settings, fqns) in enumerate(groups_fqn):
            for fqn in fqns:
                prev = owner.setdefault(fqn, leaf)
                if prev != leaf:
                    raise CheckpointMismatchError(
                        f"parameter {fqn!r} is in both leaf {prev!r} and leaf {leaf!r}"
                    )
                if first_group.setdefault(fqn, gi) != gi:
                    _check_same_settings(leaf, fqn, groups_fqn, first_group[fqn], gi)
        out.update(core.flatten_state(leaf, state_fqn, fmap.param_of, format == "packed"))
        if format == "flat":
            out.update(core.flatten_groups(leaf, groups_fqn))
        else:
            table = core.encode_table(leaf, groups_fqn, torch.Tensor, tensor_to_parts)
            out[packed_table_key(leaf, table)] = table
    return out


def _check_same_settings(leaf: str, fqn: str, groups_fqn: list[tuple[dict, list[str]]], first: int, again: int) -> None:
    """A parameter listed in two groups of a leaf (torch allows it) is saved by FQN once: both
    groups must then hold the same settings, or a load could not tell which applies."""
    core = _backend.core
    a = core.encode_settings(leaf, first, _bare(groups_fqn[first][0]), torch.Tensor, tensor_to_parts)
    b = core.encode_settings(leaf, again, _bare(groups_fqn[again][0]), torch.Tensor, tensor_to_parts)
    if a != b:
        raise CheckpointMismatchError(
            f"leaf {leaf!r}: parameter {fqn!r} is in group {first} and group {again} with different settings; "
            "a checkpoint keyed by FQN cannot say which applies"
        )


def _bare(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings without ``param_names`` (per-parameter metadata, not a setting)."""
    return {k: v for k, v in settings.items() if k != "param_names"} if "param_names" in settings else settings
