"""Twins of csrc/flat_keys.cpp: ``flatten_state`` / ``flatten_packed_state`` / ``flatten_groups`` /
``unflatten``, the flat key layout (DSD's, and the packed format's per-item state with its scalar
tables), both directions. The keys are specified in docs/formats.md."""

from __future__ import annotations

from typing import Any

from .._format.keys import (
    ESCAPE,
    GROUPS_PREFIX,
    KEYS_ENTRY,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    STATE_PREFIX,
    escape_part,
    is_flat_part,
    is_plain_part,
    owner_fqn,
    unescape_part,
)
from .common import ScalarParts, len32
from .errors import CheckpointFormatError
from .table_codec import TAG_STR, TAG_TUPLE, check_cpu_dtypes, scalar_record


def _state_part(leaf: str, fqn: str, key: Any, path: tuple[Any, ...], escape: bool) -> str:
    """The flat-key form of one state key part (escaped in the packed format), or raise."""
    if is_plain_part(key):
        return key
    if escape:
        escaped = escape_part(key)
        if escaped is not None:
            return escaped
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state key {_path_repr((*path, key))} of {fqn!r} is a {type(key).__name__}; "
            "state keys must be str or int"
        )
    if is_flat_part(key):
        return key
    raise CheckpointFormatError(
        f"leaf {leaf!r}: state key {_path_repr((*path, key))} of {fqn!r} cannot be written in the flat "
        "format (a key must be a str without '.'); save with format='packed'"
    )


def _path_repr(path: tuple[Any, ...]) -> str:
    return " -> ".join(repr(k) for k in path)


def _flatten_item(
    out: dict[str, Any],
    prefix: str,
    key: Any,
    item: Any,
    leaf: str,
    fqn: str,
    path: tuple[Any, ...],
    known_fqns: Any,
    escape: bool,
    emitted: list[str] | None = None,
) -> None:
    """One entry ``key: item`` of the (nested) state under ``prefix``; each key written is also
    appended to ``emitted`` when given."""
    part = _state_part(leaf, fqn, key, path, escape)
    full = f"{prefix}.{part}"
    if isinstance(item, dict):
        if not item:
            raise CheckpointFormatError(
                f"leaf {leaf!r}: state key {_path_repr((*path, key))} of {fqn!r} holds an empty dict, "
                "which has no flat key"
            )
        if full[len(STATE_PREFIX) :] in known_fqns:  # keys below would read as that parameter's state
            escaped = escape_part(key) if escape and part is key else None
            if escaped is None or f"{prefix}.{escaped}"[len(STATE_PREFIX) :] in known_fqns:
                raise CheckpointFormatError(
                    f"leaf {leaf!r}: nested state {_path_repr((*path, key))} of {fqn!r} would be read back as "
                    f"state of parameter {full[len(STATE_PREFIX) :]!r}"
                    + ("" if escape else "; save with format='packed'")
                )
            full = f"{prefix}.{escaped}"
        for sub_key, sub_item in dict.items(item):
            _flatten_item(out, full, sub_key, sub_item, leaf, fqn, (*path, key), known_fqns, escape, emitted)
    else:
        out[full] = item
        if emitted is not None:
            emitted.append(full)


def flatten_state(leaf: str, state_fqn: dict[str, Any], known_fqns: Any, escape: bool) -> dict[str, Any]:
    """``state.{fqn}.{key}`` for every state entry; nested dicts are flattened with ``.``.

    ``escape=True`` (packed format) escapes key parts that are not plain (see
    :mod:`sparse_ckpt._format.keys`) and nested parts whose dotted path is in ``known_fqns`` (another
    parameter's FQN); ``escape=False`` (flat format) refuses them. Empty nested dicts are refused
    (no flat key can hold them); an empty top-level state dict emits nothing (no state).
    """
    out: dict[str, Any] = {}
    for fqn, state in state_fqn.items():
        if not isinstance(state, dict):
            raise CheckpointFormatError(f"leaf {leaf!r}: state of {fqn!r} is a {type(state).__name__}, expected a dict")
        for key, item in dict.items(state):
            _flatten_item(out, f"{STATE_PREFIX}{fqn}", key, item, leaf, fqn, (), known_fqns, escape)
    return out


def flatten_packed_state(
    leaf: str,
    state_fqn: dict[str, Any],
    known_fqns: Any,
    tensor_type: type,
    cpu_dtypes: dict,
    strided: Any,
    scalar_parts: ScalarParts,
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], list[str]]]]:
    """:func:`flatten_state` (``escape=True``) of the packed format, version 2, with the scalars
    hoisted into a scalar table's groups.

    Returns ``(items, scalar_groups)``. Each parameter's *leading run* of state entries that
    :func:`~.table_codec.scalar_record` accepts (in the state dict's order) is left out of ``items``;
    ``scalar_groups`` lists ``(scalars, fqns)``: every distinct scalar dict (distinct by its
    encoded bytes, in order of first appearance; a new dict holding the saved values) with the
    FQNs whose leading run is exactly it, in state order -- ready for :func:`encode_table`.
    Every parameter with state is in one group: its scalar dict ends with the entry
    :data:`~sparse_ckpt._format.keys.KEYS_ENTRY` (``"~keys"``), the tuple of the keys it wrote to
    ``items`` without their ``state.{fqn}.`` prefix, in order (the checkpoint's record of which
    state each parameter has; a key UTF-8 cannot encode is recorded as its surrogate-passing
    UTF-8 ``bytes``). A parameter whose state is an empty dict has no state: no group.

    ``cpu_dtypes`` (an exact dict, else :class:`TypeError`) maps each ``dtype`` whose plain CPU
    0-d tensors the core encodes itself to ``(codec dtype name, item size)`` (no complex dtype:
    the core does not read the conj bit); ``strided`` is the
    strided layout object. ``scalar_parts`` is called only for the other 0-d tensors (another
    device or dtype, autograd, conj/neg bits...), never for tensors with ``ndim != 0``. Errors
    are :func:`flatten_state`'s.
    """
    check_cpu_dtypes(cpu_dtypes)
    out: dict[str, Any] = {}
    groups: list[tuple[dict[str, Any], list[str]]] = []
    index_of: dict[bytes, int] = {}
    for fqn, state in state_fqn.items():
        if not isinstance(state, dict):
            raise CheckpointFormatError(f"leaf {leaf!r}: state of {fqn!r} is a {type(state).__name__}, expected a dict")
        prefix = f"{STATE_PREFIX}{fqn}"
        scalars: dict[str, Any] = {}
        blob = bytearray()
        leading = True
        emitted: list[str] = []
        for key, item in dict.items(state):
            if leading:
                record = scalar_record(leaf, fqn, key, item, tensor_type, cpu_dtypes, strided, scalar_parts)
                if record is not None:
                    scalars[key] = item
                    blob += record
                    continue
                leading = False
            _flatten_item(out, prefix, key, item, leaf, fqn, (), known_fqns, True, emitted)
        if scalars or emitted:
            cut = len(prefix) + 1
            keys = tuple(_recorded_key(k[cut:]) for k in emitted)
            scalars[KEYS_ENTRY] = keys
            blob += _keys_record(keys)
            ident = len32(len(scalars)) + bytes(blob)
            idx = index_of.get(ident)
            if idx is None:
                index_of[ident] = len(groups)
                groups.append((scalars, [fqn]))
            else:
                groups[idx][1].append(fqn)
    return out, groups


def _recorded_key(key: str) -> str | bytes:
    """A per-item key as :data:`~sparse_ckpt._format.keys.KEYS_ENTRY` records it: the ``str`` itself, or
    its UTF-8 bytes with lone surrogates passed through when UTF-8 cannot encode it (the table
    codec holds only valid text)."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return key.encode("utf-8", "surrogatepass")
    return key


def _keys_record(keys: tuple[str | bytes, ...]) -> bytes:
    """The grouping bytes of a :data:`~sparse_ckpt._format.keys.KEYS_ENTRY` entry (name, tuple tag, count,
    each key's UTF-8 bytes, lone surrogates passed through): only compared, never decoded."""
    out = bytearray(len32(len(KEYS_ENTRY)))
    out += KEYS_ENTRY.encode("utf-8")
    out.append(TAG_TUPLE)
    out += len32(len(keys))
    for k in keys:
        raw = k if isinstance(k, bytes) else k.encode("utf-8", "surrogatepass")
        out.append(TAG_STR)
        out += len32(len(raw))
        out += raw
    return bytes(out)


def flatten_groups(leaf: str, groups_fqn: list[tuple[dict, list[str]]]) -> dict[str, Any]:
    """``param_groups.{fqn}.{key}`` for every parameter of every group (DSD's flat layout).

    A setting key that is not a ``str`` or contains ``.`` cannot be read back from that layout
    and is refused.
    """
    out: dict[str, Any] = {}
    for gi, (settings, fqns) in enumerate(groups_fqn):
        for key in dict.keys(settings):
            if not is_flat_part(key):
                raise CheckpointFormatError(
                    f"leaf {leaf!r} group {gi}: setting key {key!r} cannot be written in the flat format "
                    "(a key must be a str without '.'); save with format='packed'"
                )
        for fqn in fqns:
            for key, value in dict.items(settings):
                out[f"{GROUPS_PREFIX}{fqn}.{key}"] = value
    return out


def unflatten(
    flat: dict[str, Any], known_fqns: Any
) -> tuple[dict[str, dict], dict[str, dict], dict[str, bytes], dict[str, bytes], list[str]]:
    """Split a flat/packed optimizer dict into its parts.

    Returns ``(settings_by_fqn, state_by_fqn, packed_tables, scalar_tables, unmatched_keys)``:
      * ``param_groups.{fqn}.{key}`` -> ``settings_by_fqn[fqn][key]`` (split at the last dot);
      * ``param_groups.__packed__.{rest}`` -> ``packed_tables[rest]`` (must be bytes);
      * ``state.__packed__.{rest}`` -> ``scalar_tables[rest]`` (must be bytes; decoded by the caller);
      * ``state.{fqn}.{k1}.{k2}`` -> ``state_by_fqn[fqn][k1][k2]``, where ``fqn`` is the longest
        prefix that is in ``known_fqns`` or among the flat param-group FQNs. ``known_fqns`` is a
        dict or set, or a callable that is given ``packed_tables`` once they are split off and
        returns one (so state resolves against the FQNs the checkpoint's own tables list). When
        there are packed or scalar tables, key parts starting with ``~`` are unescaped (see
        :mod:`sparse_ckpt._format.keys`);
      * every other key, and state keys with no known FQN, -> ``unmatched_keys``.
    Each key is resolved with O(depth) hash lookups; there are no prefix scans. ``flat`` is never
    modified: a dict value that nested keys extend (``state.w.a`` = ``{...}`` and ``state.w.a.b``)
    is copied (``.copy()``) before it is written into.
    """
    settings_by_fqn: dict[str, dict] = {}
    packed: dict[str, bytes] = {}
    scalars: dict[str, bytes] = {}
    unmatched: list[str] = []
    state_keys: list[str] = []
    for key, value in flat.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"optimizer state dict key {key!r} is not a string")
        if key.startswith(SCALARS_PREFIX):
            if not isinstance(value, bytes):
                raise CheckpointFormatError(f"scalar table {key!r} is a {type(value).__name__}, expected bytes")
            scalars[key[len(SCALARS_PREFIX) :]] = value
        elif key.startswith(STATE_PREFIX):
            state_keys.append(key)
        elif key.startswith(PACKED_PREFIX):
            if not isinstance(value, bytes):
                raise CheckpointFormatError(f"packed group table {key!r} is a {type(value).__name__}, expected bytes")
            packed[key[len(PACKED_PREFIX) :]] = value
        elif key.startswith(GROUPS_PREFIX):
            body = key[len(GROUPS_PREFIX) :]
            dot = body.rfind(".")
            if dot <= 0 or dot == len(body) - 1:
                unmatched.append(key)
                continue
            settings_by_fqn.setdefault(body[:dot], {})[body[dot + 1 :]] = value
        else:
            unmatched.append(key)
    if callable(known_fqns):
        known_fqns = known_fqns(packed)
    unescape = bool(packed) or bool(scalars)
    state_by_fqn: dict[str, dict] = {}
    owned: set[int] = set()  # ids of the dicts built here (all alive in state_by_fqn until we return)
    for key in state_keys:
        body = key[len(STATE_PREFIX) :]
        fqn = owner_fqn(body, known_fqns, settings_by_fqn)
        if fqn is None:
            unmatched.append(key)
            continue
        parts: list[Any] = body[len(fqn) + 1 :].split(".")
        if unescape:
            parts = [unescape_part(p, key) if p.startswith(ESCAPE) else p for p in parts]
        node = state_by_fqn.get(fqn)
        if node is None:
            node = state_by_fqn[fqn] = {}
            owned.add(id(node))
        for part in parts[:-1]:
            fresh: dict = {}
            child = node.setdefault(part, fresh)
            if child is fresh:
                owned.add(id(fresh))
            elif not isinstance(child, dict):
                raise CheckpointFormatError(f"state key {key!r} nests under a non-dict value of {fqn!r}")
            elif id(child) not in owned:  # a dict value of the input: copy it, never write into it
                child = child.copy()
                node[part] = child
                owned.add(id(child))
            node = child
        if parts[-1] in node and isinstance(node[parts[-1]], dict):
            raise CheckpointFormatError(f"state key {key!r} collides with nested state of {fqn!r}")
        node[parts[-1]] = flat[key]
    return settings_by_fqn, state_by_fqn, packed, scalars, unmatched
