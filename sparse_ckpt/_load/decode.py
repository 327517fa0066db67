"""Decode a sparse/flat optimizer dict into ``fqn -> settings`` and ``fqn -> state``.

Settings are *interned*: equal settings (equal encoded bytes) are one dict object, so the core
can compare them by identity. Aliases of tied parameters resolve to their canonical FQN.
Scalar tables (packed format, version 2) are merged into each parameter's state: its scalars
first, then its per-item entries (the saved order).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

from .. import _backend
from .._format.codec import decode_table, encode_settings
from .._format.item_record import split_items_record
from .._format.keys import (
    BUFFERS_PREFIX,
    PACKED_PREFIX,
    check_table,
    source_text,
    without_foreign_guards,
)
from .._format.keys_record import RECORD_PREFIX, read_key_records
from .._format.nested import nested_kind, nested_to_sparse
from .._fqn import FqnMap
from .._layouts.bucketed_load import BucketReader, expand
from ..errors import CheckpointMismatchError
from .completeness import check_key_record, check_recorded_items, check_table_leaves
from .decode_state import _has_path, merge_state


@dataclass
class DecodedCheckpoint:
    """Everything a load needs from a checkpoint's optimizer entries."""

    settings_of: dict[str, dict] = field(default_factory=dict)
    """Canonical FQN -> interned settings."""
    state_of: dict[str, dict] = field(default_factory=dict)
    """Canonical FQN -> saved state (nested dicts)."""
    empty_groups: dict[tuple[str, int], dict] = field(default_factory=dict)
    """``(leaf, group index)`` -> settings of a group without parameters (packed format only)."""
    tables: list[GroupTable] = field(default_factory=list)
    """The decoded packed group tables, in order."""
    resolve: Callable[[str], str] = str
    """Saved FQN -> canonical FQN (the target model's alias resolution)."""
    table_leaves: list[str] = field(default_factory=list)
    """Leaf names of all packed tables, in order of appearance."""
    has_tables: bool = False
    unmatched_keys: list[str] = field(default_factory=list)
    """Keys that are neither state of a known FQN nor param-group entries."""
    names_of: dict[str, str | None] = field(default_factory=dict)
    """Canonical FQN -> its entry in its saved group's ``param_names`` (torch's named parameters),
    for FQNs whose saved group had ``param_names``; ``None`` when the entry is not known.
    ``param_names`` is per-parameter metadata, so it is kept out of the interned settings: two
    groups that differ only in their names do not conflict, and names follow FQNs on load."""
    names_list_of: dict[str, list] = field(default_factory=dict)
    """Flat format: canonical FQN -> its saved group's whole ``param_names`` list (DSD's flat layout
    repeats the list for every FQN of the group, without positions)."""

    def _table_listings(self) -> Iterator[tuple[str, int, str]]:
        """``(leaf, group index, canonical FQN)`` of every FQN the tables list, in table order."""
        for table in self.tables:
            for gi, (_idx, group_fqns) in enumerate(table.groups):
                for fqn in group_fqns:
                    yield table.leaf, gi, self.resolve(fqn)

    def table_leaf_of(self, fqns: Iterable[str]) -> dict[str, str]:
        """Canonical FQN -> leaf of the first packed table listing it, for ``fqns`` (for messages:
        one pass over the tables, made only when a load fails)."""
        wanted = set(fqns)
        found: dict[str, str] = {}
        for leaf, _gi, canon in self._table_listings():
            if canon in wanted:
                found.setdefault(canon, leaf)
        return found

    def first_source(self, canon: str, flat_fqns: Iterable[str] = ()) -> Any:
        """Where the first saved settings of ``canon`` are: ``(leaf, group index)`` of a table, or
        the flat entries of one of ``flat_fqns`` (see :func:`~sparse_ckpt._format.keys.source_text`)."""
        for leaf, gi, listed in self._table_listings():
            if listed == canon:
                return (leaf, gi)
        for fqn in flat_fqns:
            if self.resolve(fqn) == canon:
                return f"flat entries of {fqn!r}"
        return "?"


@dataclass(frozen=True)
class GroupTable:
    """One decoded packed group table (see :func:`decode_group_tables`)."""

    rest: str
    """The table's key without :data:`~sparse_ckpt._format.keys.PACKED_PREFIX`: ``{leaf}.{digest}``."""
    leaf: str
    settings: list[dict]
    """The distinct settings, in order of first use."""
    blobs: list[bytes]
    """Each distinct settings' encoded bytes (equal bytes = equal settings)."""
    groups: list[tuple[int, list[str]]]
    """Per group: ``(index into settings, its FQNs)``."""
    items: tuple[str, ...] | None = None
    """The table's item record: every table and buffer key its save wrote (``None``: none, an
    unsealed or older table)."""


def decode_group_tables(tables: Mapping[str, Any]) -> list[GroupTable]:
    """Packed group tables (``{leaf}.{digest}`` -> bytes) checked (type, digest) and decoded, in order.
    The one decoder of group tables: load, the DCP planner's tools, the CLI and export use it."""
    out: list[GroupTable] = []
    for rest, table in tables.items():
        leaf, table = check_table(PACKED_PREFIX, rest, table)
        settings, blobs, groups = decode_table(leaf, table)
        settings, blobs, items = split_items_record(settings, blobs, groups)
        out.append(GroupTable(rest, leaf, settings, blobs, groups, items))
    return out


def table_fqns(tables: list[GroupTable], fmap: FqnMap | None = None) -> set[str]:
    """Every FQN the tables list, plus the aliases ``fmap``'s model has of them (tied or wrapped names)."""
    fqns = set(chain.from_iterable(chain.from_iterable(map(itemgetter(1), table.groups) for table in tables)))
    if fmap is not None and len(fmap.canonical) > len(fmap.param_of):  # the model has aliases
        saved = {fmap.resolve(f) for f in fqns}
        fqns.update(alias for alias, canon in fmap.canonical.items() if canon in saved)
    return fqns


def decode_checkpoint(
    state_dict: Mapping[str, Any],
    fmap: FqnMap,
    reader: BucketReader | None = None,
    present: Collection[str] | None = None,
    leaf_of: Callable[[str], str | None] | None = None,
) -> DecodedCheckpoint:
    """Split and decode ``state_dict`` (packed and/or flat entries, or DSD's nested dict) against ``fmap``.

    State keys are resolved against the checkpoint's own FQNs (those its tables or flat
    param-group entries list, and the model's aliases of them), never against the target model's
    other FQNs, so one parameter's state can never land on another whose FQN is a prefix of the
    saved key. Buffered state (``state_layout="buffers"``) is scattered into new tensors for the
    parameters the target model has (:func:`sparse_ckpt._layouts.bucketed_load.expand`; ``reader`` reads the
    buffers a DCP load left to it) and joins the per-item state.

    Complete or refused: every item the checkpoint's item records list must be there (in the
    dict, readable by ``reader``, or in ``present``: every optimizer key of a DCP checkpoint), and
    every list-valued state entry must hold as many items as its scalar table records; a flat or
    nested dict's key record must find every recorded setting and state key of the model's
    parameters (``leaf_of``: canonical FQN -> the target leaf holding it, for messages).
    """
    state_dict = _other_layouts(state_dict)
    core = _backend.core
    decoded: list[GroupTable] = []
    known: list[set[str]] = []

    def known_fqns(tables: dict[str, bytes]) -> set[str]:
        """The state keys' owners: the tables' FQNs (and aliases), called by the core once it has the tables."""
        decoded.extend(decode_group_tables(tables))
        known.append(table_fqns(decoded, fmap))
        return known[-1]

    flat = state_dict if type(state_dict) is dict else dict(state_dict)  # the core reads dicts
    flat = without_foreign_guards(flat)
    settings_raw, state_raw, _tables, scalar_tables, unmatched = core.unflatten(flat, known_fqns)
    record, buffer_keys, unmatched = _split_unmatched(flat, unmatched)
    out = DecodedCheckpoint(
        unmatched_keys=list(unmatched), has_tables=bool(decoded), tables=decoded, resolve=fmap.resolve
    )
    merger = _SettingsMerger(out, fmap, settings_raw)
    for table in decoded:
        merger.table(table)
    merger.flat_entries()
    out.state_of = _canonical_state(state_raw, fmap)
    fqns = known[0] if known else set()
    aliases = len(fmap.canonical) > len(fmap.param_of)
    records: list[tuple[str, ...]] = [t.items for t in decoded if t.items is not None]
    out.state_of = merge_state(
        out.state_of,
        scalar_tables,
        resolve=fmap.resolve if aliases else None,  # merged by canonical FQN: a table may name a parameter by an alias
        is_known=(lambda f: f in fqns or f in settings_raw) if settings_raw else fqns.__contains__,
        unmatched=out.unmatched_keys,
        buffered=_buffered_reader(out, flat, fmap, buffer_keys, reader),
        owned=fmap.param_of,
        records=records,
    )
    if records:
        check_recorded_items(records, flat, reader, present)
    if scalar_tables or buffer_keys:
        check_table_leaves(out.table_leaves, scalar_tables, buffer_keys)
    if record is not None:
        check_key_record(
            record,
            out.settings_of,
            out.names_of,
            out.state_of,
            out.empty_groups,
            out.table_leaves,
            fmap.param_of,
            fmap.resolve if aliases else str,
            leaf_of,
        )
    return out


def _split_unmatched(flat: dict[str, Any], unmatched: list[str]) -> tuple[Any, list[str], list[str]]:
    """``(key record, buffer keys, the other keys)`` of the keys ``unflatten`` left unmatched: the key
    record of a flat or nested dict (read here: an unmatched key, so no pass over the dict for it) or
    ``None``, and the buffers of ``state_layout="buffers"``."""
    record = None
    if unmatched and any(k.startswith(RECORD_PREFIX) for k in unmatched):
        record = read_key_records({k: flat[k] for k in unmatched if k.startswith(RECORD_PREFIX)})
        unmatched = [k for k in unmatched if not k.startswith(RECORD_PREFIX)]
    buffer_keys = [k for k in unmatched if k.startswith(BUFFERS_PREFIX)]  # (unmatched is short)
    if buffer_keys:
        unmatched = [k for k in unmatched if not k.startswith(BUFFERS_PREFIX)]
    return record, buffer_keys, unmatched


class _SettingsMerger:
    """Fills ``out.settings_of`` (and the names and empty groups) from the tables and the flat entries;
    equal settings (equal encoded bytes) are one interned dict, and one parameter's settings from two
    places must be that same dict."""

    def __init__(self, out: DecodedCheckpoint, fmap: FqnMap, settings_raw: dict[str, dict]) -> None:
        self.out, self.fmap, self.settings_raw = out, fmap, settings_raw
        self.interned: dict[bytes, dict] = {}

    def intern(self, blob: bytes, settings: dict) -> dict:
        return self.interned.setdefault(blob, settings)

    def conflict(self, canon: str, source: Any) -> CheckpointMismatchError:
        return CheckpointMismatchError(
            f"conflicting saved settings for parameter {canon!r}: "
            f"{source_text(self.out.first_source(canon, self.settings_raw))} and {source_text(source)} differ"
        )

    def put(self, fqn: str, settings: dict, source: Any) -> str:
        """Record ``settings`` for ``fqn``; returns its canonical FQN."""
        canon = self.fmap.resolve(fqn)
        prev = self.out.settings_of.setdefault(canon, settings)
        if prev is not settings:
            raise self.conflict(canon, source)
        return canon

    def table(self, table: GroupTable) -> None:
        """One packed group table's settings."""
        out, leaf, settings, blobs, groups = self.out, table.leaf, table.settings, table.blobs, table.groups
        if leaf not in out.table_leaves:
            out.table_leaves.append(leaf)
        if any("param_names" in s for s in settings):
            self._named_table(table)
            return
        # the usual table: one core pass over its FQNs
        shared = [self.intern(blob, s) for blob, s in zip(blobs, settings)]
        empty, clash = _backend.core.merge_table_settings(leaf, shared, groups, self.fmap.canonical, out.settings_of)
        if clash is not None:
            raise self.conflict(clash[0], (leaf, clash[1]))
        for gi in empty:
            _put_empty_group(out, leaf, gi, shared[groups[gi][0]])

    def _named_table(self, table: GroupTable) -> None:
        """A table whose settings hold ``param_names``: the names go to ``names_of``, per FQN."""
        out, leaf, settings, blobs = self.out, table.leaf, table.settings, table.blobs
        unnamed: dict[int, dict] = {}
        for gi, (idx, fqns) in enumerate(table.groups):
            if fqns and "param_names" in settings[idx]:
                s = unnamed.get(idx)
                if s is None:
                    bare = {k: v for k, v in settings[idx].items() if k != "param_names"}
                    blob = encode_settings(leaf, gi, bare)
                    s = unnamed[idx] = self.intern(blob, bare)
                names = settings[idx]["param_names"]
                positional = isinstance(names, (list, tuple)) and len(names) == len(fqns)
                for i, fqn in enumerate(fqns):
                    name = names[i] if positional else None
                    out.names_of.setdefault(self.fmap.resolve(fqn), name if isinstance(name, str) else None)
            else:
                s = self.intern(blobs[idx], settings[idx])
            if not fqns:
                _put_empty_group(out, leaf, gi, s)
            # A parameter may sit in two groups of one leaf (torch allows it): the settings must agree.
            source = (leaf, gi)  # once per group, not per parameter
            for fqn in fqns:
                self.put(fqn, s, source)

    def flat_entries(self) -> None:
        """The flat format's ``param_groups.{fqn}.{key}`` settings."""
        out, resolve = self.out, self.fmap.resolve
        for fqn, raw in self.settings_raw.items():
            if "param_names" in raw:  # DSD's flat layout repeats the group's whole list for each FQN
                names = raw["param_names"]
                raw = {k: v for k, v in raw.items() if k != "param_names"}
                name = None
                if isinstance(names, (list, tuple)):
                    name = fqn if fqn in names else names[0] if len(names) == 1 else None
                    out.names_list_of[resolve(fqn)] = list(names)
                out.names_of.setdefault(resolve(fqn), name if isinstance(name, str) else None)
            blob = encode_settings(f"flat:{fqn}", 0, raw)
            self.put(fqn, self.intern(blob, raw), f"flat entries of {fqn!r}")


def _canonical_state(state_raw: dict[str, dict], fmap: FqnMap) -> dict[str, dict]:
    """The saved state by canonical FQN (``state_raw`` itself when the model has no aliases); state
    saved under two names of one parameter is refused."""
    if len(fmap.canonical) == len(fmap.param_of):  # no aliases: every FQN is its own canonical name
        return state_raw
    state_of: dict[str, dict] = {}
    for fqn, state in state_raw.items():
        canon = fmap.resolve(fqn)
        if canon in state_of:
            raise CheckpointMismatchError(f"parameter {canon!r} has saved state under two names ({fqn!r} is an alias)")
        state_of[canon] = state
    return state_of


def _buffered_reader(
    out: DecodedCheckpoint, flat: dict[str, Any], fmap: FqnMap, buffer_keys: list[str], reader: BucketReader | None
) -> Callable[[Mapping[str, tuple[tuple[str, ...], str]]], dict[str, dict[str, Any]] | None]:
    """`merge_state`'s ``buffered``: the buffered state expanded for the target's parameters (``None``
    when the checkpoint has no buffers)."""
    core = _backend.core

    def buffered(keys_of: Mapping[str, tuple[tuple[str, ...], str]]) -> dict[str, dict[str, Any]] | None:
        if not (buffer_keys or (reader is not None and reader.keys)):
            return None
        unlisted: list[tuple[str, str]] = []

        def expected(leaf: str, found: set[tuple[str, str]]) -> bool:
            """Whether a parameter of the target misses recorded state of ``leaf`` besides ``found``."""
            if not unlisted and keys_of:
                unlisted.extend(core.unlisted_keys(keys_of, out.state_of, fmap.param_of) or [("", "")])
            return any(
                fqn
                and keys_of[fqn][1] == leaf
                and (fqn, k) not in found
                and not _has_path(out.state_of.get(fqn, {}), k)
                for fqn, k in unlisted
            )

        return expand(buffer_keys, flat, fmap, reader, expected)

    return buffered


def _put_empty_group(out: DecodedCheckpoint, leaf: str, gi: int, settings: dict) -> None:
    """Record a table group without parameters; tables of several ranks must agree on it."""
    prev = out.empty_groups.setdefault((leaf, gi), settings)
    if prev is not settings:
        raise CheckpointMismatchError(
            f"leaf {leaf!r} group {gi}: tables of different ranks disagree on this empty group's settings"
        )


def _other_layouts(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """DSD's nested FQN-keyed dict as its packed equivalent (:mod:`sparse_ckpt._format.nested`); others
    as they are (a torch ``Optimizer.state_dict()``, int ids, never gets here: the load converts it
    first, `sparse_ckpt._load.positional`)."""
    if nested_kind(state_dict) == "fqn":
        return nested_to_sparse(state_dict)
    return state_dict
