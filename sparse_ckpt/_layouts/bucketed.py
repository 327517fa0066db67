"""``state_layout="buffers"`` (internally: the *bucketed* layout, not to be confused with a
module's buffers), save side: a rank's parameter-shaped optimizer state in a few 1-D items.

Per leaf, every state tensor shaped like its parameter (a plain tensor of the parameter's shape,
or a DTensor with the parameter's shape, mesh and ``Shard``/``Replicate`` placements) leaves the
per-item entries (:func:`collect`); its local chunk goes into a 1-D bucket of its dtype (at most
:data:`~sparse_ckpt._limits.ITEM_BYTES` each, :func:`fill`), and the core's layout table records
where (:mod:`sparse_ckpt._core_py.layout_codec`; keys and table format: docs/formats.md). Loading
is :mod:`.bucketed_load`, the tools' view :mod:`.bucketed_view`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _backend
from .._core_py.bucket_collect import plain_address
from .._format.bucket_checksums import tensor_crc
from .._format.keys import BUFFERS_PREFIX, STATE_PREFIX, buffer_tag, escape_part, is_plain_part, layout_tag
from .._host_memory import HostPool, empty_host, staging_host
from .._limits import ITEM_BYTES
from .._torch_internals import local_chunk
from ..errors import CheckpointFormatError

if TYPE_CHECKING:
    from .._save.worker import CaptureWorker

BUCKET_BYTES = ITEM_BYTES
"""Largest bucket (bytes) unless one state chunk is larger (it then gets a bucket of its own).
It bounds a DCP load's extra memory: two buckets."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (how layout tables and reports name dtypes)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(leaf: str, fqn: str, key: str, name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state {key!r} of {fqn!r} has an unknown dtype {name!r} in its layout"
        )
    return dtype


Chunk = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A parameter's ``(global shape, local chunk offsets, local chunk sizes)``."""


class _Geometry:
    """A parameter's :data:`Chunk`, computed once per (shape, mesh, placements)."""

    def __init__(self) -> None:
        self._cache: dict[Any, Chunk | None] = {}
        self._largest: dict[Any, int] = {}
        self.wholes: dict[torch.Size, tuple[Chunk, int]] = {}  # (read by collect's loop)

    def largest(self, p: torch.Tensor) -> int:
        """The element count of the parameter's largest chunk over all ranks (the same number on
        every rank: torch's ``Shard`` gives the first ranks along a mesh dimension ceil-sized
        chunks); a plain tensor's own count."""
        if not isinstance(p, DTensor):
            return p.numel()
        spec = (tuple(p.shape), p.device_mesh, p.placements)
        n = self._largest.get(spec)
        if n is None:
            dims = list(spec[0])
            for m, pl in enumerate(p.placements):
                if isinstance(pl, Shard):
                    dims[pl.dim] = -(-dims[pl.dim] // p.device_mesh.size(m))
            n = self._largest[spec] = math.prod(dims)
        return n

    def whole(self, shape: torch.Size) -> tuple[Chunk, int]:
        """A plain parameter's chunk (all of it) and element count: one tuple per shape, shared by
        every parameter of that shape (the core's ``encode_layout`` reads a chunk it met once)."""
        known = self.wholes.get(shape)
        if known is None:
            dims = tuple(shape)
            known = self.wholes[shape] = ((dims, (0,) * len(dims), dims), math.prod(dims))
        return known

    def of(self, p: torch.Tensor) -> Chunk | None:
        """``None`` for a DTensor whose placements are not all ``Shard``/``Replicate`` (its state
        stays per-item, as DCP shards it)."""
        if not isinstance(p, DTensor):
            return self.whole(p.shape)[0]
        spec = (tuple(p.shape), p.device_mesh, p.placements)
        if spec not in self._cache:
            if not all(type(pl) in (Shard, Replicate) for pl in p.placements):
                self._cache[spec] = None
            else:
                chunk = local_chunk(p)
                self._cache[spec] = (spec[0], tuple(chunk.offsets), tuple(chunk.sizes))
        return self._cache[spec]


def collect(
    leaf: str,
    state_fqn: Mapping[str, Any],
    items: dict[str, Any],
    param_of: Mapping[str, torch.Tensor],
    own_item_bytes: int | None = None,
    addresses: list[int | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[torch.Tensor]]:
    """Take the parameter-shaped state tensors out of ``items`` (the leaf's per-item entries):
    ``(entries, locals)`` -- the core's layout entries and each entry's local tensor. With an
    ``addresses`` list, each local's `sparse_ckpt._core_py.bucket_collect.plain_address` is appended to
    it, read while the pass visits the tensor (what `sparse_ckpt._save.fill_plan` checks).

    ``own_item_bytes`` (``state_layout="auto"``): a state tensor whose largest chunk over all
    ranks has at least that many bytes stays in ``items`` (decided from the global shape and
    placements, so every rank decides alike and DCP sees the tensor as one sharded item); ``None``
    buffers them all.

    A plain parameter's state (every state tensor of a model without DTensors) goes through the
    core's ``collect_plain`` (`sparse_ckpt._core_py.bucket_collect`): a state value's item key is
    looked up before any read of the tensor (a 0-d ``step`` has no item: no shape read), then the
    four reads that decide (shape, layout, ``is_meta``, dtype); names, item sizes and key parts are
    looked up once per dtype and key (:class:`_Names`, :class:`_Geometry`). A DTensor parameter's
    state goes through :func:`_collect_sharded`."""
    names = _Names(own_item_bytes)
    geometry = _Geometry()

    def sharded(fqn: str, p: DTensor, state: dict[Any, Any], entries: list[Any], local: list[torch.Tensor]) -> None:
        _collect_sharded(fqn, p, state, items, geometry, names, entries, local, addresses)

    with torch.no_grad():  # (a DTensor's to_local() is then its local tensor itself, the same object
        # from save to save, which `sparse_ckpt._save.fill_plan` relies on; with autograd a new view)
        return _backend.core.collect_plain(  # type: ignore[no-any-return]
            state_fqn,
            items,
            param_of,
            torch.Tensor,
            DTensor,
            torch.strided,
            names.parts,
            names.part,
            geometry.wholes,
            geometry.whole,
            names.spec,
            sharded,
            addresses,
        )


_MISSING = object()


class _Names:
    """What :func:`collect` looks up once: a dtype's name, item size and own-item limit; a state
    key's key part."""

    __slots__ = ("own_item_bytes", "parts", "specs")

    def __init__(self, own_item_bytes: int | None) -> None:
        self.own_item_bytes = own_item_bytes
        self.specs: dict[torch.dtype, tuple[str, int, float]] = {}
        self.parts: dict[str, str | None] = {}  # str state key -> its key part (the same few keys recur)

    def spec(self, dtype: torch.dtype, element_size: int) -> tuple[str, int, float]:
        """``(name, item size, limit)``: a state tensor of ``dtype`` whose largest chunk over all
        ranks has at least ``limit`` elements stays an item of its own (never without ``own_item_bytes``)."""
        known = self.specs.get(dtype)
        if known is None:
            own = self.own_item_bytes
            limit = -(-own // element_size) if own is not None else math.inf
            known = self.specs[dtype] = (dtype_name(dtype), element_size, limit)
        return known

    def part(self, key: Any) -> str | None:
        """The state key's key part (``None``: a key no item can have)."""
        if type(key) is not str:  # (not cached: 1 and True are one dict key but escape apart)
            return escape_part(key)
        part = self.parts.get(key, _MISSING)
        if part is _MISSING:
            part = self.parts[key] = key if is_plain_part(key) else escape_part(key)
        return part  # type: ignore[return-value]


def _collect_sharded(
    fqn: str,
    p: DTensor,
    state: dict[Any, Any],
    items: dict[str, Any],
    geometry: _Geometry,
    names: _Names,
    entries: list[tuple[Any, ...]],
    local: list[torch.Tensor],
    addresses: list[int | None] | None,
) -> None:
    """:func:`collect` for a DTensor parameter: its state DTensors of its shape, mesh and placements
    (their local chunks, where the placements are all ``Shard``/``Replicate``)."""
    chunk = None
    largest = -1  # elements of the parameter's largest chunk over all ranks (computed when first needed)
    prefix = f"{STATE_PREFIX}{fqn}."
    for key, v in state.items():
        if not isinstance(v, DTensor) or v.shape != p.shape:
            continue
        if v.placements != p.placements or v.device_mesh != p.device_mesh:
            continue
        t = v.to_local()
        if t.layout is not torch.strided:
            continue
        if chunk is None:
            chunk = geometry.of(p)
            if chunk is None:
                return  # its state stays per-item, as DCP shards it
        if tuple(t.shape) != chunk[2]:
            continue
        name, itemsize, limit = names.spec(t.dtype, t.element_size())
        if largest < 0:
            largest = geometry.largest(p)
        if largest >= limit:
            continue  # large enough to be an item of its own: no copy into a buffer
        part = names.part(key)
        if part is None or items.pop(prefix + part, _MISSING) is _MISSING:
            continue  # a 0-d parameter's state went into the scalar table
        entries.append((fqn, part, name, itemsize, *chunk))
        local.append(t)
        if addresses is not None:
            addresses.append(plain_address(t))


def fill(
    buckets: list[tuple[str, int, list[tuple[int, int]]]],
    local: list[torch.Tensor],
    snapshots: list[torch.Tensor] | None = None,
    pool: HostPool | None = None,
    sizes: Sequence[tuple[int, ...]] | None = None,
    worker: CaptureWorker | None = None,
) -> list[torch.Tensor]:
    """One CPU buffer per bucket of the core's ``encode_layout``, holding its chunks in order
    (concatenated on their device, so a GPU state costs one bucket of device memory at a time).
    Several chunks are copied; a bucket of one CPU chunk is that tensor, flattened (like a
    per-item entry, it is the live state: DCP writes or stages it before training goes on).
    ``snapshots``: the buffers this call allocated and filled (copies no live state aliases) are
    appended to it; ``pool``: where the CPU ones are allocated (`sparse_ckpt._host_memory.HostPool`);
    ``sizes``: each local tensor's shape where the caller knows it (the layout entries' chunk sizes),
    so the copy reads no shape back. ``worker`` (`sparse_ckpt._save.worker.CaptureWorker`): each
    bucket's CRC-32C is computed too (`CaptureWorker.crcs`), and a CPU bucket of at least
    :data:`SPLIT_BYTES` is filled and checksummed in two halves, the second on the worker's thread."""
    out = []
    for b, (_dtype, numel, members) in enumerate(buckets):
        chunks = [local[i] for i, _offset in members]
        device = chunks[0].device
        if len(chunks) == 1 and device.type == "cpu":  # one CPU chunk alone: the (flattened) state tensor itself
            buf = chunks[0].detach().reshape(-1)
            if worker is not None:
                _checksum(worker, b, buf)
        else:
            shapes = [sizes[i] for i, _offset in members] if sizes is not None else None
            if device.type == "cpu":  # a host buffer on huge pages where the OS offers them (page faults dominated)
                dtype = chunks[0].dtype
                buf = pool.take((numel,), dtype) if pool is not None else empty_host(numel, dtype)
                _stack_and_check(buf, chunks, shapes, members, worker, b)
            else:
                buf = _staged(numel, chunks, device)
                if worker is not None:
                    _checksum(worker, b, buf)
            if snapshots is not None:
                snapshots.append(buf)
        if buf.numel() != numel:  # pragma: no cover - the core's sizes are the chunks'
            raise AssertionError(f"bucket of {buf.numel()} elements, layout says {numel}")
        out.append(buf)
    return out


SPLIT_BYTES = 2 << 20
"""A CPU bucket of at least this many bytes is filled and checksummed in two halves on two threads
when the capture has a worker, and a bucket not copied here (a lone live chunk, a staged accelerator
bucket) is checksummed on the worker (below it, the thread hand-off costs more than it saves)."""


def _checksum(worker: CaptureWorker, bucket: int, buf: torch.Tensor) -> None:
    """The CRC-32C of bucket ``bucket`` (``buf``, already filled), on the worker's thread when it has at
    least :data:`SPLIT_BYTES`, else here."""
    crc = worker.submit(tensor_crc, buf) if buf.nbytes >= SPLIT_BYTES else tensor_crc(buf)
    worker.add_crc(bucket, crc, buf.nbytes)


def _stack_and_check(
    buf: torch.Tensor,
    chunks: list[torch.Tensor],
    shapes: Sequence[tuple[int, ...]] | None,
    members: list[tuple[int, int]],
    worker: CaptureWorker | None,
    bucket: int,
) -> None:
    """`stack_into` ``buf``; with ``worker``, the bucket's CRC-32C as well: a bucket of at least
    :data:`SPLIT_BYTES` and two chunks in two halves (split at a chunk near the middle, by the members'
    element offsets), the second copied and checksummed on the worker's thread while this one does the
    first (both copies and CRCs release the GIL); the two CRCs combine into the bucket's."""
    if worker is None:
        stack_into(buf, chunks, shapes)
        return
    if buf.nbytes < SPLIT_BYTES or len(chunks) < 2:
        stack_into(buf, chunks, shapes)
        _checksum(worker, bucket, buf)
        return
    h = _middle(members, buf.numel() // 2)
    cut = members[h][1]
    first, second = buf[:cut], buf[cut:]
    later = worker.submit(_stack_crc, second, chunks[h:], shapes[h:] if shapes is not None else None)
    stack_into(first, chunks[:h], shapes[:h] if shapes is not None else None)
    worker.add_crc(bucket, tensor_crc(first), first.nbytes)
    worker.add_crc(bucket, later, second.nbytes)


def _middle(members: list[tuple[int, int]], target: int) -> int:
    """The first member from the second on whose element offset is at least ``target`` (offsets grow;
    at most the last member), so both halves hold a chunk."""
    lo, hi = 1, len(members) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if members[mid][1] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _stack_crc(buf: torch.Tensor, chunks: list[torch.Tensor], shapes: Sequence[tuple[int, ...]] | None) -> int:
    stack_into(buf, chunks, shapes)
    return tensor_crc(buf)


def _staged(numel: int, chunks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Accelerator chunks, concatenated on their device, copied to a host (pinned where asked) buffer."""
    buf = staging_host(numel, chunks[0].dtype, device)
    buf.copy_(
        chunks[0].detach().reshape(-1) if len(chunks) == 1 else torch.cat([t.detach().reshape(-1) for t in chunks])
    )
    return buf


def stack_into(buf: torch.Tensor, chunks: list[torch.Tensor], shapes: Sequence[tuple[int, ...]] | None = None) -> None:
    """Copy ``chunks`` (CPU tensors of ``buf``'s dtype, in order) into the 1-D ``buf``, which holds
    exactly their elements. Each run of consecutive chunks of one shape is one ``torch.stack`` into
    the run's part of ``buf`` viewed as ``(n, *shape)``: no flattened view per chunk (the bucket of
    9 552 state tensors of 64x64 filled in 28.9 ms instead of 44 ms, bench/README.md *Scale*).
    ``shapes``: the chunks' shapes where the caller knows them (a run's shape is then often the same
    tuple object, compared by identity); the stacks run without autograd (``out=`` refuses chunks
    that require grad under it; the state's values are what is copied), so no chunk is read but by
    the copy."""
    if shapes is None:
        shapes = [t.shape for t in chunks]
    pos = start = 0
    shape: Any = None
    with torch.no_grad():
        for i, s in enumerate(shapes):
            if s is not shape and s != shape:
                if i > start:
                    pos = _stack_run(buf, pos, chunks[start:i], shape)
                start, shape = i, s
        if start < len(chunks):
            pos = _stack_run(buf, pos, chunks[start:], shape)
    if pos != buf.numel():  # pragma: no cover - the core's sizes are the chunks'
        raise AssertionError(f"chunks of {pos} elements for a bucket of {buf.numel()}")


def _stack_run(buf: torch.Tensor, pos: int, run: list[torch.Tensor], shape: tuple[int, ...]) -> int:
    end = pos + len(run) * math.prod(shape)
    torch.stack(run, out=buf[pos:end].view(len(run), *shape))
    return end


def layout_key(leaf: str, ranks: str) -> str:
    return f"{BUFFERS_PREFIX}{leaf}.{layout_tag(ranks)}"


def buffer_key(leaf: str, ranks: str, bucket: int, dtype: str | None = None) -> str:
    """The key of bucket ``bucket`` of the layout of ``ranks`` (see `sparse_ckpt._format.keys.buffer_tag`)."""
    return f"{BUFFERS_PREFIX}{leaf}.{buffer_tag(bucket, ranks, dtype)}"
