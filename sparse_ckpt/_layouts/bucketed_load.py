"""``state_layout="buffers"``, load side, first half: which layout tables and buckets a load reads.

:func:`expand`: per leaf, the layout tables this rank needs (those a DCP load read already; when they
do not hold this rank's state, the ones the leaf's layout index points to, else all of the leaf's,
read through a :class:`BucketReader` while a DCP load streams them one at a time, see
:func:`items_a_load_reads`) and the core's scatter plan over them; :mod:`.bucketed_scatter` carries
the plan out (each needed bucket read once, its chunks becoming state tensors allocated like their
parameters, joining the decoded state as per-item entries would). Peak extra memory of a DCP load:
two buckets (DCP's read of one bucket item and the bucket it is copied into), whatever the
optimizer's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import _backend
from .._dist import world_and_rank
from .._format.bucket_checksums import split_checksums
from .._format.keys import BUFFERS_PREFIX, check_table, split_buffers_key, tag_has_rank
from .._format.layout_index import LayoutIndex, decode_index
from .._fqn import FqnMap
from ..errors import CheckpointFormatError, CheckpointMismatchError
from .bucketed import _Geometry, buffer_key, layout_key
from .bucketed_scatter import Plan, scatter

Layouts = list[tuple[str, bytes, "tuple[int, ...] | None"]]
"""``(rank tag, layout table, its buckets' CRC-32C or None)`` of each of a leaf's layouts (`open_layouts`)."""


@dataclass
class _LeafItems:
    layouts: dict[str, bytes] = field(default_factory=dict)
    """rank tag -> sealed layout bytes."""
    buffers: dict[tuple[str, int], Any] = field(default_factory=dict)
    """(rank tag, bucket) -> buffer tensor (read already)."""
    keys: dict[tuple[str, int], str] = field(default_factory=dict)
    """(rank tag, bucket) -> the buffer's key, for every buffer in the dict or readable."""
    readable: dict[str, str] = field(default_factory=dict)
    """Key of each layout table a :class:`BucketReader` can read -> its rank tag."""
    index: dict[str, Any] = field(default_factory=dict)
    """The leaf's layout index: key -> sealed bytes (read already) or ``None`` (readable)."""


class BucketReader:
    """Reads buffer and layout items that a DCP load did not plan (see :mod:`sparse_ckpt._dcp.stateful`):
    ``keys`` maps each buffers key of the optimizer dict to its flattened DCP key (all of the
    checkpoint's, read or not)."""

    def __init__(self, keys: Mapping[str, str], read: Callable[[list[str], Callable[[str, Any], None]], None]) -> None:
        self.keys = dict(keys)
        self._read = read

    def read(self, inner_keys: list[str], consume: Callable[[str, Any], None]) -> None:
        """Read ``inner_keys`` one at a time; ``consume(inner_key, value)`` gets each value."""
        back = {self.keys[k]: k for k in inner_keys}
        self._read(list(back), lambda dcp_key, value: consume(back[dcp_key], value))


def split_items(keys: Iterable[str], flat: Mapping[str, Any]) -> dict[str, _LeafItems]:
    """The layout tables and buffers among ``keys`` (keys of ``flat`` starting with
    :data:`~sparse_ckpt._format.keys.BUFFERS_PREFIX`), by leaf."""
    by_leaf: dict[str, _LeafItems] = {}
    for key in keys:
        leaf, kind, bucket, ranks = split_buffers_key(key[len(BUFFERS_PREFIX) :])
        items = by_leaf.setdefault(leaf, _LeafItems())
        if kind == "layout":
            items.layouts[ranks] = flat[key]
        elif kind == "index":
            items.index[key] = flat[key]
        else:
            items.buffers[(ranks, bucket)] = flat[key]  # type: ignore[index]
            items.keys[(ranks, bucket)] = key  # type: ignore[index]
    return by_leaf


def expand(
    buffer_keys: list[str],
    flat: Mapping[str, Any],
    fmap: FqnMap,
    reader: BucketReader | None,
    expected: Callable[[str, set[tuple[str, str]]], bool] | None = None,
) -> dict[str, dict[str, Any]]:
    """The buffered state this rank needs, ``canonical FQN -> {key path: tensor}`` (nested dicts
    for nested keys), allocated like the parameters and filled from the buffers.

    Layouts are those in ``flat`` (a DCP load reads this rank's own, or, for a leaf with none of
    its own, its layout index or all of its layouts); when they do not cover this rank's chunks
    (another mesh), or lack state this rank needs (``expected(leaf, found)``: whether a parameter
    of this rank misses recorded state besides the ``(FQN, key)`` pairs ``found``; another
    expert-parallel layout), and ``reader`` has more, the layouts the leaf's index points to for
    this rank's chunks are read (all of the leaf's without an index; see :func:`_plan`).
    Each needed buffer is taken from ``flat`` or read through ``reader`` (one at a time), checked
    against its layout (dtype, 1-D, length), scattered and dropped."""
    by_leaf = split_items(buffer_keys, flat)
    if reader is not None:
        for key in reader.keys:
            leaf, kind, bucket, ranks = split_buffers_key(key[len(BUFFERS_PREFIX) :])
            items = by_leaf.setdefault(leaf, _LeafItems())
            if kind == "layout":
                items.readable[key] = ranks
            elif kind == "index":
                items.index.setdefault(key, None)
            else:
                items.keys.setdefault((ranks, bucket), key)  # type: ignore[arg-type]
    geometry = _Geometry()
    out: dict[str, dict[str, Any]] = {}
    for leaf, items in by_leaf.items():
        _expand_leaf(leaf, items, fmap, reader, geometry, out, expected)
    return out


def _chunk_of(fmap: FqnMap, geometry: _Geometry) -> Callable[[str], Any]:
    def chunk_of(fqn: str) -> Any:
        canon = fmap.canonical.get(fqn)
        if canon is None:
            return None
        chunk = geometry.of(fmap.param_of[canon])
        if chunk is None:
            raise CheckpointMismatchError(
                f"parameter {fqn!r} is a DTensor with placements the buffers layout does not hold "
                "(only Shard and Replicate); load this checkpoint into a model sharded with those"
            )
        return chunk

    return chunk_of


def _expand_leaf(
    leaf: str,
    items: _LeafItems,
    fmap: FqnMap,
    reader: BucketReader | None,
    geometry: _Geometry,
    out: dict[str, dict[str, Any]],
    expected: Callable[[str, set[tuple[str, str]]], bool] | None,
) -> None:
    """One leaf: the layouts it plans from and the core's plan over them (:func:`_plan`), carried
    out by :func:`.bucketed_scatter.scatter` with the buckets the load holds already."""
    layouts, plan = _plan(leaf, items, fmap, reader, _chunk_of(fmap, geometry), expected)

    def key_of(si: int) -> str:
        li, bi, dtype, _numel = plan[1][si]
        return items.keys.get((layouts[li][0], bi)) or buffer_key(leaf, layouts[li][0], bi, dtype)

    held = [items.buffers.get((layouts[li][0], bi)) for li, bi, _dtype, _numel in plan[1]]
    scatter(leaf, plan, held, key_of, reader, fmap, out, [crcs for _ranks, _table, crcs in layouts])


def _plan(
    leaf: str,
    items: _LeafItems,
    fmap: FqnMap,
    reader: BucketReader | None,
    chunk_of: Callable[[str], Any],
    expected: Callable[[str, set[tuple[str, str]]], bool] | None,
) -> tuple[Layouts, Plan]:
    """The layout tables this rank plans from, and the core's scatter plan over them.

    The layouts read already (a DCP load's own) come first; when they do not hold all this rank
    needs (another mesh, another expert-parallel degree) and ``reader`` has more, the leaf's layout
    index (when the checkpoint has one) says which tables overlap this rank's chunks and only those
    are read; without an index, or when those are not enough either, all of the leaf's tables are.
    Tables that the index missed but that hold this rank's state mean a damaged index: refused."""
    core = _backend.core
    unread = {key: ranks for key, ranks in items.readable.items() if ranks not in items.layouts}

    def read(keys: list[str]) -> None:
        assert reader is not None
        reader.read(keys, lambda key, value: items.layouts.__setitem__(items.readable[key], value))
        for key in keys:
            unread.pop(key, None)

    def attempt() -> tuple[Layouts, Any, set[tuple[str, str]], bool]:
        """The plan over the layouts read so far, what it finds, and whether this rank's state is
        (also) elsewhere: ``expected`` says a parameter misses recorded state while more layouts
        are readable."""
        layouts = open_layouts(leaf, items.layouts)
        plan = core.plan_scatter(leaf, [table for _ranks, table, _crcs in layouts], chunk_of)
        found = {(fmap.canonical.get(t[0], t[0]), t[1]) for t in plan[0]}
        return layouts, plan, found, bool(unread) and expected is not None and expected(leaf, found)

    if items.layouts or not unread:
        try:
            layouts, plan, _found, elsewhere = attempt()
            if not elsewhere:
                return layouts, plan
        except CheckpointMismatchError:
            if not unread:
                raise
    index = _index(leaf, items, reader) if unread else None
    by_index: set[tuple[str, str]] | CheckpointMismatchError | None = None
    if index is not None:
        needs = ((fqn, chunk) for fqn in index.of if (chunk := chunk_of(fqn)) is not None)
        selected = index.tags_for(needs)
        read([key for key, ranks in unread.items() if ranks in selected])
        try:
            layouts, plan, by_index, elsewhere = attempt()
            if not elsewhere:
                return layouts, plan
        except CheckpointMismatchError as exc:
            by_index = exc
    if unread:
        read(list(unread))
    layouts, plan, found, _elsewhere = attempt()
    if index is not None:
        _check_index(leaf, index.key, by_index, layouts, plan, found)
    return layouts, plan


def _index(leaf: str, items: _LeafItems, reader: BucketReader | None) -> LayoutIndex | None:
    """The leaf's layout index, read (through ``reader`` unless the load read it already) and
    checked; ``None`` when the checkpoint has none (written before it, or by ranks that could not
    coordinate): then all of the leaf's layouts are read."""
    if len(items.index) > 1:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: the checkpoint has {len(items.index)} layout indexes ({sorted(items.index)})"
        )
    if not items.index:
        return None
    ((key, value),) = items.index.items()
    if value is None:
        if reader is None or key not in reader.keys:
            return None
        got: list[Any] = []
        reader.read([key], lambda _key, v: got.append(v))
        value = items.index[key] = got[0] if got else None
        if value is None:
            raise CheckpointFormatError(f"leaf {leaf!r}: layout index {key!r} could not be read (a damaged checkpoint)")
    _leaf, payload = check_table(BUFFERS_PREFIX, key[len(BUFFERS_PREFIX) :], value)
    return decode_index(leaf, key, payload)


def _check_index(
    leaf: str,
    key: str,
    by_index: set[tuple[str, str]] | CheckpointMismatchError | None,
    layouts: Layouts,
    plan: Plan,
    found: set[tuple[str, str]],
) -> None:
    """All of the leaf's layouts hold what this rank needs but the tables the index chose did not
    (``by_index``: what they held, or the core's refusal of them): the index is damaged. Refused,
    naming leaf, FQN, key and the table the index missed."""
    if by_index is None:
        return
    targets, sources, ops = plan
    if isinstance(by_index, CheckpointMismatchError):
        raise CheckpointFormatError(
            f"leaf {leaf!r}: the layout tables its layout index {key!r} points to do not hold this rank's state "
            f"({by_index}), though all of the leaf's tables do: the index is damaged or edited; refusing to load"
        ) from None
    missed = [t for t in found if t not in by_index]
    if not missed:
        return  # the state is missing from every table alike: the load's own checks name it
    fqn, skey = min(missed)
    tag = next((layouts[sources[op[0]][0]][0] for op in ops if tuple(targets[op[4]][:2]) == (fqn, skey)), None)
    where = "a layout table" if tag is None else f"layout table {layout_key(leaf, tag)!r}"
    raise CheckpointFormatError(
        f"leaf {leaf!r}: state {skey!r} of {fqn!r} is in {where}, which the leaf's layout index {key!r} does not "
        "point to for this rank: the index is damaged or edited; refusing to load"
    )


def open_layouts(leaf: str, layouts: Mapping[str, Any]) -> Layouts:
    """``(rank tag, layout table, bucket checksums)`` of each of a leaf's layouts (``rank tag ->
    sealed bytes``), each seal checked (`sparse_ckpt._format.bucket_checksums`: ``None`` for a
    layout written without checksums)."""
    out: Layouts = []
    for ranks, value in layouts.items():
        key = layout_key(leaf, ranks)
        _leaf, payload = check_table(BUFFERS_PREFIX, key[len(BUFFERS_PREFIX) :], value)
        table, crcs = split_checksums(leaf, key, payload)
        out.append((ranks, table, crcs))
    return out


def items_a_load_reads(buffered: Mapping[str, str], have_reader: bool) -> set[str]:
    """Which of a checkpoint's buffers-layout items (``buffered``: inner key -> DCP key) a DCP load
    plans itself: this rank's own layout tables; for a leaf without one of its own (another world
    size), its layout index, or all of its layouts when it has no index; without a reader for the
    rest (``have_reader``), this rank's own buckets too (all of a leaf's layouts and buckets when it
    has no layout of its own, and no index). The others are read through a :class:`BucketReader`
    (for a leaf with an index: the tables it points to)."""
    world, rank = world_and_rank()
    by_leaf: dict[str, list[tuple[str, str, bool]]] = {}
    for inner in buffered:
        leaf, kind, _bucket, ranks = split_buffers_key(inner[len(BUFFERS_PREFIX) :])
        by_leaf.setdefault(leaf, []).append((inner, kind, tag_has_rank(ranks, world, rank)))
    out: set[str] = set()
    for found in by_leaf.values():
        own = any(mine and kind == "layout" for _inner, kind, mine in found)
        indexed = have_reader and not own and any(kind == "index" for _inner, kind, _mine in found)
        for inner, kind, mine in found:
            if kind == "index":
                if indexed:
                    out.add(inner)
            elif indexed:
                continue
            elif (kind == "layout" or not have_reader) and (mine or not own):
                out.add(inner)
    return out
