"""``state_layout="buffers"``: a rank's parameter-shaped optimizer state in a few 1-D items.

Save (:func:`collect`, :func:`fill`): per leaf, every state tensor shaped like its parameter (a
plain tensor of the parameter's shape, or a DTensor with the parameter's shape, mesh and
``Shard``/``Replicate`` placements) leaves the per-item entries; its local chunk goes into a 1-D
buffer of its dtype (buckets of at most :data:`BUCKET_BYTES`), and the core's layout table
records where (see :mod:`sparse_ckpt._core_py.buffers`, keys in :mod:`sparse_ckpt.keys`).

Load (:func:`expand`): the layout tables of a leaf and this rank's parameters give the core's
scatter plan; each needed buffer is read once (from the dict, or through a :class:`BufferReader`
while a DCP load streams them one at a time), its chunks are copied into new state tensors
allocated like their parameters, and these join the decoded state as per-item entries would.
Peak extra memory of a DCP load: two buckets (DCP's read of one buffer item and the buffer it is
copied into), whatever the optimizer's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import empty as dtensor_empty

from . import _backend
from .errors import CheckpointFormatError, CheckpointMismatchError
from .fqn import FqnMap
from .keys import (
    BUFFERS_PREFIX,
    STATE_PREFIX,
    buffer_tag,
    check_table,
    escape_part,
    is_plain_part,
    key_parts,
    layout_tag,
    split_buffers_key,
)

BUCKET_BYTES = 256 * 2**20
"""Largest buffer item (bytes) unless one state chunk is larger (it then gets a bucket of its own).
It bounds a DCP load's extra memory: two buckets."""

StateLayout = Literal["per_tensor", "buffers"]
STATE_LAYOUTS = ("per_tensor", "buffers")
DEFAULT_STATE_LAYOUT: StateLayout = "per_tensor"
"""The state layout of :class:`~sparse_ckpt.SparseOptimizerState` and ``MultiOptimizer`` when none is given."""


def check_state_layout(state_layout: object, format: str = "packed") -> StateLayout:
    """``state_layout`` validated: ``"per_tensor"`` or ``"buffers"`` (the latter only with
    ``format="packed"``: torch DSD's flat layout has one item per state value)."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if state_layout == "buffers" and format != "packed":
        raise ValueError("state_layout='buffers' needs format='packed' (the flat format is torch DSD's layout)")
    return state_layout  # type: ignore[return-value]


# --------------------------------------------------------------------------- save


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as layout tables and buffer keys write it (``float32``)."""
    return str(dtype).removeprefix("torch.")


_dtype_name = dtype_name


Chunk = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A parameter's ``(global shape, local chunk offsets, local chunk sizes)``."""


class _Geometry:
    """A parameter's :data:`Chunk`, computed once per (shape, mesh, placements)."""

    def __init__(self) -> None:
        self._cache: dict[Any, Chunk | None] = {}

    def of(self, p: torch.Tensor) -> Chunk | None:
        """``None`` for a DTensor whose placements are not all ``Shard``/``Replicate`` (its state
        stays per-item, as DCP shards it)."""
        if not isinstance(p, DTensor):
            shape = tuple(p.shape)
            return shape, (0,) * len(shape), shape
        spec = (tuple(p.shape), p.device_mesh, p.placements)
        if spec not in self._cache:
            if not all(type(pl) in (Shard, Replicate) for pl in p.placements):
                self._cache[spec] = None
            else:
                (chunk,) = p.__create_chunk_list__()
                self._cache[spec] = (spec[0], tuple(chunk.offsets), tuple(chunk.sizes))
        return self._cache[spec]


def collect(
    leaf: str, state_fqn: Mapping[str, Any], items: dict[str, Any], param_of: Mapping[str, torch.Tensor]
) -> tuple[list[tuple[Any, ...]], list[torch.Tensor]]:
    """Take the parameter-shaped state tensors out of ``items`` (the leaf's per-item entries):
    ``(entries, locals)`` -- the core's layout entries and each entry's local tensor."""
    entries: list[tuple[Any, ...]] = []
    local: list[torch.Tensor] = []
    geometry = _Geometry()
    names: dict[torch.dtype, tuple[str, int]] = {}
    missing = object()
    plain, strided = torch.Tensor, torch.strided
    for fqn, state in state_fqn.items():
        p = param_of.get(fqn)
        if p is None or type(state) is not dict:
            continue
        sharded = isinstance(p, DTensor)
        pshape = p.shape
        chunk = None
        for key, v in state.items():
            if type(v) is plain and not sharded:
                if v.shape != pshape or v.layout is not strided or v.is_meta:
                    continue
                t = v
            elif sharded and isinstance(v, DTensor):
                if v.shape != pshape or v.placements != p.placements or v.device_mesh != p.device_mesh:
                    continue
                t = v.to_local()
                if t.layout is not strided:
                    continue
            else:
                continue
            if chunk is None:
                chunk = geometry.of(p)
                if chunk is None:
                    break
            if tuple(t.shape) != chunk[2]:
                continue
            part = key if is_plain_part(key) else escape_part(key)
            if part is None or items.pop(f"{STATE_PREFIX}{fqn}.{part}", missing) is missing:
                continue  # a 0-d parameter's state went into the scalar table
            spec = names.get(t.dtype)
            if spec is None:
                spec = names[t.dtype] = (_dtype_name(t.dtype), t.element_size())
            entries.append((fqn, part, spec[0], spec[1], *chunk))
            local.append(t)
    return entries, local


def fill(buckets: list[tuple[str, int, list[tuple[int, int]]]], local: list[torch.Tensor]) -> list[torch.Tensor]:
    """One CPU buffer per bucket of the core's ``encode_layout``, holding its chunks in order
    (concatenated on their device, so a GPU state costs one bucket of device memory at a time).
    Several chunks are copied; a bucket of one CPU chunk is that tensor, flattened (like a
    per-item entry, it is the live state: DCP writes or stages it before training goes on)."""
    out = []
    for _dtype, numel, members in buckets:
        parts = [local[i].detach().reshape(-1) for i, _offset in members]
        # One chunk alone: the (flattened) state tensor itself on the CPU, as per-item entries are.
        buf = (torch.cat(parts) if len(parts) > 1 else parts[0]).to("cpu")
        if buf.numel() != numel:  # pragma: no cover - the core's sizes are the chunks'
            raise AssertionError(f"bucket of {buf.numel()} elements, layout says {numel}")
        out.append(buf)
    return out


# --------------------------------------------------------------------------- load


@dataclass
class _LeafItems:
    layouts: dict[str, bytes] = field(default_factory=dict)
    """rank tag -> sealed layout bytes."""
    buffers: dict[tuple[str, int], Any] = field(default_factory=dict)
    """(rank tag, bucket) -> buffer tensor (read already)."""
    keys: dict[tuple[str, int], str] = field(default_factory=dict)
    """(rank tag, bucket) -> the buffer's key, for every buffer in the dict or readable."""
    readable: dict[str, str] = field(default_factory=dict)
    """Key of each layout table a :class:`BufferReader` can read -> its rank tag."""


class BufferReader:
    """Reads buffer and layout items that a DCP load did not plan (see :mod:`sparse_ckpt.dcp`):
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
    :data:`~sparse_ckpt.keys.BUFFERS_PREFIX`), by leaf."""
    by_leaf: dict[str, _LeafItems] = {}
    for key in keys:
        leaf, kind, bucket, ranks = split_buffers_key(key[len(BUFFERS_PREFIX) :])
        items = by_leaf.setdefault(leaf, _LeafItems())
        if kind == "layout":
            items.layouts[ranks] = flat[key]
        else:
            items.buffers[(ranks, bucket)] = flat[key]  # type: ignore[index]
            items.keys[(ranks, bucket)] = key  # type: ignore[index]
    return by_leaf


def layout_key(leaf: str, ranks: str) -> str:
    return f"{BUFFERS_PREFIX}{leaf}.{layout_tag(ranks)}"


def buffer_key(leaf: str, ranks: str, bucket: int, dtype: str | None = None) -> str:
    """The key of bucket ``bucket`` of the layout of ``ranks`` (see :func:`~sparse_ckpt.keys.buffer_tag`)."""
    return f"{BUFFERS_PREFIX}{leaf}.{buffer_tag(bucket, ranks, dtype)}"


def expand(
    buffer_keys: list[str],
    flat: Mapping[str, Any],
    fmap: FqnMap,
    reader: BufferReader | None,
    expected: Callable[[str, set[tuple[str, str]]], bool] | None = None,
) -> dict[str, dict[str, Any]]:
    """The buffered state this rank needs, ``canonical FQN -> {key path: tensor}`` (nested dicts
    for nested keys), allocated like the parameters and filled from the buffers.

    Layouts are those in ``flat`` (a DCP load reads this rank's own, or all of a leaf's when it
    has none); when they do not cover this rank's chunks (another mesh), or lack state this rank
    needs (``expected(leaf, found)``: whether a parameter of this rank misses recorded state
    besides the ``(FQN, key)`` pairs ``found``; another expert-parallel layout), and ``reader``
    has more, all of the leaf's layouts are read.
    Each needed buffer is taken from ``flat`` or read through ``reader`` (one at a time), checked
    against its layout (dtype, 1-D, length), scattered and dropped."""
    by_leaf = split_items(buffer_keys, flat)
    if reader is not None:
        for key in reader.keys:
            leaf, kind, bucket, ranks = split_buffers_key(key[len(BUFFERS_PREFIX) :])
            items = by_leaf.setdefault(leaf, _LeafItems())
            if kind == "layout":
                items.readable[key] = ranks
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
    reader: BufferReader | None,
    geometry: _Geometry,
    out: dict[str, dict[str, Any]],
    expected: Callable[[str, set[tuple[str, str]]], bool] | None,
) -> None:
    core = _backend.core
    chunk_of = _chunk_of(fmap, geometry)
    unread = [key for key, ranks in items.readable.items() if ranks not in items.layouts]

    def read_layouts() -> None:
        assert reader is not None
        reader.read(unread, lambda key, value: items.layouts.__setitem__(items.readable[key], value))
        unread.clear()

    if not items.layouts and unread:
        read_layouts()
    layouts = _open_layouts(leaf, items.layouts)
    try:
        targets, sources, ops = core.plan_scatter(leaf, [payload for _ranks, payload in layouts], chunk_of)
        if unread and expected is not None:
            found = {(fmap.canonical.get(t[0], t[0]), t[1]) for t in targets}
            if expected(leaf, found):
                raise CheckpointMismatchError("state of this rank is in other ranks' layouts")
    except CheckpointMismatchError:
        if not unread:
            raise
        read_layouts()  # this rank's own layout does not hold all it needs: another mesh or EP degree
        layouts = _open_layouts(leaf, items.layouts)
        targets, sources, ops = core.plan_scatter(leaf, [payload for _ranks, payload in layouts], chunk_of)
    count = [0] * len(targets)
    for op in ops:
        count[op[4]] += 1
    # A target that one whole saved chunk fills, on a CPU parameter, becomes a view of its buffer
    # (the buffer is this load's own tensor: no copy, no second allocation); others get a tensor
    # allocated like their parameter and are copied into, box by box.
    whole = [False] * len(targets)
    for op in ops:
        ti = op[4]
        whole[ti] = count[ti] == 1 and op[2] == op[6] == targets[ti][5] and _on_cpu(fmap, targets[ti][0])
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
        for _si, src_offset, src_sizes, src_start, ti, dst_start, box in by_source[si]:
            n = 1
            for d in src_sizes:
                n *= d
            src = buf[src_offset : src_offset + n].view(src_sizes)
            if whole[ti]:
                made[ti] = _wrap(src, targets[ti], fmap)
                continue
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
    for (fqn, key, *_rest), value in zip(targets, made):
        canon = fmap.canonical[fqn]
        _put(out.setdefault(canon, {}), key, value, leaf, canon)


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
    together they cover every target element exactly once), else a :class:`CheckpointFormatError`
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
    if buf.ndim != 1 or _dtype_name(buf.dtype) != dtype or buf.numel() != numel:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: buffer item {key!r} is a {_dtype_name(buf.dtype)} tensor of shape {tuple(buf.shape)}, its "
            f"layout table says {dtype} of {numel} elements (truncated, or the layout disagrees with the data)"
        )


def _torch_dtype(leaf: str, fqn: str, key: str, name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"leaf {leaf!r}: state {key!r} of {fqn!r} has an unknown dtype {name!r} in its layout")
    return dtype


def _allocate(leaf: str, target: tuple[Any, ...], fmap: FqnMap) -> torch.Tensor:
    """A new state tensor for ``target`` (core ``plan_scatter``), allocated like its parameter."""
    fqn, key, dtype_name, shape, _offsets, sizes = target
    dtype = _torch_dtype(leaf, fqn, key, dtype_name)
    p = fmap.param_of[fmap.canonical[fqn]]
    if isinstance(p, DTensor):
        t = dtensor_empty(shape, dtype=dtype, device_mesh=p.device_mesh, placements=p.placements)
        if tuple(t.to_local().shape) != tuple(sizes):  # pragma: no cover - the chunk is the parameter's
            raise CheckpointMismatchError(f"leaf {leaf!r}: state {key!r} of {fqn!r}: local shape differs from its chunk")
        return t
    return torch.empty(shape, dtype=dtype, device="cpu" if p.device.type == "meta" else p.device)


# --------------------------------------------------------------------------- checkpoint tools


def _layouts_by_key(keys: Iterable[str], values: Mapping[str, Any]) -> Iterator[tuple[str, str, bytes]]:
    """``(key, leaf, unsealed layout)`` of every layout table among ``keys``, each checked as it is reached."""
    for key in keys:
        if key.rpartition(".")[2].startswith("L"):
            leaf, payload = check_table(BUFFERS_PREFIX, key[len(BUFFERS_PREFIX) :], values[key])
            yield key, leaf, payload


def layout_view(keys: Iterable[str], values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The buffered state as the checkpoint tools see per-item state: ``FQN -> {key: metadata}``
    (a ``TensorStorageMetadata`` with the saved dtype and global shape; nested keys nest), from
    the layout tables among ``keys``. Each layout's buffers must be there with its dtype and
    length (``values``: DCP metadata or tensors), and a leaf's layouts must cover each tensor
    exactly once (``plan_scatter`` of whole tensors), else a :class:`CheckpointFormatError` or
    :class:`CheckpointMismatchError` says which."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    core = _backend.core
    out: dict[str, dict[str, Any]] = {}
    by_leaf: dict[str, list[bytes]] = {}
    for key, leaf, payload in _layouts_by_key(keys, values):
        by_leaf.setdefault(leaf, []).append(payload)
        ranks = split_buffers_key(key[len(BUFFERS_PREFIX) :])[3]
        for bi, (dtype, numel, entries) in enumerate(core.decode_layout(leaf, payload)):
            bkey = buffer_key(leaf, ranks, bi, dtype)
            if bkey not in values:
                bkey = buffer_key(leaf, ranks, bi)  # written before the dtype was part of the key
            if bkey not in values:
                raise CheckpointMismatchError(f"leaf {leaf!r}: buffer item {bkey!r} of layout {key!r} is missing")
            found = values[bkey]
            size = tuple(found.size) if isinstance(found, TensorStorageMetadata) else tuple(getattr(found, "shape", ()))
            got = found.properties.dtype if isinstance(found, TensorStorageMetadata) else getattr(found, "dtype", None)
            if size != (numel,) or got is None or _dtype_name(got) != dtype:
                raise CheckpointFormatError(
                    f"leaf {leaf!r}: buffer item {bkey!r} is {got} of shape {size}, its layout table says {dtype} of "
                    f"{numel} elements"
                )
            torch_dtype = _torch_dtype(leaf, "?", "?", dtype)
            for fqn, skey, shape, _offsets, _sizes in entries:
                md = TensorStorageMetadata(TensorProperties(dtype=torch_dtype), torch.Size(shape), [])
                node = out.setdefault(fqn, {})
                parts: list[Any] = key_parts(skey)
                for part in parts[:-1]:
                    node = node.setdefault(part, {})
                node.setdefault(parts[-1], md)
    for leaf, payloads in by_leaf.items():  # together, the layouts hold every tensor exactly once
        core.plan_scatter(leaf, payloads, _whole(payloads, leaf))
    return out


def _whole(payloads: list[bytes], leaf: str) -> Callable[[str], Chunk]:
    """``chunk_of`` of a reader that wants every tensor whole (its shape as the first layout gives it)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for payload in payloads:
        for _dtype, _numel, entries in _backend.core.decode_layout(leaf, payload):
            for fqn, _key, shape, _offsets, _sizes in entries:
                shapes.setdefault(fqn, shape)
    return lambda fqn: (shapes[fqn], (0,) * len(shapes[fqn]), shapes[fqn])


def full_state(keys: Iterable[str], values: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The buffered state as full (unsharded) CPU tensors, ``FQN -> {key path: tensor}``: every
    chunk of every layout among ``keys`` scattered from its buffer in ``values`` (all of them in
    memory: what a single-process tool such as ``convert`` reads)."""
    keys = list(keys)
    shapes: dict[str, tuple[int, ...]] = {}
    for _key, leaf, payload in _layouts_by_key(keys, values):
        for _dtype, _numel, entries in _backend.core.decode_layout(leaf, payload):
            for fqn, _key, shape, _offsets, _sizes in entries:
                shapes.setdefault(fqn, shape)
    whole = FqnMap(canonical={f: f for f in shapes}, param_of={f: torch.empty(s, device="meta") for f, s in shapes.items()})
    return expand(keys, values, whole, None)


def _on_cpu(fmap: FqnMap, fqn: str) -> bool:
    """Whether the parameter's state lives on the CPU (a plain tensor there, or a DTensor on a CPU mesh)."""
    p = fmap.param_of[fmap.canonical[fqn]]
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
    parts: list[Any] = key_parts(key)
    node = state
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if parts[-1] in node:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state {key!r} of {fqn!r} is both in a buffer and a per-item entry (corrupt or edited checkpoint)"
        )
    node[parts[-1]] = value
