"""The *item record* of a save (docs/formats.md, *Item record*): a sealed group or scalar table
carries the keys of every table and buffer its save wrote, as one more settings entry that no
group refers to, so the tables that remain find a lost table, layout or buffer missing
(`sparse_ckpt._load.completeness`)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from operator import itemgetter

__all__ = [
    "ITEMS_ENTRY",
    "groups_tail",
    "items_record",
    "items_record_parts",
    "split_items_record",
    "with_items_record",
]

ITEMS_ENTRY = "~items"
"""The key of a table's *item record* (see :func:`with_items_record`)."""


def items_record(keys: Iterable[str]) -> bytes | None:
    """The table-codec bytes of the settings entry ``{ITEMS_ENTRY: tuple(keys)}`` (``None`` when a
    key is not valid Unicode: no record then)."""
    out = bytearray((1).to_bytes(4, "little"))
    out += len(ITEMS_ENTRY).to_bytes(4, "little") + ITEMS_ENTRY.encode("ascii")
    keys = list(keys)
    out += bytes([_TAG_TUPLE]) + len(keys).to_bytes(4, "little")
    for key in keys:
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError:
            return None
        out += bytes([_TAG_STR]) + len(raw).to_bytes(4, "little") + raw
    return bytes(out)


_TAG_STR = 5
_TAG_TUPLE = 7
"""The table codec's value tags of ``str`` and ``tuple`` (docs/formats.md, "Table codec")."""


def groups_tail(fqn_lists: Iterable[list[str]]) -> int:
    """The byte length of a table's groups part (``u32 n_groups`` to the end) for groups with these FQNs."""
    # C-level passes only (47 275 groups at 61x256: a generator per FQN cost ~8 ms per save);
    # an all-ASCII text's UTF-8 length is its length (no encoded copy made then).
    lists = fqn_lists if type(fqn_lists) is list else list(fqn_lists)
    names = "".join(chain.from_iterable(lists))
    n_bytes = len(names) if names.isascii() else len(names.encode("utf-8"))
    return 4 + 8 * len(lists) + 4 * sum(map(len, lists)) + n_bytes


def with_items_record(table: bytes, tail: int, record: bytes) -> bytes:
    """``table`` (a group or scalar table whose groups part is ``tail`` bytes) with ``record``
    (:func:`items_record`) as one more settings entry, the last one, that no group refers to: the
    *item record*, every table and buffer key its save wrote, so a lost table, layout or buffer is
    found missing by the tables that remain (docs/formats.md, "Item record"). Readers that do not
    look for it see an unused settings entry."""
    return b"".join(items_record_parts(table, tail, record))


def items_record_parts(table: bytes, tail: int, record: bytes) -> tuple[bytes | memoryview, ...]:
    """:func:`with_items_record` as the parts it joins (views of ``table``, no copy of it): what a
    save seals without making the table with its record first (`sparse_ckpt._format.keys.seal_parts`)."""
    n = int.from_bytes(table[6:10], "little")
    cut = len(table) - tail
    view = memoryview(table)
    return view[:6], (n + 1).to_bytes(4, "little"), view[10:cut], record, view[cut:]


def split_items_record(
    settings: list[dict], blobs: list[bytes], groups: list[tuple[int, list[str]]]
) -> tuple[list[dict], list[bytes], tuple[str, ...] | None]:
    """A decoded table's ``(settings, blobs, item record)``: the record (:func:`with_items_record`)
    taken out of the settings, ``None`` when the table has none."""
    if not settings or set(settings[-1]) != {ITEMS_ENTRY}:
        return settings, blobs, None
    last = len(settings) - 1
    items = settings[-1][ITEMS_ENTRY]
    if type(items) is not tuple or not all(type(k) is str for k in items):
        return settings, blobs, None
    if last in set(map(itemgetter(0), groups)):  # a group refers to it: no record (C-level pass over the groups)
        return settings, blobs, None
    return settings[:-1], blobs[:-1], items
