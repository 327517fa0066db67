"""The key grammar of sparse_ckpt's optimizer dicts: one home for every key rule.

A sparse optimizer dict is a plain ``dict[str, value]``:

* ``state.{fqn}.{k1}[.{k2}...]`` -- one per-parameter state value (nested state dicts are
  flattened with ``.``); the flat format writes every state value this way (torch DSD's layout);
* ``state.__packed__.{leaf}.{digest}`` -- packed format (version 2): a leaf's binary *scalar
  table*, ``digest`` being :func:`table_digest` of its bytes (see below);
* ``param_groups.{fqn}.{key}`` -- flat format: one group setting of one parameter;
* ``param_groups.__packed__.{leaf}.{digest}`` -- packed format: a leaf's binary group table,
  ``digest`` being :func:`table_digest` of the table bytes;
* :data:`PLANNER_GUARD_KEY` -- only in the dicts a DCP ``Stateful`` of sparse_ckpt returns: a
  one-element tensor that makes ``dcp.load`` without :class:`sparse_ckpt.SparseLoadPlanner`
  fail while planning, before any byte is read;
* *foreign-loader guards* -- only in the packed dicts a DCP ``Stateful`` of sparse_ckpt returns:
  ``param_groups.{fqn}.lr`` for the first FQN of each leaf, and ``param_groups.0.lr``, each an
  empty ``uint8`` tensor (:func:`foreign_guard_keys`). These are the keys a loader that does not
  know the format asks for -- torch DSD's flat layout (VeOmni, torchtitan) and its nested layout
  (Accelerate, DSD's default) -- and a tensor where it expects a number makes DCP refuse the load
  while planning ("Invalid checkpoint metadata for ...param_groups.<fqn>.lr"), also with
  ``allow_partial_load=True``, which would otherwise skip the packed settings silently. sparse_ckpt's
  readers skip them (:func:`is_foreign_guard`).

**Scalar tables** (packed format, version 2). Per leaf, the *leading run* of each parameter's
top-level state entries (in the state dict's own order) whose key is a plain part (see below)
and whose value is a plain 0-d ``torch.Tensor`` (exact type, a dtype the table codec holds, no
autograd) or an exact ``bool``/``int`` (64-bit)/``float`` is not written per item but into one
scalar table: the group-table codec, each "group" being one distinct scalar dict and the FQNs
that have exactly it (Adam's ``step`` of every parameter of an MoE leaf is usually one group).
The rest of the entries are ``state.{fqn}.{key}`` items as before. On load a parameter's state
is its scalars (in table order) followed by its per-item entries, so key order is exact;
scalar tensors are rebuilt on CPU (torch's load policy then moves ``step`` to the parameter's
device only for fused/capturable groups). Tables of one leaf from several ranks merge; one FQN
in two tables must have the same scalars. Packed version 1 (every state value per item) stays
readable. ``__packed__`` is reserved: no parameter FQN may start with ``__packed__.``.

**State key parts** (packed format). A state key part that is a ``str`` without ``.`` and not
starting with ``~`` is written as it is (so ordinary checkpoints are byte-for-byte DSD's
keys). Any other part is *escaped*: ``~s`` + the string with ``%`` -> ``%25`` and ``.`` ->
``%2E``, or ``~i`` + the decimal of an ``int`` key. A nested part whose dotted path would read as
another parameter's FQN is escaped too. The decoder resolves a state key against the
checkpoint's own FQNs (the longest one that prefixes the key), then unescapes the remaining
parts. The flat format cannot escape (DSD would misread it), so it refuses such keys at save
time.

**FQNs** (:mod:`sparse_ckpt.fqn`): a parameter's canonical FQN is its
``named_parameters(remove_duplicate=False)`` name without the wrapper parts torch DSD drops:
every part in :data:`STRIPPED_PARTS`, and :data:`WRAPPER_CHILD` directly under a wrapper
instance (DDP). Adding a wrapper prefix means adding it here (and a test).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .errors import CheckpointFormatError

PACKED_MARKER = "__packed__"
STATE_PREFIX = "state."
GROUPS_PREFIX = "param_groups."
PACKED_PREFIX = f"{GROUPS_PREFIX}{PACKED_MARKER}."
SCALARS_PREFIX = f"{STATE_PREFIX}{PACKED_MARKER}."
"""Prefix of the packed format's per-leaf scalar tables (``state.__packed__.{leaf}.{digest}``)."""
STEP_KEY = "step"
"""The state key torch treats specially: not cast to the param's dtype (unless fused/capturable),
not shape-checked, and allocated as a plain tensor by the load planner."""
OPTIMIZER_PREFIXES = (STATE_PREFIX, GROUPS_PREFIX)
"""The first part of every key of an optimizer dict."""
RESERVED_FQN_PREFIX = f"{PACKED_MARKER}."
"""No parameter with state may have an FQN starting with this: its keys would read as a table."""
PLANNER_GUARD_KEY = "__sparse_ckpt__.load_with.SparseLoadPlanner"
"""Key of the planner guard (see :mod:`sparse_ckpt.dcp`); never part of a decoded checkpoint."""

FOREIGN_GUARD_SETTING = "lr"
"""The group setting a foreign loader's target has for every parameter (every torch optimizer has it)."""
FOREIGN_GUARD_GROUP = "0"
"""The group index of DSD's nested layout (``param_groups.0.lr``) the guard also takes."""

STRIPPED_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})
"""FQN parts left out wherever they are: ``torch.compile``'s and activation checkpointing's wrappers."""
WRAPPER_CHILD = "module"
"""The FQN part left out directly under a wrapper instance (DDP's ``module.``), and only there."""

ESCAPE = "~"
ESCAPE_STR = "~s"
ESCAPE_INT = "~i"


def foreign_guard_keys(first_fqns: list[str]) -> list[str]:
    """The foreign-loader guard keys of a packed optimizer dict whose leaves' first FQNs are ``first_fqns``."""
    keys = dict.fromkeys(f"{GROUPS_PREFIX}{fqn}.{FOREIGN_GUARD_SETTING}" for fqn in first_fqns)
    keys[NESTED_GUARD_KEY] = None
    return list(keys)


def foreign_guard_value() -> torch.Tensor:
    """A foreign-loader guard's value: an empty ``uint8`` tensor (a number is what a foreign target holds)."""
    return torch.empty(0, dtype=torch.uint8)


def is_foreign_guard(key: str, value: object) -> bool:
    """A foreign-loader guard: a non-table ``param_groups.*.lr`` key whose value -- a tensor, or DCP's
    ``TensorStorageMetadata`` of one -- is empty ``uint8``. No optimizer setting is one."""
    if not key.endswith(f".{FOREIGN_GUARD_SETTING}") or GROUPS_PREFIX not in key or is_table_key(key):
        return False
    if isinstance(value, torch.Tensor):
        shape, dtype = tuple(value.shape), value.dtype
    elif isinstance(value, TensorStorageMetadata):
        shape, dtype = tuple(value.size), value.properties.dtype
    else:
        return False
    return shape == (0,) and dtype == torch.uint8


NESTED_GUARD_KEY = f"{GROUPS_PREFIX}{FOREIGN_GUARD_GROUP}.{FOREIGN_GUARD_SETTING}"
"""The foreign-loader guard every guarded dict has (see :func:`foreign_guard_keys`)."""


def without_foreign_guards(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` without its foreign-loader guards (``flat`` itself when it has none: one lookup)."""
    if not is_foreign_guard(NESTED_GUARD_KEY, flat.get(NESTED_GUARD_KEY)):
        return flat
    return {k: v for k, v in flat.items() if not is_foreign_guard(k, v)}


def table_digest(table: bytes) -> str:
    """Content hash used in a packed table's key (16 hex digits of BLAKE2b)."""
    return hashlib.blake2b(table, digest_size=8).hexdigest()


def packed_table_key(leaf: str, table: bytes) -> str:
    """``param_groups.__packed__.{leaf}.{digest}``."""
    return f"{PACKED_PREFIX}{leaf}.{table_digest(table)}"


def scalar_table_key(leaf: str, table: bytes) -> str:
    """``state.__packed__.{leaf}.{digest}``."""
    return f"{SCALARS_PREFIX}{leaf}.{table_digest(table)}"


def split_table_key(rest: str, prefix: str = PACKED_PREFIX) -> tuple[str, str]:
    """``"{leaf}.{digest}"`` (a table key without ``prefix``: :data:`PACKED_PREFIX` for a group
    table, :data:`SCALARS_PREFIX` for a scalar table) -> ``(leaf, digest)``."""
    leaf, dot, digest = rest.rpartition(".")
    if not dot or not leaf or not digest:
        raise CheckpointFormatError(f"{table_kind(prefix)} key '{prefix}{rest}' has no leaf/digest")
    return leaf, digest


def check_table(prefix: str, rest: str, table: object) -> str:
    """The leaf of table ``{prefix}{rest}`` (``prefix``: :data:`PACKED_PREFIX` or
    :data:`SCALARS_PREFIX`) after checking that it is ``bytes`` matching the key's digest."""
    kind = table_kind(prefix)
    if not isinstance(table, bytes):
        raise CheckpointFormatError(f"{kind} '{prefix}{rest}' is a {type(table).__name__}, expected bytes")
    leaf, digest = split_table_key(rest, prefix)
    if table_digest(table) != digest:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: {kind} '{prefix}{rest}' does not match its digest (corrupt or edited checkpoint)"
        )
    return leaf


def table_kind(prefix: str) -> str:
    """``"packed group table"`` or ``"scalar table"``, for messages."""
    return "scalar table" if prefix == SCALARS_PREFIX else "packed group table"


def is_table_key(key: str) -> bool:
    """A (flattened) DCP key of a group or scalar table: its value must be plain ``bytes``."""
    return PACKED_PREFIX in key or SCALARS_PREFIX in key


def is_state_item(key: str) -> bool:
    """A key of one per-item state value (``state.{fqn}.{...}``; not a scalar table)."""
    return key.startswith(STATE_PREFIX) and not key.startswith(SCALARS_PREFIX)


def state_key(fqn: str, part: object) -> str:
    """``state.{fqn}.{part}``: the per-item key of one (already escaped, if needed) state part."""
    return f"{STATE_PREFIX}{fqn}.{part}"


def split_group_key(key: str) -> tuple[str, str] | None:
    """A flat ``param_groups.{fqn}.{setting}`` key -> ``(fqn, setting)``; ``None`` for a table key
    or a key of another kind. (``fqn`` is ``""`` for a root parameter's key without a dot.)"""
    if not key.startswith(GROUPS_PREFIX) or key.startswith(PACKED_PREFIX):
        return None
    fqn, _dot, setting = key[len(GROUPS_PREFIX) :].rpartition(".")
    return fqn, setting


def last_part(key: str) -> str:
    """The last dotted part of a key (a per-item state key's own state key, unless nested)."""
    return key.rpartition(".")[2]


def has_escaped_part(key: str) -> bool:
    """A key with an escaped part (see *State key parts*): the flat layout cannot hold it."""
    return f".{ESCAPE}" in key


def is_reserved_fqn(fqn: object) -> bool:
    """An FQN the packed format cannot hold state of (see :data:`RESERVED_FQN_PREFIX`)."""
    return type(fqn) is str and fqn.startswith(RESERVED_FQN_PREFIX)


def is_plain_part(part: object) -> bool:
    """A packed-format state key part written as it is: a ``str`` without ``.`` not starting with ``~``."""
    return type(part) is str and "." not in part and not part.startswith(ESCAPE)


def is_flat_part(part: object) -> bool:
    """A key part the flat (DSD) layout can hold: a ``str`` without ``.``."""
    return type(part) is str and "." not in part


def escape_part(part: object) -> str | None:
    """The escaped form of a state key part (``None`` for a type that cannot be escaped)."""
    if isinstance(part, str):
        return ESCAPE_STR + part.replace("%", "%25").replace(".", "%2E")
    if type(part) is int:
        return f"{ESCAPE_INT}{part}"
    return None


def unescape_part(part: str, key: str) -> str | int:
    """Inverse of :func:`escape_part` for a part (of state key ``key``) that starts with ``~``."""
    if part.startswith(ESCAPE_STR):
        return part[2:].replace("%2E", ".").replace("%25", "%")
    if part.startswith(ESCAPE_INT):
        text = part[2:]
        digits = text.removeprefix("-")
        if digits and digits.isascii() and digits.isdigit():
            return int(text)
    raise CheckpointFormatError(f"state key {key!r} has an invalid escaped part {part!r}")


def owner_fqn(body: str, *known: object) -> str | None:
    """The longest proper dotted prefix of ``body`` (a state key without ``state.``) that is in one
    of the ``known`` containers (dicts or sets of FQNs), else None: the parameter the key belongs to.
    O(depth) hash lookups, no scan."""
    dot = body.rfind(".")
    while dot > 0:
        candidate = body[:dot]
        for container in known:
            if candidate in container:  # type: ignore[operator]
                return candidate
        dot = body.rfind(".", 0, dot)
    return None


def source_text(source: Any) -> str:
    """Where a parameter's saved settings came from, for messages: a ``(leaf, group index)`` of a
    packed table (what the core records, cheaply, per group), or a text (flat entries)."""
    if type(source) is tuple:
        return f"table of leaf {source[0]!r} group {source[1]}"
    return str(source)
