"""Twin of csrc/layout_codec.cpp: the ``state_layout="buffers"`` layout tables and the scatter plan.

A *layout table* describes the buffers one rank wrote for one leaf: per bucket (one 1-D buffer
item of one dtype) the state tensor chunks it holds, in order, each with its parameter's FQN, its
state key (the per-item key path, as in ``state.{fqn}.{key}``), the global shape and the chunk's
offsets and sizes in the global tensor. A chunk's elements sit in the bucket row-major, right
after the previous chunk's (its element offset is the running sum of the sizes' products).

The layout table format (``SCKL``, version 1) is specified in docs/formats.md ("Layout codec").

Input contract as in :mod:`sparse_ckpt._core_py.common`: lists or tuples, exact tuples of the stated
length, ``str`` names, ``int`` numbers, ``bytes`` tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .common import I64, INT64_MAX, MAX_ITEMSIZE, U16, U32, U32_MAX, U64, Reader, len32, utf8
from .errors import CheckpointFormatError, CheckpointMismatchError

LAYOUT_MAGIC = b"SCKL"
LAYOUT_VERSION = 1
MAX_NDIM = 64

Entry = tuple[str, str, str, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
ChunkOf = Callable[[str], "tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None"]


def _type_error(what: str, value: Any) -> TypeError:
    return TypeError(f"expected {what}, got {type(value).__name__}")


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list):
        raise _type_error(f"{what} as a tuple of ints", value)
    for d in value:
        if type(d) is not int:
            raise _type_error(f"{what} as a tuple of ints", d)
    return tuple(value)


def _volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return n


def _check_chunk(where: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str | None:
    """What is wrong with a chunk of a tensor of ``shape`` (``None`` when nothing is)."""
    if not (len(shape) == len(offsets) == len(sizes)):
        return f"{where}: shape, offsets and sizes have {len(shape)}, {len(offsets)} and {len(sizes)} dims"
    if len(shape) > MAX_NDIM:
        return f"{where}: {len(shape)} dims (at most {MAX_NDIM})"
    for d, o, s in zip(shape, offsets, sizes):
        if d < 0 or o < 0 or s < 0 or d > INT64_MAX or o + s > d:
            return f"{where}: chunk at offsets {offsets} of sizes {sizes} is not inside shape {shape}"
    if _volume(shape) > INT64_MAX:
        return f"{where}: shape {shape} has more than 2**63-1 elements"
    return None


def _put_str(out: bytearray, text: str, where: str) -> None:
    raw = utf8(text, where)
    if len(raw) > U32_MAX:
        raise CheckpointFormatError(f"{where}: string of {len(raw)} bytes does not fit the layout format")
    out += U32.pack(len(raw))
    out += raw


def encode_layout(
    leaf: str, entries: list[Entry], bucket_bytes: int
) -> tuple[bytes, list[tuple[str, int, list[tuple[int, int]]]]]:
    """The layout table of ``entries`` and its buckets: ``(table, buckets)``.

    ``entries`` are ``(fqn, key, dtype, itemsize, shape, offsets, sizes)`` tuples in state order.
    Entries are grouped by dtype (dtypes in order of first appearance), keep their order within a
    dtype, and fill buckets of at most ``bucket_bytes`` bytes (a bucket holds at least one entry,
    so one larger entry gets a bucket of its own). ``buckets`` lists ``(dtype, numel, [(entry
    index, element offset), ...])`` in table order. A chunk that is not inside its shape, a
    repeated ``(fqn, key)`` or an item size outside 1..16 is a :class:`CheckpointFormatError`
    naming the leaf, FQN and key; inputs outside the contract raise :class:`TypeError`.
    """
    if type(leaf) is not str:
        raise _type_error("the leaf as a str", leaf)
    if type(bucket_bytes) is not int or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if type(entries) not in (list, tuple):
        raise _type_error("entries as a list", entries)
    parsed, by_dtype = _read_entries(leaf, entries)
    buckets = _fill_buckets(leaf, parsed, by_dtype, bucket_bytes)
    return _write_layout(leaf, parsed, buckets), buckets


# The steps of encode_layout. Its C++ twin (csrc/layout_codec.cpp) keeps them in one function: there
# one pass reads, checks and sizes each entry and shares each parameter's chunk between its states
# (ChunkPool), which is what makes a large optimizer's table cheap to encode; splitting it would cost
# that sharing or pass state between the steps. Both raise the same errors in the same order.

_Parsed = list[tuple[str, str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
"""``encode_layout``'s entries, read and checked: ``(fqn, key, dtype, shape, offsets, sizes)``."""
_Buckets = list[tuple[str, int, list[tuple[int, int]]]]


def _read_entries(leaf: str, entries: list[Entry]) -> tuple[_Parsed, dict[str, list[tuple[int, int]]]]:
    """``entries`` read and checked in order (types, item size, chunk, ``(fqn, key)`` listed once):
    ``(parsed, by_dtype)``, ``by_dtype`` mapping each dtype (in order of first appearance) to its
    entries' ``(index, nbytes)``."""
    by_dtype: dict[str, list[tuple[int, int]]] = {}  # dtype -> [(entry index, nbytes)]
    seen: set[tuple[str, str]] = set()
    parsed: _Parsed = []
    for i, e in enumerate(entries):
        if type(e) is not tuple or len(e) != 7:
            raise _type_error("an entry as a tuple of 7", e)
        fqn, key, dtype, itemsize = e[0], e[1], e[2], e[3]
        for name, v in (("fqn", fqn), ("key", key), ("dtype", dtype)):
            if type(v) is not str:
                raise _type_error(f"the entry's {name} as a str", v)
        if type(itemsize) is not int:
            raise _type_error("the entry's item size as an int", itemsize)
        shape, offsets, sizes = _dims(e[4], "a shape"), _dims(e[5], "offsets"), _dims(e[6], "sizes")
        where = f"leaf {leaf!r}: state {key!r} of {fqn!r}"
        if not 1 <= itemsize <= MAX_ITEMSIZE:
            raise CheckpointFormatError(f"{where}: item size {itemsize} (1 to {MAX_ITEMSIZE})")
        problem = _check_chunk(where, shape, offsets, sizes)
        if problem is not None:
            raise CheckpointFormatError(problem)
        if (fqn, key) in seen:
            raise CheckpointFormatError(f"{where}: listed twice in one layout")
        seen.add((fqn, key))
        parsed.append((fqn, key, dtype, shape, offsets, sizes))
        by_dtype.setdefault(dtype, []).append((i, _volume(sizes) * itemsize))
    return parsed, by_dtype


def _fill_buckets(
    leaf: str, parsed: _Parsed, by_dtype: dict[str, list[tuple[int, int]]], bucket_bytes: int
) -> _Buckets:
    """Each dtype's entries, in order, in buckets of at most ``bucket_bytes`` bytes (at least one
    entry each): ``[(dtype, numel, [(entry index, element offset), ...]), ...]``."""
    buckets: _Buckets = []
    for dtype, items in by_dtype.items():
        current: list[tuple[int, int]] = []
        numel = 0
        nbytes = 0
        for i, size in items:
            if current and nbytes + size > bucket_bytes:
                buckets.append((dtype, numel, current))
                current, numel, nbytes = [], 0, 0
            current.append((i, numel))
            numel += _volume(parsed[i][5])
            nbytes += size
            if numel > INT64_MAX:
                fqn, key = parsed[i][0], parsed[i][1]
                raise CheckpointFormatError(
                    f"leaf {leaf!r}: state {key!r} of {fqn!r}: its {dtype} bucket would hold {numel} elements "
                    "(at most 2**63-1)"
                )
        if current:
            buckets.append((dtype, numel, current))
    return buckets


def _write_layout(leaf: str, parsed: _Parsed, buckets: _Buckets) -> bytes:
    """The layout table's bytes: magic, version, then per bucket its dtype, numel and entries."""
    out = bytearray(LAYOUT_MAGIC)
    out += U16.pack(LAYOUT_VERSION)
    out += len32(len(buckets))
    for dtype, numel, members in buckets:
        _put_str(out, dtype, f"leaf {leaf!r}: layout dtype")
        out += U64.pack(numel)
        out += len32(len(members))
        for i, _offset in members:
            fqn, key, _dtype, shape, offsets, sizes = parsed[i]
            where = f"leaf {leaf!r}: state {key!r} of {fqn!r}"
            _put_str(out, fqn, where)
            _put_str(out, key, where)
            out += U32.pack(len(shape))
            for dims in (shape, offsets, sizes):
                for d in dims:
                    out += I64.pack(d)
    return bytes(out)


def decode_layout(
    leaf: str, data: bytes
) -> list[tuple[str, int, list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]]:
    """A layout table's buckets: ``[(dtype, numel, [(fqn, key, shape, offsets, sizes), ...]), ...]``
    (each chunk's element offset is the running sum of the sizes' products). Checked as
    :func:`plan_scatter` checks every table; a defect is a :class:`CheckpointFormatError`."""
    if type(leaf) is not str:
        raise _type_error("the leaf as a str", leaf)
    if type(data) is not bytes:
        raise _type_error("a layout table as bytes", data)
    out: list[tuple[str, int, list[tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]] = []
    for _bi, dtype, numel, entry in _walk(data, f"leaf {leaf!r} layout table"):
        if entry is None:
            out.append((dtype, numel, []))
        else:
            out[-1][2].append(entry[0])
    return out


def _walk(data: bytes, where: str) -> Iterator[tuple[int, str, int, Any]]:
    """Read a layout table: ``(bucket, dtype, numel, None)`` as each bucket starts, then
    ``(bucket, dtype, numel, ((fqn, key, shape, offsets, sizes), element offset))`` per entry;
    every check of the format is made as its bytes are read (a caller's work between entries
    comes before the checks of later bytes)."""
    r = Reader(data, where, "layout")
    r.header(LAYOUT_MAGIC, LAYOUT_VERSION, "a sparse_ckpt layout table")
    listed: set[tuple[str, str]] = set()
    for bi in range(r.count("bucket list", 16)):
        dtype = r.string("bucket dtype")
        numel = U64.unpack(r.take(8, "bucket numel"))[0]
        if numel > INT64_MAX:
            raise r.fail(f"bucket of {numel} elements (at most 2**63-1)")
        n_entries = r.count("bucket entries", 12)
        yield bi, dtype, numel, None
        offset = 0
        for _ in range(n_entries):
            entry = _read_entry(r, listed)
            start = offset
            offset += _volume(entry[4])
            if offset > numel:
                raise r.fail(f"chunks hold more than the bucket's {numel} elements")
            yield bi, dtype, numel, (entry, start)
        if offset != numel:
            raise r.fail(f"chunks hold {offset} elements, the bucket {numel}")
    if r.pos != len(data):
        raise r.fail(f"{len(data) - r.pos} trailing bytes after the layout")


def _read_entry(
    r: Reader, listed: set[tuple[str, str]]
) -> tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """One entry of a bucket, checked (a chunk inside its shape, listed once in the table)."""
    fqn = r.string("FQN")
    key = r.string("state key")
    ndim = r.u32("ndim")
    if ndim > MAX_NDIM:
        raise r.fail(f"{ndim} dims (at most {MAX_NDIM})")
    shape, offsets, sizes = r.dims(ndim, "shape"), r.dims(ndim, "offsets"), r.dims(ndim, "sizes")
    problem = _check_chunk(f"state {key!r} of {fqn!r}", shape, offsets, sizes)
    if problem is not None:
        raise r.fail(problem)
    if (fqn, key) in listed:
        raise r.fail(f"state {key!r} of {fqn!r} listed twice")
    listed.add((fqn, key))
    return fqn, key, shape, offsets, sizes


def plan_scatter(
    leaf: str, layouts: list[bytes], chunk_of: ChunkOf
) -> tuple[list[tuple[Any, ...]], list[tuple[int, int, str, int]], list[tuple[Any, ...]]]:
    """Where each state chunk this rank needs comes from: ``(targets, sources, ops)``.

    ``layouts`` are one leaf's layout tables (unsealed bytes). ``chunk_of(fqn)`` is called once
    per FQN met (in order of first appearance) and returns ``None`` when this rank does not hold
    the parameter, else ``(shape, offsets, sizes)``: its global shape and its local chunk (every
    buffered state tensor of a parameter is shaped and chunked like it). Returns:

    * ``targets``: ``(fqn, key, dtype, shape, offsets, sizes)`` per ``(fqn, key)`` this rank
      needs, in order of first appearance (dtype and global shape as saved);
    * ``sources``: ``(layout index, bucket index, dtype, numel)`` of every bucket that holds part
      of a target, in order of first use (each to be read once);
    * ``ops``: ``(source, src_offset, src_sizes, src_start, target, dst_start, box)``: copy the
      box of sizes ``box`` at ``src_start`` of the saved chunk (``src_sizes`` elements row-major
      from element ``src_offset`` of the source bucket) to ``dst_start`` of the target's chunk.

    Chunks listed by several layouts with the same offsets and sizes (replicas) are used once.
    A target whose chunk the saved chunks do not cover exactly is a
    :class:`CheckpointMismatchError` naming leaf, FQN and key; a malformed table, or two tables
    that disagree on a tensor's dtype or shape, a :class:`CheckpointFormatError`.
    """
    if type(leaf) is not str:
        raise _type_error("the leaf as a str", leaf)
    if type(layouts) not in (list, tuple):
        raise _type_error("layouts as a list", layouts)
    chunks: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None] = {}
    targets: list[tuple[Any, ...]] = []
    target_of: dict[tuple[str, str], int] = {}
    seen_boxes: list[set[tuple[tuple[int, ...], tuple[int, ...]]]] = []
    covered: list[int] = []
    placed: list[list[_Box]] = []
    sources: list[tuple[int, int, str, int]] = []
    source_of: dict[tuple[int, int], int] = {}
    ops: list[tuple[Any, ...]] = []
    for li, data in enumerate(layouts):
        if type(data) is not bytes:
            raise _type_error("a layout table as bytes", data)
        for bi, dtype, numel, item in _walk(data, f"leaf {leaf!r} layout table {li}"):
            if item is None:
                continue
            (fqn, key, shape, offsets, sizes), start = item
            if fqn not in chunks:
                chunks[fqn] = _chunk(leaf, fqn, chunk_of(fqn))
            mine = chunks[fqn]
            if mine is None:
                continue
            ti = target_of.get((fqn, key))
            if ti is None:
                if mine[0] != shape:
                    raise CheckpointMismatchError(
                        f"leaf {leaf!r}: state {key!r} of {fqn!r} has shape {shape} in the checkpoint, the "
                        f"parameter {mine[0]}"
                    )
                ti = target_of[(fqn, key)] = len(targets)
                targets.append((fqn, key, dtype, shape, mine[1], mine[2]))
                seen_boxes.append(set())
                covered.append(0)
                placed.append([])
            else:
                first = targets[ti]
                if first[2] != dtype or first[3] != shape:
                    raise CheckpointFormatError(
                        f"leaf {leaf!r}: layout tables disagree on state {key!r} of {fqn!r} "
                        f"({first[2]} {first[3]} and {dtype} {shape})"
                    )
            if (offsets, sizes) in seen_boxes[ti]:
                continue
            seen_boxes[ti].add((offsets, sizes))
            lo = tuple(max(o, t) for o, t in zip(offsets, mine[1]))
            hi = tuple(min(o + s, t + u) for o, s, t, u in zip(offsets, sizes, mine[1], mine[2]))
            box = tuple(h - low for low, h in zip(lo, hi))
            if any(b <= 0 for b in box):
                continue
            si = source_of.get((li, bi))
            if si is None:
                si = source_of[(li, bi)] = len(sources)
                sources.append((li, bi, dtype, numel))
            src_start = tuple(low - o for low, o in zip(lo, offsets))
            dst_start = tuple(low - t for low, t in zip(lo, mine[1]))
            ops.append((si, start, sizes, src_start, ti, dst_start, box))
            covered[ti] += _volume(box)
            placed[ti].append((lo, hi, offsets, sizes))
    for ti, (fqn, key, _dtype, _shape, _offsets, sizes) in enumerate(targets):
        clash = _first_overlap(placed[ti])
        if clash is not None:
            a, b = clash
            raise CheckpointMismatchError(
                f"leaf {leaf!r}: state {key!r} of {fqn!r}: the checkpoint's layouts overlap (chunks at offsets {a[2]} "
                f"of sizes {a[3]} and at offsets {b[2]} of sizes {b[3]}): a damaged or edited checkpoint"
            )
        need = _volume(sizes)
        if covered[ti] != need:
            raise CheckpointMismatchError(
                f"leaf {leaf!r}: state {key!r} of {fqn!r}: the checkpoint's buffers cover {covered[ti]} of the "
                f"{need} elements of this rank's chunk (a buffer or layout table is missing from the checkpoint)"
            )
    return targets, sources, ops


_Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A saved chunk's part in a target: ``(lo, hi, saved offsets, saved sizes)`` (``lo``/``hi``: global bounds)."""


def _first_overlap(boxes: list[_Box]) -> tuple[_Box, _Box] | None:
    """The first two boxes that share an element, in the order of a sweep along dim 0 (boxes
    sorted by their lower bound there, stably), else ``None``. With the element count equal to
    the chunk's, no overlap means the boxes tile the chunk exactly (no gap). A 0-d target has at most
    one box (its only chunk, ``()`` at ``()``: replicas are used once), so every list of two has dims."""
    if len(boxes) < 2:
        return None
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    for n, i in enumerate(order):
        lo_a, hi_a = boxes[i][0], boxes[i][1]
        for j in order[n + 1 :]:
            lo_b, hi_b = boxes[j][0], boxes[j][1]
            if lo_b[0] >= hi_a[0]:
                break
            if all(la < hb and lb < ha for la, ha, lb, hb in zip(lo_a, hi_a, lo_b, hi_b)):
                return boxes[i], boxes[j]
    return None


def _chunk(leaf: str, fqn: str, value: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """``chunk_of``'s answer, checked: ``None`` or a chunk of a shape (three int tuples)."""
    if value is None:
        return None
    if type(value) is not tuple or len(value) != 3:
        raise _type_error(f"chunk_of({fqn!r}) as None or a (shape, offsets, sizes) tuple", value)
    shape = _dims(value[0], "a parameter shape")
    offsets, sizes = _dims(value[1], "chunk offsets"), _dims(value[2], "chunk sizes")
    problem = _check_chunk(f"chunk_of({fqn!r})", shape, offsets, sizes)
    if problem is not None:
        raise ValueError(problem)
    return shape, offsets, sizes
