"""``state_layout="buffers"``, load side: the buckets back into state tensors.

:func:`expand`: the layout tables of a leaf and this rank's parameters give the core's scatter
plan; each needed bucket is read once (from the dict, or through a :class:`BucketReader` while a
DCP load streams them one at a time, see :func:`items_a_load_reads`), its chunks are copied into
new state tensors allocated like their parameters, and these join the decoded state as per-item
entries would. Peak extra memory of a DCP load: two buckets (DCP's read of one bucket item and the
bucket it is copied into), whatever the optimizer's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _backend
from .._dcp.items import allocate_like
from .._dist import world_and_rank
from .._format.keys import BUFFERS_PREFIX, check_table, is_plain_part, key_parts, split_buffers_key, tag_has_rank
from .._format.layout_index import LayoutIndex, decode_index
from .._fqn import FqnMap
from ..errors import CheckpointFormatError, CheckpointMismatchError
from .bucketed import _Geometry, buffer_key, dtype_name, layout_key, torch_dtype


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
    chunk_of = _chunk_of(fmap, geometry)
    layouts, (targets, sources, ops) = _plan(leaf, items, fmap, reader, chunk_of, expected)
    count = [0] * len(targets)
    for op in ops:
        count[op[4]] += 1
    # A target that one whole saved chunk fills, on a CPU parameter, becomes a view of its buffer
    # (the buffer is this load's own tensor: no copy, no second allocation); others get a tensor
    # allocated like their parameter and are copied into, box by box.
    whole = [False] * len(targets)
    plain = [False] * len(targets)  # a target whose parameter is a plain tensor: its view needs no DTensor around it
    param_of: dict[str, tuple[bool, bool]] = {}  # per FQN: (state on the CPU, parameter not a DTensor)
    for op in ops:
        ti = op[4]
        if count[ti] == 1 and op[2] == op[6] == targets[ti][5]:
            fqn = targets[ti][0]
            kind = param_of.get(fqn)
            if kind is None:
                p = fmap.param_of[fmap.canonical[fqn]]
                kind = param_of[fqn] = (_on_cpu(p), not isinstance(p, DTensor))
            whole[ti], plain[ti] = kind
    made: list[Any] = [None if whole[ti] else _allocate(leaf, t, fmap) for ti, t in enumerate(targets)]
    dst = [None if m is None else _local(m) for m in made]
    by_source: list[list[tuple[Any, ...]]] = [[] for _ in sources]
    for op in ops:
        by_source[op[0]].append(op)

    def key_of(si: int) -> str:
        li, bi, dtype, _numel = sources[si]
        return items.keys.get((layouts[li][0], bi)) or buffer_key(leaf, layouts[li][0], bi, dtype)

    consumed = [False] * len(sources)

    def scatter(si: int, buf: Any) -> None:
        _li, _bi, dtype, numel = sources[si]
        _check_buffer(leaf, key_of(si), buf, dtype, numel)
        consumed[si] = True
        prod = math.prod
        run = by_source[si]
        k, n = 0, len(run)
        while k < n:
            _si, src_offset, src_sizes, src_start, ti, dst_start, box = run[k]
            if whole[ti]:  # this op and the next ones that fill whole targets of its shape from adjacent chunks:
                size = prod(src_sizes)  # one view of their span, unbound into a view per target
                end, m = src_offset + size, k + 1
                while m < n and whole[run[m][4]] and run[m][1] == end and run[m][2] == src_sizes:
                    end, m = end + size, m + 1
                views = buf[src_offset:end].view(m - k, *src_sizes).unbind(0)
                for op, view in zip(run[k:m], views):
                    t = op[4]
                    made[t] = view if plain[t] else _wrap(view, targets[t], fmap)
                k = m
                continue
            k += 1
            src = buf[src_offset : src_offset + prod(src_sizes)].view(src_sizes)
            target = dst[ti]
            if box != src_sizes:
                src = src[tuple(slice(a, a + b) for a, b in zip(src_start, box))]
            if box != targets[ti][5]:
                target = target[tuple(slice(a, a + b) for a, b in zip(dst_start, box))]
            target.copy_(src)

    wanted: dict[str, int] = {}
    for si, (li, bi, _dtype, _numel) in enumerate(sources):
        ranks = layouts[li][0]
        buf = items.buffers.get((ranks, bi))
        if buf is not None:
            scatter(si, buf)
            continue
        key = key_of(si)
        if reader is None or key not in reader.keys:
            fqn, skey = targets[by_source[si][0][4]][:2]
            raise CheckpointMismatchError(
                f"leaf {leaf!r}: buffer item {key!r}, which holds state {skey!r} of {fqn!r} (and maybe more), is "
                "missing from the checkpoint: an incomplete or damaged checkpoint"
            )
        wanted[key] = si
    if wanted:
        assert reader is not None
        reader.read(list(wanted), lambda key, value: scatter(wanted[key], value))
    _check_consumed(leaf, consumed, key_of, sources, by_source, targets)
    canonical = fmap.canonical
    flat_key: dict[str, bool] = {}  # key -> whether it is one plain part (the same few keys recur)
    for (fqn, key, *_rest), value in zip(targets, made):
        canon = canonical[fqn]
        state = out.get(canon)
        if state is None:
            state = out[canon] = {}
        simple = flat_key.get(key)
        if simple is None:
            simple = flat_key[key] = is_plain_part(key)
        if simple and key not in state:
            state[key] = value
        else:
            _put(state, key, value, leaf, canon)


def _plan(
    leaf: str,
    items: _LeafItems,
    fmap: FqnMap,
    reader: BucketReader | None,
    chunk_of: Callable[[str], Any],
    expected: Callable[[str, set[tuple[str, str]]], bool] | None,
) -> tuple[list[tuple[str, bytes]], tuple[list[tuple[Any, ...]], list[tuple[int, int, str, int]], list[tuple[Any, ...]]]]:
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

    def attempt() -> tuple[list[tuple[str, bytes]], Any, set[tuple[str, str]], bool]:
        """The plan over the layouts read so far, what it finds, and whether this rank's state is
        (also) elsewhere: ``expected`` says a parameter misses recorded state while more layouts
        are readable."""
        layouts = _open_layouts(leaf, items.layouts)
        plan = core.plan_scatter(leaf, [payload for _ranks, payload in layouts], chunk_of)
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
        raise CheckpointFormatError(f"leaf {leaf!r}: the checkpoint has {len(items.index)} layout indexes ({sorted(items.index)})")
    if not items.index:
        return None
    (key, value), = items.index.items()
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
    layouts: list[tuple[str, bytes]],
    plan: tuple[list[tuple[Any, ...]], list[tuple[int, int, str, int]], list[tuple[Any, ...]]],
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


def _check_consumed(
    leaf: str,
    consumed: list[bool],
    key_of: Callable[[int], str],
    sources: list[tuple[int, int, str, int]],
    by_source: list[list[tuple[Any, ...]]],
    targets: list[tuple[Any, ...]],
) -> None:
    """Every buffer the plan needs was read and scattered (DCP does not call a reader's consumer
    for an item the checkpoint's metadata says is empty, and the plan's copies must all run:
    together they cover every target element exactly once), else a `CheckpointFormatError`
    naming the buffer and the first state it holds."""
    for si, done in enumerate(consumed):
        if not done:
            fqn, skey = targets[by_source[si][0][4]][:2]
            _li, _bi, dtype, numel = sources[si]
            raise CheckpointFormatError(
                f"leaf {leaf!r}: buffer item {key_of(si)!r}, which holds state {skey!r} of {fqn!r} (and maybe more), "
                f"was not read: its layout table says {dtype} of {numel} elements, the checkpoint holds it empty or "
                "not at all (a damaged or edited checkpoint)"
            )


def _open_layouts(leaf: str, layouts: Mapping[str, Any]) -> list[tuple[str, bytes]]:
    out = []
    for ranks, value in layouts.items():
        key = layout_key(leaf, ranks)
        _leaf, payload = check_table(BUFFERS_PREFIX, key[len(BUFFERS_PREFIX) :], value)
        out.append((ranks, payload))
    return out


def _check_buffer(leaf: str, key: str, buf: Any, dtype: str, numel: int) -> None:
    if not isinstance(buf, torch.Tensor) or isinstance(buf, DTensor):
        raise CheckpointFormatError(f"leaf {leaf!r}: buffer item {key!r} is a {type(buf).__name__}, expected a tensor")
    if buf.ndim != 1 or dtype_name(buf.dtype) != dtype or buf.numel() != numel:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: buffer item {key!r} is a {dtype_name(buf.dtype)} tensor of shape {tuple(buf.shape)}, its "
            f"layout table says {dtype} of {numel} elements (truncated, or the layout disagrees with the data)"
        )


def _allocate(leaf: str, target: tuple[Any, ...], fmap: FqnMap) -> torch.Tensor:
    """A new state tensor for ``target`` (core ``plan_scatter``), allocated like its parameter."""
    fqn, key, dtype_name_, shape, _offsets, sizes = target
    t = allocate_like(shape, torch_dtype(leaf, fqn, key, dtype_name_), fmap.param_of[fmap.canonical[fqn]])
    if isinstance(t, DTensor) and tuple(t.to_local().shape) != tuple(sizes):  # pragma: no cover - the chunk is the parameter's
        raise CheckpointMismatchError(f"leaf {leaf!r}: state {key!r} of {fqn!r}: local shape differs from its chunk")
    return t


def _on_cpu(p: torch.Tensor) -> bool:
    """Whether the parameter's state lives on the CPU (a plain tensor there, or a DTensor on a CPU mesh)."""
    if isinstance(p, DTensor):
        return p.device_mesh.device_type == "cpu"
    return p.device.type in ("cpu", "meta")


def _wrap(local: torch.Tensor, target: tuple[Any, ...], fmap: FqnMap) -> torch.Tensor:
    """``local`` (a whole chunk) as the state tensor: itself, or a DTensor like the parameter."""
    p = fmap.param_of[fmap.canonical[target[0]]]
    if not isinstance(p, DTensor):
        return local
    shape = torch.Size(target[3])
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _put(state: dict[str, Any], key: str, value: Any, leaf: str, fqn: str) -> None:
    """``state[...][key parts] = value`` (key parts unescaped, nested dicts created)."""
    parts: list[Any] = [key] if is_plain_part(key) else key_parts(key)
    node = state
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if parts[-1] in node:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state {key!r} of {fqn!r} is both in a buffer and a per-item entry (corrupt or edited checkpoint)"
        )
    node[parts[-1]] = value


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
