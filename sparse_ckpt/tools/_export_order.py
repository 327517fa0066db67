"""The order of an export's tables and state entries: the same whatever the checkpoint's state
layout (per item, buffered, or both) and whatever order DCP wrote its items in.

DCP lists a checkpoint's items in the order of the ranks' save plans after de-duplication, which
moves an item every rank writes (a shared table, a replicated tensor) to whichever rank's plan
is smallest, so that order differs between two saves of the same state. An export orders:

* packed group tables by leaf name, then by their tag's first rank (:func:`table_order`);
* state entries parameter by parameter in the order of those tables' groups (FQNs in no group
  after them, in the checkpoint's order), each parameter's entries in the order its scalar table
  records them (``~keys``, the saved order), else in the checkpoint's order (:class:`StateOrder`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .._format.keys import PACKED_PREFIX, SCALARS_PREFIX, STATE_PREFIX, owner_fqn, parse_rank_tag, split_table_key
from .._load.decode_state import decode_scalar_tables

__all__ = ["StateOrder", "table_order", "tables_first"]


def table_order(key: str) -> tuple[str, int, int, str]:
    """Sort key of packed table ``key`` (``param_groups.__packed__.{leaf}.{tag}``): leaf, then rank
    tags by their first rank (before digest tags), then the tag itself."""
    leaf, tag = split_table_key(key[len(PACKED_PREFIX) :])
    parsed = parse_rank_tag(tag)
    if parsed is None:
        return leaf, 1, 0, tag
    runs = parsed[1]
    return leaf, 0, min(first for first, _last, _step in runs) if runs else 0, tag


def tables_first(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with its packed group tables first, in :func:`table_order` (so that leaves,
    groups and their FQNs decode in that order), then every other entry in its order."""
    out = {k: values[k] for k in sorted((k for k in values if k.startswith(PACKED_PREFIX)), key=table_order)}
    out.update((k, v) for k, v in values.items() if k not in out)
    return out


class StateOrder:
    """Sort key of an exported state entry ``state.{fqn}.{key}`` (see the module's docstring).

    ``fqns``: FQNs in group-table order; ``state_by_fqn``: the decoded state (its FQNs follow);
    ``values``: the optimizer's entries (its scalar tables give each parameter's recorded keys).
    """

    def __init__(self, fqns: Iterable[str], state_by_fqn: Mapping[str, Any], values: Mapping[str, Any]) -> None:
        self._rank: dict[str, int] = {}
        for fqn in (*fqns, *state_by_fqn):
            self._rank.setdefault(fqn, len(self._rank))
        scalar_tables = {k[len(SCALARS_PREFIX) :]: v for k, v in values.items() if k.startswith(SCALARS_PREFIX)}
        keys_of: dict[str, tuple[tuple[str, ...], str]] = {}
        if scalar_tables:
            decode_scalar_tables(scalar_tables, keys_of=keys_of)
        self._recorded = {fqn: {k: i for i, k in enumerate(keys)} for fqn, (keys, _leaf) in keys_of.items()}

    def key(self, name: str, fqn: str | None = None) -> tuple[int, int]:
        """``(parameter's position, entry's position among its recorded keys)``; an entry in no
        parameter, or not recorded, sorts after (use a stable sort: the checkpoint's order)."""
        body = name[len(STATE_PREFIX) :]
        if fqn is None:
            fqn = owner_fqn(body, self._rank)
        if fqn is None:
            return len(self._rank), 0
        recorded = self._recorded.get(fqn, {})
        return self._rank[fqn], recorded.get(body[len(fqn) + 1 :], len(recorded))
