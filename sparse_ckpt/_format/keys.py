"""The key grammar of sparse_ckpt's optimizer dicts: one home for every key rule in code.

The specification is docs/formats.md, and only there: *Optimizer dicts* (every key, FQNs, state
key parts, the flat and packed formats, scalar tables and the state keys they record), *Table
keys* (stable rank-set tags, digest tags, seals) and *Buffers* (``state_layout="buffers"`` keys).
The constants and functions here implement it; their docstrings name the section they follow.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointFormatError

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
BUFFERS_MARKER = "__buffers__"
BUFFERS_PREFIX = f"{STATE_PREFIX}{BUFFERS_MARKER}."
"""Prefix of ``state_layout="buffers"`` items: ``state.__buffers__.{leaf}.L{rank tag}`` (a layout
table, sealed bytes), ``state.__buffers__.{leaf}.B{bucket}_{dtype}_{rank tag}`` (a 1-D buffer tensor)
and ``state.__buffers__.{leaf}.I{rank tag}`` (the leaf's layout index, sealed bytes)."""
RESERVED_FQN_PREFIX = f"{PACKED_MARKER}."
RESERVED_FQN_PREFIXES = (RESERVED_FQN_PREFIX, f"{BUFFERS_MARKER}.")
"""No parameter with state may have an FQN starting with these: its keys would read as a table or
a buffer."""
KEYS_ENTRY = "~keys"
"""The scalar-table entry listing a parameter's per-item state keys (see *State keys recorded*)."""
LENS_ENTRY = "~lens"
"""The scalar-table entry, after :data:`KEYS_ENTRY`, of a parameter with list-valued per-item state:
``((key, count), ...)``, each list's count of values, the list and its items (nested lists and
dicts counted likewise) included (see *State keys recorded*)."""
PLANNER_GUARD_KEY = "__sparse_ckpt__.load_with.SparseLoadPlanner"
"""Key of the planner guard (see :mod:`sparse_ckpt._dcp.stateful`); never part of a decoded checkpoint."""

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


_DIGEST_BYTES = 8


def table_digest(table: bytes) -> str:
    """Content hash of a table (16 hex digits of BLAKE2b): the ``d{digest}`` tag and the seal."""
    return hashlib.blake2b(table, digest_size=_DIGEST_BYTES).hexdigest()


def digest_tag(table: bytes) -> str:
    """``d{digest}``: the tag of a table keyed by its content (see *Table keys*)."""
    return f"d{table_digest(table)}"


def rank_tag(world: int, ranks: Iterable[int]) -> str:
    """``w{world}r{ranks}``: the tag of an item held by ``ranks`` (global ranks of a world of
    ``world``); runs of equally spaced ranks are written ``a-b`` (step 1) or ``a-b:step``."""
    rs = sorted(set(ranks))
    if not rs or rs[0] < 0 or rs[-1] >= world:
        raise ValueError(f"ranks {rs} are not ranks of a world of {world}")
    runs: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        if i + 1 < len(rs):
            step = rs[i + 1] - rs[i]
            while j + 1 < len(rs) and rs[j + 1] - rs[j] == step:
                j += 1
            if j - i < 2 and step != 1:  # two ranks far apart: two single entries
                j = i
        if j == i:
            runs.append(str(rs[i]))
        else:
            step = rs[i + 1] - rs[i]
            runs.append(f"{rs[i]}-{rs[j]}" if step == 1 else f"{rs[i]}-{rs[j]}:{step}")
        i = j + 1
    return f"w{world}r{'+'.join(runs)}"


def parse_rank_tag(tag: str) -> tuple[int, list[tuple[int, int, int]]] | None:
    """``(world, [(first, last, step), ...])`` of a ``w{W}r{ranks}`` tag, ``None`` for another kind
    of tag; a malformed rank tag is a :class:`CheckpointFormatError`."""
    if not tag.startswith("w"):
        return None
    world_text, sep, ranks_text = tag[1:].partition("r")
    try:
        if not sep or not world_text.isdigit():
            raise ValueError
        world = int(world_text)
        runs = []
        for run in ranks_text.split("+"):
            first_text, dash, rest = run.partition("-")
            last_text, colon, step_text = rest.partition(":")
            first = int(first_text)
            last = int(last_text) if dash else first
            step = int(step_text) if colon else 1
            if not (0 <= first <= last < world and step > 0) or not all(
                t.isdigit() for t in (first_text, *([last_text] if dash else []), *([step_text] if colon else []))
            ):
                raise ValueError
            runs.append((first, last, step))
    except ValueError:
        raise CheckpointFormatError(f"item tag {tag!r} is not a valid w{{world}}r{{ranks}} tag") from None
    return world, runs


def tag_has_rank(tag: str, world: int, rank: int) -> bool:
    """Whether ``w{W}r{ranks}`` tag ``tag`` says ``rank`` of a world of ``world`` holds the item."""
    parsed = parse_rank_tag(tag)
    if parsed is None or parsed[0] != world:
        return False
    return any(first <= rank <= last and (rank - first) % step == 0 for first, last, step in parsed[1])


def _seal_digest(*parts: bytes | memoryview) -> bytes:
    """The 8-byte BLAKE2b digest that :func:`seal` appends to the table ``b"".join(parts)`` (taken
    over the parts in order, without joining them)."""
    if len(parts) == 1:
        return hashlib.blake2b(parts[0], digest_size=_DIGEST_BYTES).digest()
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def seal(table: bytes) -> bytes:
    """The value of a rank-tagged table item: ``table`` followed by its 8-byte BLAKE2b digest."""
    return table + _seal_digest(table)


def seal_parts(parts: Sequence[bytes | memoryview]) -> bytes:
    """:func:`seal` of the table ``b"".join(parts)``, made with one copy of the parts (the digest
    taken over them in order, as over their concatenation)."""
    return b"".join((*parts, _seal_digest(*parts)))


def table_item_key(prefix: str, leaf: str, tag: str) -> str:
    """``{prefix}{leaf}.{tag}`` (``prefix``: :data:`PACKED_PREFIX` or :data:`SCALARS_PREFIX`)."""
    return f"{prefix}{leaf}.{tag}"


def packed_table_key(leaf: str, table: bytes) -> str:
    """``param_groups.__packed__.{leaf}.{digest}``: the legacy (pre stable keys) group-table key."""
    return f"{PACKED_PREFIX}{leaf}.{table_digest(table)}"


def scalar_table_key(leaf: str, table: bytes) -> str:
    """``state.__packed__.{leaf}.{digest}``: the legacy (pre stable keys) scalar-table key."""
    return f"{SCALARS_PREFIX}{leaf}.{table_digest(table)}"


def split_table_key(rest: str, prefix: str = PACKED_PREFIX) -> tuple[str, str]:
    """``"{leaf}.{tag}"`` (a table key without ``prefix``: :data:`PACKED_PREFIX` for a group
    table, :data:`SCALARS_PREFIX` for a scalar table) -> ``(leaf, tag)``."""
    leaf, dot, tag = rest.rpartition(".")
    if not dot or not leaf or not tag:
        raise CheckpointFormatError(f"{table_kind(prefix)} key '{prefix}{rest}' has no leaf/tag")
    return leaf, tag


def _is_digest(text: str) -> bool:
    return len(text) == 2 * _DIGEST_BYTES and all(c in "0123456789abcdef" for c in text)


def check_table(prefix: str, rest: str, table: object) -> tuple[str, bytes]:
    """``(leaf, table bytes)`` of table item ``{prefix}{rest}`` (``prefix``: :data:`PACKED_PREFIX`
    or :data:`SCALARS_PREFIX`) after checking that its value is ``bytes`` matching its digest: the
    key's for ``{digest}`` and ``d{digest}`` tags, the seal's for ``w{W}r{ranks}`` tags (see
    *Table keys*). A mismatch (or another tag) is a :class:`CheckpointFormatError`. A sealed
    table's item record (`sparse_ckpt._format.item_record`) is checked and left out."""
    return _check_table(prefix, rest, table)


def _check_table(prefix: str, rest: str, table: object) -> tuple[str, bytes]:
    kind = table_kind(prefix)
    if not isinstance(table, bytes):
        raise CheckpointFormatError(f"{kind} '{prefix}{rest}' is a {type(table).__name__}, expected bytes")
    leaf, tag = split_table_key(rest, prefix)
    if prefix == BUFFERS_PREFIX:  # a layout table (L{rank tag}) or a layout index (I{rank tag})
        if tag.startswith(INDEX_TAG):
            kind = "layout index"
        tag = tag[1:] if tag.startswith((LAYOUT_TAG, INDEX_TAG)) else ""
        if not tag or parse_rank_tag(tag) is None:
            raise CheckpointFormatError(f"{kind} key '{prefix}{rest}' has no L{{rank tag}} or I{{rank tag}} tag")
    if parse_rank_tag(tag) is not None:
        payload, digest = table[:-_DIGEST_BYTES], table[-_DIGEST_BYTES:]
        if len(table) < _DIGEST_BYTES or _seal_digest(payload) != digest:
            raise CheckpointFormatError(
                f"leaf {leaf!r}: {kind} '{prefix}{rest}' does not match its sealed digest (corrupt or edited "
                "checkpoint)"
            )
        return leaf, payload
    digest = tag[1:] if tag.startswith("d") and _is_digest(tag[1:]) else tag
    if table_digest(table) != digest:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: {kind} '{prefix}{rest}' does not match its digest (corrupt or edited checkpoint)"
        )
    return leaf, table


def table_kind(prefix: str) -> str:
    """``"packed group table"``, ``"scalar table"`` or ``"layout table"``, for messages."""
    return {SCALARS_PREFIX: "scalar table", BUFFERS_PREFIX: "layout table"}.get(prefix, "packed group table")


def is_table_key(key: str) -> bool:
    """A (flattened) DCP key of a group or scalar table: its value must be plain ``bytes``."""
    return PACKED_PREFIX in key or SCALARS_PREFIX in key


def is_state_item(key: str) -> bool:
    """A key of one per-item state value (``state.{fqn}.{...}``; not a scalar table, layout or buffer)."""
    return key.startswith(STATE_PREFIX) and not key.startswith((SCALARS_PREFIX, BUFFERS_PREFIX))


def is_buffer_item(key: str) -> bool:
    """A key of one ``state_layout="buffers"`` buffer tensor (``state.__buffers__.{leaf}.B...``)."""
    return key.startswith(BUFFERS_PREFIX) and key.rpartition(".")[2].startswith("B")


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
    """An FQN the packed format cannot hold state of (see :data:`RESERVED_FQN_PREFIXES`)."""
    return type(fqn) is str and fqn.startswith(RESERVED_FQN_PREFIXES)


LAYOUT_TAG = "L"
INDEX_TAG = "I"


def layout_tag(rank_tag: str) -> str:
    """``L{rank tag}``: the tag of a layout table (see :data:`BUFFERS_PREFIX`)."""
    return f"{LAYOUT_TAG}{rank_tag}"


def index_tag(rank_tag: str) -> str:
    """``I{rank tag}``: the tag of a leaf's layout index, held by the ranks of ``rank_tag`` (see
    :data:`BUFFERS_PREFIX`; docs/formats.md, *Layout index*)."""
    return f"{INDEX_TAG}{rank_tag}"


def buffer_tag(bucket: int, rank_tag: str, dtype: str | None = None) -> str:
    """``B{bucket}_{dtype}_{rank tag}``: the tag of bucket ``bucket`` (of ``dtype``) of a layout's
    buffers; ``B{bucket}{rank tag}`` without ``dtype`` (what writers before the dtype was part of
    the key wrote). The dtype is in the key because DCP's save-plan caching compares keys and
    sizes, not dtypes: a key must never be reused for a buffer of another dtype."""
    return f"B{bucket}{rank_tag}" if dtype is None else f"B{bucket}_{dtype}_{rank_tag}"


def buffer_dtype(rest: str) -> str | None:
    """The dtype named by buffer key ``"{leaf}.B..."`` (a key without :data:`BUFFERS_PREFIX`),
    ``None`` for a key written without it (see :func:`buffer_tag`)."""
    tag = rest.rpartition(".")[2]
    digits = len(tag) - len(tag[1:].lstrip("0123456789")) - 1
    if tag[1 + digits : 2 + digits] != "_":
        return None
    return tag[2 + digits :].rpartition("_")[0]


def split_buffers_key(rest: str) -> tuple[str, str, int | None, str]:
    """``"{leaf}.{tag}"`` (a key without :data:`BUFFERS_PREFIX`) -> ``(leaf, kind, bucket,
    rank tag)``: ``kind`` is ``"layout"`` or ``"index"`` (``bucket`` ``None``) or ``"buffer"``.
    Anything else is a :class:`CheckpointFormatError`."""
    leaf, dot, tag = rest.rpartition(".")
    bad = CheckpointFormatError(f"buffers key '{BUFFERS_PREFIX}{rest}' has no leaf and L, I or B tag")
    if not dot or not leaf or len(tag) < 2:
        raise bad
    if tag[0] == LAYOUT_TAG:
        kind, bucket, ranks = "layout", None, tag[1:]
    elif tag[0] == INDEX_TAG:
        kind, bucket, ranks = "index", None, tag[1:]
    elif tag[0] == "B":
        digits = len(tag) - len(tag[1:].lstrip("0123456789")) - 1
        if digits == 0:
            raise bad
        kind, bucket, ranks = "buffer", int(tag[1 : 1 + digits]), tag[1 + digits :]
        if ranks.startswith("_"):  # B{bucket}_{dtype}_{ranks}
            dtype, _sep, ranks = ranks[1:].rpartition("_")
            if not dtype or not dtype.replace("_", "").isalnum():
                raise bad
    else:
        raise bad
    if parse_rank_tag(ranks) is None:
        raise bad
    return leaf, kind, bucket, ranks


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


def key_parts(key: str) -> list[str | int]:
    """The parts of a state key path (``a.b``, escaped parts unescaped): where it nests in a state dict."""
    return [unescape_part(p, key) if p.startswith(ESCAPE) else p for p in key.split(".")]


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
