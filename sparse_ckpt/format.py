"""The key grammar of sparse_ckpt's optimizer dicts: one home for every key rule.

A sparse optimizer dict is a plain ``dict[str, value]``:

* ``state.{fqn}.{k1}[.{k2}...]`` -- one per-parameter state value (nested state dicts are
  flattened with ``.``), identical in the packed and the flat format (torch DSD's layout);
* ``param_groups.{fqn}.{key}`` -- flat format: one group setting of one parameter;
* ``param_groups.__packed__.{leaf}.{digest}`` -- packed format: a leaf's binary group table,
  ``digest`` being :func:`table_digest` of the table bytes;
* :data:`PLANNER_GUARD_KEY` -- only in the dicts a DCP ``Stateful`` of sparse_ckpt returns: a
  one-element tensor that makes ``dcp.load`` without :class:`sparse_ckpt.SparseLoadPlanner`
  fail while planning, before any byte is read.

**State key parts** (packed format). A state key part that is a ``str`` without ``.`` and not
starting with ``~`` is written as it is (so ordinary checkpoints are byte-for-byte DSD's
keys). Any other part is *escaped*: ``~s`` + the string with ``%`` -> ``%25`` and ``.`` ->
``%2E``, or ``~i`` + the decimal of an ``int`` key. A nested part whose dotted path would read as
another parameter's FQN is escaped too. The decoder resolves a state key against the
checkpoint's own FQNs (the longest one that prefixes the key), then unescapes the remaining
parts. The flat format cannot escape (DSD would misread it), so it refuses such keys at save
time.
"""

from __future__ import annotations

import hashlib

from .errors import CheckpointFormatError

PACKED_MARKER = "__packed__"
STATE_PREFIX = "state."
GROUPS_PREFIX = "param_groups."
PACKED_PREFIX = f"{GROUPS_PREFIX}{PACKED_MARKER}."
STEP_KEY = "step"
"""The state key torch treats specially: not cast to the param's dtype (unless fused/capturable),
not shape-checked, and allocated as a plain tensor by the load planner."""
PLANNER_GUARD_KEY = "__sparse_ckpt__.load_with.SparseLoadPlanner"
"""Key of the planner guard (see :mod:`sparse_ckpt.dcp`); never part of a decoded checkpoint."""

ESCAPE = "~"
_ESC_STR = "~s"
_ESC_INT = "~i"


def table_digest(table: bytes) -> str:
    """Content hash used in a packed table's key (16 hex digits of BLAKE2b)."""
    return hashlib.blake2b(table, digest_size=8).hexdigest()


def packed_table_key(leaf: str, table: bytes) -> str:
    """``param_groups.__packed__.{leaf}.{digest}``."""
    return f"{PACKED_PREFIX}{leaf}.{table_digest(table)}"


def split_table_key(rest: str) -> tuple[str, str]:
    """``"{leaf}.{digest}"`` (a table key without :data:`PACKED_PREFIX`) -> ``(leaf, digest)``."""
    leaf, dot, digest = rest.rpartition(".")
    if not dot or not leaf or not digest:
        raise CheckpointFormatError(f"packed group table key '{PACKED_PREFIX}{rest}' has no leaf/digest")
    return leaf, digest


def is_plain_part(part: object) -> bool:
    """A packed-format state key part written as it is: a ``str`` without ``.`` not starting with ``~``."""
    return type(part) is str and "." not in part and not part.startswith(ESCAPE)


def is_flat_part(part: object) -> bool:
    """A key part the flat (DSD) layout can hold: a ``str`` without ``.``."""
    return type(part) is str and "." not in part


def escape_part(part: object) -> str | None:
    """The escaped form of a state key part (``None`` for a type that cannot be escaped)."""
    if isinstance(part, str):
        return _ESC_STR + part.replace("%", "%25").replace(".", "%2E")
    if type(part) is int:
        return f"{_ESC_INT}{part}"
    return None


def unescape_part(part: str, key: str) -> str | int:
    """Inverse of :func:`escape_part` for a part (of state key ``key``) that starts with ``~``."""
    if part.startswith(_ESC_STR):
        return part[2:].replace("%2E", ".").replace("%25", "%")
    if part.startswith(_ESC_INT):
        text = part[2:]
        digits = text.removeprefix("-")
        if digits and digits.isascii() and digits.isdigit():
            return int(text)
    raise CheckpointFormatError(f"state key {key!r} has an invalid escaped part {part!r}")


def owner_fqn(body: str, known: object) -> str | None:
    """The longest proper dotted prefix of ``body`` that is in ``known`` (a dict or set), else None."""
    dot = body.rfind(".")
    while dot > 0:
        candidate = body[:dot]
        if candidate in known:  # type: ignore[operator]
            return candidate
        dot = body.rfind(".", 0, dot)
    return None
