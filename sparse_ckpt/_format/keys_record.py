"""The *key record* of the formats stock DSD also reads (docs/formats.md, *Key record*): one item
in a flat dict, or one entry of DSD's nested dict, that lists every setting key of every saved group
and every state key of every parameter, so a load finds a lost setting or state item missing
(complete or refused, as the packed format's ``~keys``), while torch's own DSD loaders, which read
only the keys they know, ignore it.

``__sparse_ckpt__.keys.d{digest}`` -> a table-codec table (the digest: its BLAKE2b, checked on read):

* one group per saved param group, in order, with its FQNs, referring to the settings entry
  ``{"~settings": (setting key, ...)}`` (the group's keys, ``params`` aside, in the group's order);
* then groups of the parameters with state, each referring to ``{"~keys": (path, ...)}`` plus, for
  list-valued state, ``"~lens": ((path, count), ...)`` (paths and counts as in the packed format's
  scalar table).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from ..errors import CheckpointFormatError
from .codec import decode_table, encode_table
from .keys import KEYS_ENTRY, LENS_ENTRY, escape_part, is_plain_part, table_digest
from .list_record import list_nodes

__all__ = [
    "RECORD_PREFIX",
    "SETTINGS_ENTRY",
    "KeyRecord",
    "build_key_record",
    "is_record_key",
    "read_key_records",
    "without_key_record",
]

RECORD_PREFIX = "__sparse_ckpt__.keys."
"""Key prefix of a key record; the last part is ``d{digest}``."""

SETTINGS_ENTRY = "~settings"
"""A key record's settings entry of a saved param group: its setting keys."""

_RECORD_LEAF = "(key record)"
"""What codec errors name the table as."""


def is_record_key(key: object) -> bool:
    """Whether ``key`` is a key record's key."""
    return type(key) is str and key.startswith(RECORD_PREFIX)


def _paths(state: Mapping[Any, Any], prefix: str, keys: list[str], lens: list[tuple[str, int]]) -> None:
    """The per-item key paths of one parameter's state (nested dicts joined with ``.``; parts that
    are not plain escaped as in the packed format), and the value counts of its lists."""
    for part, value in state.items():
        text = part if is_plain_part(part) else escape_part(part)
        if text is None:
            return  # a key no format holds: the save refuses it elsewhere
        path = f"{prefix}{text}"
        if type(value) is dict and value:
            _paths(value, f"{path}.", keys, lens)
            continue
        keys.append(path)
        if type(value) is list:
            lens.append((path, list_nodes(value)))


def build_key_record(
    groups: Iterable[tuple[Mapping[str, Any], list[str]]], state_fqns: Iterable[Mapping[str, Any]]
) -> tuple[str, bytes]:
    """``(key, value)`` of the key record of a save's param ``groups`` (``(settings, FQNs)``, every
    leaf's in order; ``params`` not among the settings) and of its state (each leaf's ``fqn -> state
    dict``)."""
    table: list[tuple[dict[str, Any], list[str]]] = [
        ({SETTINGS_ENTRY: tuple(k for k in settings if k != "params")}, list(fqns)) for settings, fqns in groups
    ]
    by_keys: dict[tuple[Any, ...], list[str]] = {}
    state_fqns = list(state_fqns)
    fqns = list(chain.from_iterable(map(Mapping.keys, state_fqns)))
    states = list(chain.from_iterable(map(Mapping.values, state_fqns)))
    if not all(states):  # a parameter whose state is {} has none
        fqns, states = [f for f, st in zip(fqns, states) if st], [st for st in states if st]
    # C-level passes for the usual state (plain dicts of plain keys, no nested dict or list value);
    # one Python step per parameter only otherwise
    simple = set(map(type, states)) <= {dict} and not {dict, list} & set(
        map(type, chain.from_iterable(map(dict.values, states)))
    )
    key_tuples = list(map(tuple, states)) if simple else []
    distinct = dict.fromkeys(key_tuples)
    if simple and all(is_plain_part(k) for keys in distinct for k in keys):
        if len(distinct) == 1:
            by_keys[(key_tuples[0], ())] = fqns
        else:
            for fqn, keys in zip(fqns, key_tuples):
                by_keys.setdefault((keys, ()), []).append(fqn)
    else:
        for fqn, state in zip(fqns, states):
            if not isinstance(state, Mapping):
                continue
            paths: list[str] = []
            lens: list[tuple[str, int]] = []
            _paths(state, "", paths, lens)
            by_keys.setdefault((tuple(paths), tuple(lens)), []).append(fqn)
    for (keys, lens), fqns in by_keys.items():
        entry: dict[str, Any] = {KEYS_ENTRY: keys}
        if lens:
            entry[LENS_ENTRY] = lens
        table.append((entry, fqns))
    value = encode_table(_RECORD_LEAF, table)
    return f"{RECORD_PREFIX}d{table_digest(value)}", value


@dataclass
class KeyRecord:
    """The decoded key records of a checkpoint (ranks with different parameters write different
    ones; each is checked as it is)."""

    groups: list[tuple[int, tuple[str, ...], list[str]]] = field(default_factory=list)
    """Per saved param group: its index in its record, its setting keys and FQNs."""
    state: list[tuple[tuple[str, ...], tuple[tuple[str, int], ...], list[str]]] = field(default_factory=list)
    """Per run of parameters with the same state keys: the key paths, the list counts, the FQNs."""
    keys: list[str] = field(default_factory=list)
    """The record items' keys."""


def read_key_records(items: Mapping[str, Any]) -> KeyRecord | None:
    """The key records among ``items`` (``key -> value``, every key a record key) decoded, or
    ``None`` for none; a value that is not ``bytes`` or does not match its digest, or a table that
    is not a key record, is a :class:`CheckpointFormatError` naming the item."""
    if not items:
        return None
    out = KeyRecord()
    for key, value in items.items():
        tag = key[len(RECORD_PREFIX) :]
        if not isinstance(value, bytes):
            raise CheckpointFormatError(f"key record {key!r} is a {type(value).__name__}, expected bytes")
        if tag != f"d{table_digest(value)}":
            raise CheckpointFormatError(f"key record {key!r} does not match its digest (corrupt or edited checkpoint)")
        settings, _blobs, groups = decode_table(_RECORD_LEAF, value)
        index = 0
        for idx, fqns in groups:
            entry = settings[idx]
            names = entry.get(SETTINGS_ENTRY)
            keys = entry.get(KEYS_ENTRY)
            if _is_strs(names) and len(entry) == 1:
                out.groups.append((index, names, fqns))
                index += 1
            elif _is_strs(keys) and set(entry) <= {KEYS_ENTRY, LENS_ENTRY} and _is_lens(entry.get(LENS_ENTRY, ())):
                out.state.append((keys, entry.get(LENS_ENTRY, ()), fqns))
            else:
                raise CheckpointFormatError(f"key record {key!r}: settings entry {idx} is not a key record's")
        out.keys.append(key)
    return out


def _is_lens(value: object) -> bool:
    return type(value) is tuple and all(
        type(v) is tuple and len(v) == 2 and type(v[0]) is str and type(v[1]) is int for v in value
    )


def _is_strs(value: object) -> bool:
    return type(value) is tuple and all(type(v) is str for v in value)


def without_key_record(sd: Mapping[str, Any]) -> dict[str, Any]:
    """``sd``'s items but its key record (what DSD's own flat dict of the same optimizer holds)."""
    return {k: v for k, v in sd.items() if not is_record_key(k)}
