"""Decoding the state half of an optimizer dict, the same for a load and for the checkpoint tools:
scalar tables (packed version 2) and the state keys they record, buffered state joining per-item
state, scalars first, and the complete-or-refused check (:func:`merge_state`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _backend
from .._format.codec import decode_table, encode_settings
from .._format.item_record import split_items_record
from .._format.keys import (
    ESCAPE,
    KEYS_ENTRY,
    LENS_ENTRY,
    SCALARS_PREFIX,
    check_table,
    state_key,
    unescape_part,
)
from .._format.tensor_parts import parts_to_tensor
from ..errors import CheckpointFormatError, CheckpointMismatchError
from .completeness import check_lists


def merge_state(
    state_of: dict[str, Any],
    scalar_tables: Mapping[str, bytes],
    *,
    is_known: Callable[[str], bool],
    unmatched: list[str],
    resolve: Callable[[str], str] | None = None,
    buffered: Callable[[Mapping[str, tuple[tuple[str, ...], str]]], Mapping[str, dict[str, Any]] | None] | None = None,
    owned: Mapping[str, Any] | None = None,
    records: list[tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    """The state half of decoding, the same for a load and for the checkpoint tools: the per-item
    state ``state_of`` (FQN -> nested dict) joined by the scalar tables' scalars (first, see
    :func:`decode_scalar_tables`; ``is_known``, ``unmatched`` and ``resolve`` as there) and by the
    buffered state (``buffered(keys_of)``: FQN -> entries, or ``None``; a load scatters tensors, the
    tools see metadata), then checked complete (:func:`check_complete`) for the parameters in
    ``owned`` (default: every parameter a scalar table records keys for), for a load (``owned``
    given) its lists too (`sparse_ckpt._load.completeness.check_lists`). The tables' item records are appended to
    ``records``."""
    keys_of: dict[str, tuple[tuple[str, ...], str]] = {}
    lens_of: dict[str, tuple[tuple[tuple[str, int], ...], str]] = {}
    scalars_of = (
        decode_scalar_tables(
            scalar_tables,
            resolve=resolve,
            is_known=is_known,
            unmatched=unmatched,
            keys_of=keys_of,
            lens_of=lens_of,
            records=records,
        )
        if scalar_tables
        else {}
    )
    extra = buffered(keys_of) if buffered is not None else None
    if extra:
        _add_buffered(state_of, extra, keys_of)
        if keys_of:  # parameters in the saved state order (the scalar tables list every one with state)
            position = {fqn: i for i, fqn in enumerate(keys_of)}
            state_of = dict(sorted(state_of.items(), key=lambda kv: position.get(kv[0], len(position))))
    if scalar_tables:
        state_of = merge_scalars(state_of, scalars_of)
        check_complete(state_of, keys_of, owned if owned is not None else keys_of)
        if lens_of and owned is not None:  # a load (the tools see list items through their metadata)
            check_lists(state_of, lens_of, owned)
    return state_of


def _add_buffered(
    state_of: dict[str, Any], buffered: dict[str, dict[str, Any]], keys_of: Mapping[str, tuple[tuple[str, ...], str]]
) -> None:
    """Each FQN's buffered state joins its per-item entries, in the order its scalar table
    records (a key in both: the checkpoint is corrupt). A parameter whose state is all buffered gets
    that order too (its buffers are per dtype: state of two dtypes comes out of them in another)."""
    ranks: dict[int, dict[str, int]] = {}  # per recorded tuple (shared by a table group's parameters)
    for fqn, entries in buffered.items():
        state = state_of.get(fqn)
        if state is None:
            state = state_of[fqn] = entries
        else:
            for key, value in entries.items():
                if key in state:
                    raise CheckpointFormatError(
                        f"state {key!r} of {fqn!r} is both in a buffer and a per-item entry "
                        "(corrupt or edited checkpoint)"
                    )
                state[key] = value
        recorded = keys_of.get(fqn)
        if recorded is None or len(state) < 2:
            continue
        rank = ranks.get(id(recorded[0]))
        if rank is None:
            rank = ranks[id(recorded[0])] = _key_ranks(recorded[0])
        order = [rank.get(k, len(rank)) for k in state]
        if order != sorted(order):  # (the saved order, unless it already is)
            state_of[fqn] = dict(sorted(state.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def _key_ranks(recorded: tuple[str, ...]) -> dict[str, int]:
    """Each top-level state key's position in a parameter's recorded keys (``~keys``: per-item paths)."""
    rank: dict[str, int] = {}
    for path in recorded:
        top = path.split(".", 1)[0]
        rank.setdefault(unescape_part(top, path) if top.startswith(ESCAPE) else top, len(rank))
    return rank


def check_complete(
    state_of: Mapping[str, Any], keys_of: Mapping[str, tuple[tuple[str, ...], str]], owned: Mapping[str, Any]
) -> None:
    """Complete or refused: every parameter of the target (an FQN in ``owned``) whose scalar table
    records its state keys (``keys_of``, see :func:`decode_scalar_tables`) must have each of them in
    ``state_of`` -- else the checkpoint lost an item (from its metadata or its data) and the load
    is refused with :class:`CheckpointMismatchError` naming leaf, FQN and key, whatever ``strict``
    says (``strict`` is about the model's parameters, not about a checkpoint missing part of
    itself). Parameters of other ranks (not in ``owned``) are not read, so not checked."""
    if type(state_of) is not dict or type(keys_of) is not dict:
        state_of, keys_of = dict(state_of), dict(keys_of)
    for fqn, key in _backend.core.unlisted_keys(keys_of, state_of, owned if type(owned) is dict else dict(owned)):
        if _has_path(state_of.get(fqn, {}), key):  # a nested or escaped key: there after all
            continue
        keys, leaf = keys_of[fqn]
        raise CheckpointMismatchError(
            f"leaf {leaf!r}: parameter {fqn!r} has no saved state {key!r}, which the checkpoint's scalar table "
            f"records for it (recorded: {list(keys)}): the checkpoint lost that item from its metadata or its "
            "data (a partial copy or a damaged checkpoint); refusing to load it incomplete (strict=False "
            "does not change this)"
        )


def _has_path(state: Any, key: str) -> bool:
    """Whether recorded state key ``key`` (a per-item key path: dotted, escaped parts) is in
    ``state`` (nested dicts with unescaped keys)."""
    node = state
    for part in key.split("."):
        if not isinstance(node, dict):
            return False
        name: Any = unescape_part(part, key) if part.startswith(ESCAPE) else part
        if name not in node:
            return False
        node = node[name]
    return True


def _cpu_parts_to_tensor(dtype: str, shape: tuple[int, ...], device_type: str, data: bytes) -> torch.Tensor:
    """:func:`parts_to_tensor` onto CPU whatever the saved device: a scalar table's tensors come
    back as DCP gives a per-item ``step`` (torch's load policy then places them)."""
    return parts_to_tensor(dtype, shape, "cpu", data)


def decode_scalar_tables(
    tables: Mapping[str, bytes],
    *,
    resolve: Callable[[str], str] | None = None,
    is_known: Callable[[str], bool] | None = None,
    unmatched: list[str] | None = None,
    keys_of: dict[str, tuple[tuple[str, ...], str]] | None = None,
    lens_of: dict[str, tuple[tuple[tuple[str, int], ...], str]] | None = None,
    records: list[tuple[str, ...]] | None = None,
) -> dict[str, tuple[dict[str, Any], str]]:
    """Scalar tables (``{leaf}.{tag}`` -> bytes, as ``core.unflatten`` returns them) ->
    ``FQN -> (scalars, leaf)``.

    The record of each parameter's other state keys (:data:`~sparse_ckpt._format.keys.KEYS_ENTRY`) is
    taken out of its scalars; with ``keys_of`` given, it is put there (``FQN -> (keys, leaf)``) for
    every known FQN whose table has it (tables written before the record have none).

    Digests are checked and tensors decoded onto CPU. FQNs are keyed by ``resolve(fqn)`` (the
    canonical FQN of an alias; the saved FQN without ``resolve``). Scalars of a saved FQN that is
    not ``is_known`` (no table or flat settings of the checkpoint list it) are left out and
    reported in ``unmatched`` as the per-item keys (``state.{fqn}.{key}``) a version-1 checkpoint
    would have had, so strict loads treat them exactly alike. Tables of one leaf (several ranks')
    merge; an FQN in two tables (or under two aliases) must have the same scalars (the same
    encoded bytes), else :class:`CheckpointMismatchError` naming the leaves, the FQN and the first
    differing key. The scalar dicts are shared by every FQN of their table group: copy them
    (:func:`merge_scalars`) before they become state. The record of list lengths
    (:data:`~sparse_ckpt._format.keys.LENS_ENTRY`) is taken out likewise (into ``lens_of``), and each
    sealed table's item record is appended to ``records``.
    """
    found: dict[str, tuple[dict[str, Any], str]] = {}
    blob_of: dict[str, bytes] = {}
    # found, keys_of and lens_of only get FQNs that blob_of gets: a group none of whose FQNs is in
    # blob_of yet takes the C-level path below (exactly the per-FQN loop's result then).
    bulk = not keys_of and not lens_of
    for rest, table in tables.items():
        leaf, table = check_table(SCALARS_PREFIX, rest, table)
        key = f"{SCALARS_PREFIX}{rest}"
        try:
            scalars, blobs, groups = decode_table(leaf, table, _cpu_parts_to_tensor)
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"scalar table {key!r}: {exc}") from None
        scalars, blobs, items = split_items_record(scalars, blobs, groups)
        if items is not None and records is not None:
            records.append(items)
        # The records, taken out of each scalar dict once (groups may share a dict: a table
        # written in state order has one group per run of parameters, see save._in_state_order).
        keys_at = [_recorded_keys(key, d.pop(KEYS_ENTRY, None)) for d in scalars]
        lens_at = [_recorded_lens(key, d.pop(LENS_ENTRY, None)) for d in scalars]
        for idx, fqns in groups:
            blob = blobs[idx]
            keys, lens = keys_at[idx], lens_at[idx]
            entry = (scalars[idx], leaf)
            recorded = None if keys is None or keys_of is None else (keys, leaf)
            if bulk and (is_known is None or all(map(is_known, fqns))):
                names = fqns if resolve is None else list(map(resolve, fqns))
                if blob_of.keys().isdisjoint(names):  # the usual case: each FQN once, in one table
                    blob_of.update(dict.fromkeys(names, blob))
                    found.update(dict.fromkeys(names, entry))
                    if recorded is not None:
                        keys_of.update(dict.fromkeys(names, recorded))  # type: ignore[union-attr]
                    if lens is not None and lens_of is not None:
                        lens_of.update(dict.fromkeys(names, (lens, leaf)))
                    continue
            for saved in fqns:
                if is_known is not None and not is_known(saved):
                    if unmatched is not None:
                        unmatched.extend(state_key(saved, k) for k in scalars[idx])
                    continue
                fqn = saved if resolve is None else resolve(saved)
                prev = blob_of.setdefault(fqn, blob)
                if prev is blob:
                    found.setdefault(fqn, entry)
                    if recorded is not None:
                        keys_of.setdefault(fqn, recorded)  # type: ignore[union-attr]
                    if lens is not None and lens_of is not None:
                        lens_of.setdefault(fqn, (lens, leaf))
                elif prev != blob:
                    first, first_leaf = found[fqn]
                    raise CheckpointMismatchError(
                        f"leaf {leaf!r}: parameter {fqn!r} has different scalar state in two scalar tables "
                        f"(of leaf {first_leaf!r} and leaf {leaf!r}; key "
                        f"{_first_differing(leaf, first, scalars[idx])!r})"
                    )
    return found


def _recorded_keys(table_key: str, keys: Any) -> tuple[str, ...] | None:
    """A :data:`~sparse_ckpt._format.keys.KEYS_ENTRY` entry as a tuple of str (a key that UTF-8 could not
    encode is recorded as its surrogate-passing UTF-8 bytes); ``None`` when there is none."""
    if keys is None:
        return None
    if type(keys) is tuple and all(type(k) is str for k in keys):
        return keys
    if type(keys) is tuple and all(type(k) in (str, bytes) for k in keys):
        try:
            return tuple(k.decode("utf-8", "surrogatepass") if type(k) is bytes else k for k in keys)
        except UnicodeDecodeError:
            pass
    raise CheckpointFormatError(f"scalar table {table_key!r}: its {KEYS_ENTRY!r} entry is not a tuple of state keys")


def _recorded_lens(table_key: str, lens: Any) -> tuple[tuple[str, int], ...] | None:
    """A `~sparse_ckpt._format.keys.LENS_ENTRY` entry as a tuple of ``(key, count)``; ``None`` when there is none."""
    if lens is None:
        return None
    if type(lens) is tuple and all(
        type(e) is tuple and len(e) == 2 and type(e[0]) is str and type(e[1]) is int and e[1] > 0 for e in lens
    ):
        return lens
    raise CheckpointFormatError(f"scalar table {table_key!r}: its {LENS_ENTRY!r} entry is not a tuple of (key, count)")


def _first_differing(leaf: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """The first key whose entry differs between two scalar dicts (by encoded bytes)."""

    def enc(d: Mapping[str, Any], k: str) -> bytes:
        return encode_settings(leaf, 0, {k: d[k]})

    for k in a:
        if k not in b or enc(a, k) != enc(b, k):
            return k
    return next((k for k in b if k not in a), "?")


def merge_scalars(state_of: dict[str, dict], scalars_of: Mapping[str, tuple[dict[str, Any], str]]) -> dict[str, dict]:
    """Each FQN's state: its scalars (from :func:`decode_scalar_tables`) first, then its per-item
    entries (``state_of``, keyed alike), in a new dict; FQNs with scalars only come last.

    Every FQN gets its own scalar dict and its own tensors (an optimizer steps each ``step`` in
    place). A scalar key that is also a per-item key is a :class:`CheckpointFormatError`.
    The core's ``merge_scalars`` (exact dicts; copies are made here for other mappings).

    How this compares with torch's ``Optimizer.load_state_dict`` (2.13,
    ``_process_value_according_to_param_policy``): torch hands ``step`` over as it is outside
    fused/capturable groups (shared with the caller's dict) and casts the other tensors with
    ``Tensor.to`` (the caller's tensor itself when nothing changes); the load does the same with
    per-item entries (`sparse_ckpt._core_py.load_assembly.cast_states`). A scalar table's tensors
    are decoded from its bytes, so nothing here is shared with the caller's dict either way; the
    ``clone()`` of every later taker is not a defensive copy but the one tensor per parameter that
    torch's dict has and the table holds once for the many parameters sharing a scalar dict.
    ``clone()`` is the cheapest way to make one (0-d CPU tensors: ``torch.full``,
    ``torch.scalar_tensor`` and ``torch._foreach_mul`` over the list cost more per tensor; views of
    one storage, as ``unbind`` gives, would share memory between parameters).
    """
    if type(state_of) is not dict:
        state_of = dict(state_of)
    if type(scalars_of) is not dict:
        scalars_of = dict(scalars_of)
    return _backend.core.merge_scalars(state_of, scalars_of, torch.Tensor)
