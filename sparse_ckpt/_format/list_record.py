"""The record of list-valued state (:data:`~sparse_ckpt._format.keys.LENS_ENTRY`): complete or refused for lists.

DCP stores a list that holds tensors one item per element (``state.{fqn}.al.0``, ...), so a
checkpoint that lost one element's item would load a shorter list. At save, each parameter whose
per-item state holds a list gets, in its scalar-table entry, the count of values of each such
entry (:func:`list_nodes`); a load compares (:func:`sparse_ckpt._load.decode.check_lists`).
"""

from __future__ import annotations

from itertools import repeat
from operator import is_
from typing import Any

from .keys import KEYS_ENTRY, LENS_ENTRY, STATE_PREFIX


def list_nodes(value: Any) -> int:
    """How many values a state entry holds: 1, plus, for a list or dict, its values' counts (so
    one item lost from a DCP checkpoint's list, or from a dict in it, changes the count)."""
    if type(value) is list:
        return 1 + sum(list_nodes(v) for v in value)
    if type(value) is dict:
        return 1 + sum(list_nodes(v) for v in value.values())
    return 1


def record_lists(
    items: dict[str, Any], scalar_groups: list[tuple[dict[str, Any], list[str]]]
) -> list[tuple[dict[str, Any], list[str]]]:
    """``scalar_groups`` (the core's ``flatten_packed_state``) with :data:`LENS_ENTRY` added for
    every parameter whose per-item entries (``items``) hold a list: such a parameter moves to a
    group of its own counts (the groups' order and the other parameters' groups stay)."""
    if not any(map(is_, map(type, items.values()), repeat(list))):  # C-level pass: no list (the usual case)
        return scalar_groups
    out: list[tuple[dict[str, Any], list[str]]] = []
    for scalars, fqns in scalar_groups:
        keys = scalars.get(KEYS_ENTRY, ())
        split: dict[tuple[tuple[str, int], ...], list[str]] = {}
        for fqn in fqns:
            lens = tuple(
                (k, list_nodes(v))
                for k in keys
                if type(k) is str and type(v := items.get(f"{STATE_PREFIX}{fqn}.{k}")) is list
            )
            split.setdefault(lens, []).append(fqn)
        for lens, members in split.items():
            out.append(({**scalars, LENS_ENTRY: lens} if lens else scalars, members))
    return out
