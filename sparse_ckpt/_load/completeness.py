"""Complete or refused beyond each parameter's recorded keys: the checks a load (and
``verify``) makes of what the per-parameter ``~keys`` record cannot see.

* :func:`check_recorded_items` -- every table, layout and buffer key a group table's *item record*
  lists is in the checkpoint (a lost scalar table, layout, buffer, another leaf's group table --
  of any rank);
* :func:`check_table_leaves` -- a leaf with state has its group table;
* :func:`check_lists` -- list-valued state holds its recorded count of values (``~lens``);
* :func:`without_items_record` -- for the tools that write a checkpoint with other items;
* :func:`check_key_record` -- the flat and nested formats' key record: every recorded setting and
  state key of a target parameter is there.

Formats: docs/formats.md ("Item record", the scalar table's ``~lens``, "Key record").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any

from .._format.codec import decode_table
from .._format.item_record import split_items_record
from .._format.keys import (
    BUFFERS_PREFIX,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    check_table,
    key_parts,
    parse_rank_tag,
    seal,
    split_table_key,
)
from .._format.list_record import list_nodes
from ..errors import CheckpointMismatchError

if TYPE_CHECKING:
    from .._format.keys_record import KeyRecord
    from .._layouts.bucketed_load import BucketReader as BufferReader


def check_table_leaves(group_leaves: list[str], scalar_tables: Mapping[str, Any], buffer_keys: list[str]) -> None:
    """A leaf with a scalar table or buffers has a group table (every writer writes one per leaf):
    else the checkpoint lost it, and with it the leaf's settings and the FQNs its state resolves
    against; :class:`CheckpointMismatchError` (whatever ``strict`` says)."""
    have = set(group_leaves)
    found = [item_leaf(f"{SCALARS_PREFIX}{rest}") for rest in scalar_tables] + [item_leaf(k) for k in buffer_keys]
    for leaf in found:
        if leaf not in have:
            raise CheckpointMismatchError(
                f"leaf {leaf!r}: the checkpoint has its state but no group table (param_groups.__packed__.{leaf}.*): "
                "it lost that item from its metadata or its data (a partial copy or a damaged checkpoint); refusing "
                "to load it incomplete (strict=False does not change this)"
            )


def without_items_record(prefix: str, rest: str, table: object) -> object:
    """Table item ``{prefix}{rest}``'s value without its item record (re-sealed), for a tool that
    writes a checkpoint with other items than the save recorded; other values as they are."""
    if not isinstance(table, bytes) or parse_rank_tag(split_table_key(rest, prefix)[1]) is None:
        return table
    leaf, bare = check_table(prefix, rest, table)
    settings, blobs, groups = decode_table(leaf, bare)
    if split_items_record(settings, blobs, groups)[2] is None:
        return table
    start = 10 + sum(len(b) for b in blobs[:-1])
    n = len(settings) - 1
    return seal(bare[:6] + n.to_bytes(4, "little") + bare[10:start] + bare[start + len(blobs[-1]) :])


def check_recorded_items(
    records: list[tuple[str, ...]],
    flat: Mapping[str, Any],
    reader: BufferReader | None,
    present: Collection[str] | None,
) -> None:
    """Every item an item record lists (see :func:`sparse_ckpt._format.item_record.with_items_record`) is in the
    checkpoint, else :class:`CheckpointMismatchError` naming the leaf and the item: a lost table,
    layout or buffer -- of any rank -- is refused even when nothing on this rank needed it, so
    every rank of a load decides alike (whatever ``strict`` says). Layouts and buffers are found
    by key; group and scalar tables by number, per kind and leaf (a tool may re-key a table it
    rewrites, as long as none goes missing)."""
    wanted: dict[str, None] = {}
    for record in records:
        wanted.update(dict.fromkeys(record))

    def there(key: str) -> bool:
        return key in flat or (reader is not None and key in reader.keys) or (present is not None and key in present)

    missing = [key for key in wanted if not there(key)]
    if not missing:
        return
    spare: dict[tuple[str, str], int] = {}  # (prefix, leaf) -> tables found minus tables recorded
    for key in set(chain(flat, present or ())):
        kind = _table_of(key)
        if kind is not None:
            spare[kind] = spare.get(kind, 0) + 1
    for key in wanted:
        kind = _table_of(key)
        if kind is not None:
            spare[kind] = spare.get(kind, 0) - 1
    for key in missing:
        kind = _table_of(key)
        if kind is not None and spare[kind] >= 0:
            continue  # as many tables of its kind and leaf as recorded: re-keyed, not lost
        raise CheckpointMismatchError(
            f"leaf {item_leaf(key)!r}: checkpoint item {key!r} is missing, and the checkpoint's group tables record "
            "that it was written: the checkpoint lost it from its metadata or its data (a partial copy or a "
            "damaged checkpoint); refusing to load it incomplete (strict=False does not change this)"
        )


def _table_of(key: str) -> tuple[str, str] | None:
    """``(prefix, leaf)`` of a group or scalar table key, else ``None``."""
    for prefix in (PACKED_PREFIX, SCALARS_PREFIX):
        if key.startswith(prefix):
            return prefix, item_leaf(key)
    return None


def item_leaf(key: str) -> str:
    """The leaf of a table or buffers item key (the text between its prefix and its last ``.``)."""
    for prefix in (PACKED_PREFIX, SCALARS_PREFIX, BUFFERS_PREFIX):
        if key.startswith(prefix):
            return key[len(prefix) :].rpartition(".")[0]
    return "?"


def check_lists(
    state_of: Mapping[str, Any],
    lens_of: Mapping[str, tuple[tuple[tuple[str, int], ...], str]],
    owned: Mapping[str, Any],
) -> None:
    """Complete or refused for list-valued state (LBFGS ``al``, ``old_dirs``, ...): each recorded
    entry of a target parameter holds the recorded number of values (:func:`list_nodes`), else
    :class:`CheckpointMismatchError` naming leaf, FQN and key (DCP stores a list of tensors one
    item per element, so a lost element would shorten the list)."""
    for fqn, (lens, leaf) in lens_of.items():
        if fqn not in owned:
            continue
        state = state_of.get(fqn, {})
        for key, count in lens:
            node: Any = state
            for part in key_parts(key):
                node = node.get(part) if isinstance(node, dict) else None
            found = 0 if node is None else list_nodes(node)
            if found != count:
                raise CheckpointMismatchError(
                    f"leaf {leaf!r}: parameter {fqn!r} has saved state {key!r} of {count} values (lists counted with "
                    f"their items), the checkpoint holds {found}: it lost an item of that list from its metadata or "
                    "its data (a partial copy or a damaged checkpoint); refusing to load it incomplete"
                )


def check_key_record(
    record: KeyRecord,
    settings_of: Mapping[str, Mapping[str, Any]],
    names_of: Mapping[str, Any],
    state_of: Mapping[str, Any],
    empty_groups: Mapping[tuple[str, int], Mapping[str, Any]],
    table_leaves: list[str],
    owned: Container[str],
    resolve: Callable[[str], str] = str,
    leaf_of: Callable[[str], str | None] | None = None,
) -> None:
    """Complete or refused for the flat and nested formats: every parameter of the target (its
    canonical FQN, ``resolve(fqn)``, in ``owned``) that a key record (`sparse_ckpt._format.keys_record`)
    lists has every setting key its saved group had (in ``settings_of``; ``param_names`` in
    ``names_of``) and every recorded state key and list count (in ``state_of``); a saved group
    without parameters (nested) has its setting keys in ``empty_groups`` (its single table's leaf).
    Else :class:`CheckpointMismatchError` naming leaf (``leaf_of``: the target's), FQN and key,
    whatever ``strict`` says. A parameter with none of its settings is *missing* (whole parameters
    or groups left out of a dict: what ``strict`` decides), not damaged: no real optimizer's
    parameter has a single item, so losing one item never hides a parameter."""
    for gi, names, fqns in record.groups:
        if not fqns:  # a group without parameters: only DSD's nested layout holds one (one table)
            if len(table_leaves) == 1:
                found = empty_groups.get((table_leaves[0], gi))
                lacking = [k for k in names if found is None or k not in found]
                if lacking:
                    raise CheckpointMismatchError(
                        f"leaf {table_leaves[0]!r} group {gi} (no parameters): the checkpoint has no saved setting "
                        f"{lacking[0]!r}, which its key record lists (recorded: {list(names)}): {_LOST}"
                    )
            continue
        named = "param_names" in names
        wanted = frozenset(names).difference(("param_names",))
        canons = fqns if resolve is str else list(map(resolve, fqns))
        haves = list(map(settings_of.get, canons))
        # C-level passes: each distinct (interned) settings dict is looked at once; a parameter only
        # when one is short of a key (or param_names are recorded)
        distinct = dict(zip(map(id, haves), haves))
        if not named and all(h is None or h.keys() >= wanted for h in distinct.values()):
            continue
        for fqn, canon, have in zip(fqns, canons, haves):
            if have is None or canon not in owned:
                continue  # none of its settings: a parameter missing from the checkpoint (strict decides);
                # or another rank's parameter (or one the model lacks: strict decides)
            if have.keys() >= wanted and (not named or canon in names_of):
                continue
            lacking = [k for k in names if k != "param_names" and k not in have] or ["param_names"]
            raise CheckpointMismatchError(
                f"{_leaf_text(leaf_of, canon)}parameter {fqn!r} has no saved setting {lacking[0]!r} of its param "
                f"group, which the checkpoint's key record lists (recorded: {list(names)}): {_LOST}"
            )
    for keys, lens, fqns in record.state:
        canons = fqns if resolve is str else list(map(resolve, fqns))
        states = list(map(state_of.get, canons))
        if not lens and all("." not in k and not k.startswith("~") for k in keys):
            plain = frozenset(keys)
            if None not in states and all(map(plain.issubset, states)):
                continue  # every parameter has every recorded key (C-level passes)
        for fqn, canon, state in zip(fqns, canons, states):
            if canon not in owned or (state is None and canon not in settings_of):
                continue  # another rank's; or neither settings nor state: missing from the checkpoint (strict decides)
            for key in keys:
                if not _has(state, key):
                    raise CheckpointMismatchError(
                        f"{_leaf_text(leaf_of, canon)}parameter {fqn!r} has no saved state {key!r}, which the "
                        f"checkpoint's key record lists (recorded: {list(keys)}): {_LOST}"
                    )
            for key, count in lens:
                node = _node(state, key)
                found = 0 if node is None else list_nodes(node)
                if found != count:
                    raise CheckpointMismatchError(
                        f"{_leaf_text(leaf_of, canon)}parameter {fqn!r} has saved state {key!r} of {count} values "
                        f"(lists counted with their items), the checkpoint holds {found}: {_LOST}"
                    )


_LOST = (
    "the checkpoint lost that item from its metadata or its data (a partial copy or a damaged checkpoint); "
    "refusing to load it incomplete (strict=False does not change this)"
)


def _leaf_text(leaf_of: Callable[[str], str | None] | None, canon: str) -> str:
    leaf = leaf_of(canon) if leaf_of is not None else None
    return f"leaf {leaf!r}: " if leaf is not None else ""


def _node(state: Any, key: str) -> Any:
    """The value at recorded state key path ``key`` (escaped parts unescaped) in ``state``, else ``None``."""
    return _lookup(state, key)[1]


def _has(state: Any, key: str) -> bool:
    """Whether ``state`` holds recorded state key path ``key`` (a value ``None`` included)."""
    return _lookup(state, key)[0]


def _lookup(state: Any, key: str) -> tuple[bool, Any]:
    """``(found, value)`` at recorded state key path ``key`` (escaped parts unescaped) in ``state``."""
    node = state
    for part in key_parts(key):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node
