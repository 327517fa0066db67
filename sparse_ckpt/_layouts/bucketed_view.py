"""``state_layout="buffers"``, the checkpoint tools' view: buffered state as the tools see
per-item state (:func:`layout_view`, DCP metadata only), as full CPU tensors (:func:`full_state`,
all at once), or as full CPU tensors a few at a time (:class:`FullTensors`, the export's bounded read)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import _backend
from .._format.bucket_checksums import split_checksums
from .._format.keys import BUFFERS_PREFIX, check_table, key_parts, split_buffers_key
from .._format.layout_index import check_index, decode_index
from .._fqn import FqnMap
from ..errors import CheckpointFormatError, CheckpointMismatchError, SparseCheckpointError
from .bucketed import Chunk, buffer_key, dtype_name, torch_dtype
from .bucketed_load import Layouts, expand, open_layouts, split_items
from .bucketed_scatter import check_buffer, check_consumed

ReadBuffers = Callable[[list[str], Callable[[str, Any], None]], None]
"""``read(keys, consume)``: read the buffer items ``keys`` one at a time, ``consume(key, tensor)`` each
(an item the checkpoint holds without data is not handed over, as DCP hands over none)."""


def _layouts_by_key(keys: Iterable[str], values: Mapping[str, Any]) -> Iterator[tuple[str, str, bytes]]:
    """``(key, leaf, layout table)`` of every layout table among ``keys``, each checked as it is reached."""
    for key in keys:
        if key.rpartition(".")[2].startswith("L"):
            leaf, payload = check_table(BUFFERS_PREFIX, key[len(BUFFERS_PREFIX) :], values[key])
            yield key, leaf, split_checksums(leaf, key, payload)[0]


def layout_view(keys: Iterable[str], values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The buffered state as the checkpoint tools see per-item state: ``FQN -> {key: metadata}``
    (a ``TensorStorageMetadata`` with the saved dtype and global shape; nested keys nest), from
    the layout tables among ``keys``. Each layout's buffers must be there with its dtype and
    length (``values``: DCP metadata or tensors), and a leaf's layouts must cover each tensor
    exactly once (``plan_scatter`` of whole tensors), and a leaf's layout index must agree with its
    layouts, else a :class:`CheckpointFormatError` or :class:`CheckpointMismatchError` says which."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    core = _backend.core
    out: dict[str, dict[str, Any]] = {}
    by_leaf: dict[str, list[bytes]] = {}
    shapes_by_leaf: dict[str, dict[str, tuple[int, ...]]] = {}
    decoded_by_leaf: dict[str, dict[str, Any]] = {}
    keys = list(keys)
    for key, leaf, payload in _layouts_by_key(keys, values):
        by_leaf.setdefault(leaf, []).append(payload)
        ranks = split_buffers_key(key[len(BUFFERS_PREFIX) :])[3]
        decoded = core.decode_layout(leaf, payload)
        decoded_by_leaf.setdefault(leaf, {})[ranks] = [e for _dtype, _numel, entries in decoded for e in entries]
        _first_shapes(decoded, shapes_by_leaf.setdefault(leaf, {}))
        for bi, (dtype, numel, entries) in enumerate(decoded):
            bkey = buffer_key(leaf, ranks, bi, dtype)
            if bkey not in values:
                if buffer_key(leaf, ranks, bi) not in values:  # written before the dtype was part of the key
                    raise CheckpointMismatchError(f"leaf {leaf!r}: buffer item {bkey!r} of layout {key!r} is missing")
                bkey = buffer_key(leaf, ranks, bi)
            found = values[bkey]
            size = tuple(found.size) if isinstance(found, TensorStorageMetadata) else tuple(getattr(found, "shape", ()))
            got = found.properties.dtype if isinstance(found, TensorStorageMetadata) else getattr(found, "dtype", None)
            if size != (numel,) or got is None or dtype_name(got) != dtype:
                raise CheckpointFormatError(
                    f"leaf {leaf!r}: buffer item {bkey!r} is {got} of shape {size}, its layout table says {dtype} of "
                    f"{numel} elements"
                )
            saved_dtype = torch_dtype(leaf, "?", "?", dtype)
            for fqn, skey, shape, _offsets, _sizes in entries:
                md = TensorStorageMetadata(TensorProperties(dtype=saved_dtype), torch.Size(shape), [])
                node = out.setdefault(fqn, {})
                parts: list[Any] = key_parts(skey)
                for part in parts[:-1]:
                    node = node.setdefault(part, {})
                node.setdefault(parts[-1], md)
    for leaf, payloads in by_leaf.items():  # together, the layouts hold every tensor exactly once
        core.plan_scatter(leaf, payloads, _whole(shapes_by_leaf[leaf]))
    _check_indexes(keys, values, decoded_by_leaf)
    return out


def checksum_failures(
    keys: Iterable[str], values: Mapping[str, Any], crc_of: Callable[[str], int | None]
) -> list[tuple[str, str]]:
    """``(bucket key, problem)`` for each bucket of the layouts among ``keys`` (``values``: the
    layouts' sealed bytes; buckets are only looked up by key) whose bytes fail the CRC-32C its layout
    records (`sparse_ckpt._format.bucket_checksums`); ``crc_of(bucket key)``: the CRC-32C of the
    bucket as read (``None``: not read). Layouts written without checksums, and layouts that do not
    decode (refused by the checks that read them), are skipped."""
    out: list[tuple[str, str]] = []
    for key in keys:
        if not key.rpartition(".")[2].startswith("L") or not isinstance(values.get(key), bytes):
            continue
        try:
            leaf, payload = check_table(BUFFERS_PREFIX, key[len(BUFFERS_PREFIX) :], values[key])
            table, crcs = split_checksums(leaf, key, payload)
            decoded = _backend.core.decode_layout(leaf, table) if crcs is not None else []
        except SparseCheckpointError:
            continue
        ranks = split_buffers_key(key[len(BUFFERS_PREFIX) :])[3]
        for bi, (dtype, _numel, _entries) in enumerate(decoded):
            bkey = buffer_key(leaf, ranks, bi, dtype)
            if bkey not in values:
                bkey = buffer_key(leaf, ranks, bi)
            got = crc_of(bkey)
            if got is not None and (crcs is None or bi >= len(crcs) or got != crcs[bi]):
                want = f"{crcs[bi]:08x}" if crcs is not None and bi < len(crcs) else "none"
                out.append(
                    (
                        bkey,
                        (
                            f"leaf {leaf!r}: bucket {bkey!r} fails its CRC-32C check (read {got:08x}, "
                            f"its layout {key!r} records {want})"
                        ),
                    )
                )
    return out


def _check_indexes(keys: Iterable[str], values: Mapping[str, Any], tables: Mapping[str, dict[str, Any]]) -> None:
    """Each layout index among ``keys`` agrees with its leaf's layout tables (``tables``: leaf ->
    rank tag -> decoded entries), else a :class:`CheckpointFormatError`
    (`sparse_ckpt._format.layout_index.check_index`)."""
    for key in keys:
        leaf, kind, _bucket, _ranks = split_buffers_key(key[len(BUFFERS_PREFIX) :])
        if kind != "index":
            continue
        _leaf, payload = check_table(BUFFERS_PREFIX, key[len(BUFFERS_PREFIX) :], values[key])
        check_index(decode_index(leaf, key, payload), tables.get(leaf, {}))


def _first_shapes(decoded: Iterable[tuple[str, int, Any]], shapes: dict[str, tuple[int, ...]]) -> None:
    """Add to ``shapes`` each FQN's global shape as the first decoded layout table listing it gives it."""
    for _dtype, _numel, entries in decoded:
        for fqn, _key, shape, _offsets, _sizes in entries:
            shapes.setdefault(fqn, shape)


def _whole(shapes: Mapping[str, tuple[int, ...]]) -> Callable[[str], Chunk]:
    """``chunk_of`` of a reader that wants every tensor whole (``shapes``: see :func:`_first_shapes`)."""
    return lambda fqn: (shapes[fqn], (0,) * len(shapes[fqn]), shapes[fqn])


def full_state(keys: Iterable[str], values: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The buffered state as full (unsharded) CPU tensors, ``FQN -> {key path: tensor}``: every
    chunk of every layout among ``keys`` scattered from its buffer in ``values`` (all of them in
    memory: what a single-process tool such as ``convert`` reads)."""
    keys = list(keys)
    shapes: dict[str, tuple[int, ...]] = {}
    for _key, leaf, payload in _layouts_by_key(keys, values):
        _first_shapes(_backend.core.decode_layout(leaf, payload), shapes)
    whole = FqnMap(
        canonical={f: f for f in shapes}, param_of={f: torch.empty(s, device="meta") for f, s in shapes.items()}
    )
    return expand(keys, values, whole, None)


class FullTensors:
    """The buffered state among ``keys`` as full (unsharded) CPU tensors, read a few at a time.

    Planned once (the core's ``plan_scatter`` over each leaf's layout tables, every tensor whole:
    the plan :func:`layout_view` checks); :meth:`read` then fills the tensors asked for, reading
    each bucket that holds part of them once, copying its chunks and dropping it. So a read holds
    the tensors it returns plus one bucket at a time (DCP's read of it), and a caller that reads
    the tensors in batches of ``B`` bytes holds ``B`` plus one bucket. ``values`` holds the layout
    tables (sealed ``bytes``); buffers are only looked up by key (DCP metadata will do).

    :attr:`tensors` lists ``(fqn, state key, dtype, global shape)`` (the key escaped as in
    ``state.{fqn}.{key}``), leaf by leaf in layout order; :attr:`buffer_reads` and
    :attr:`buffer_bytes` count what :meth:`read` has read.
    """

    def __init__(self, keys: Iterable[str], values: Mapping[str, Any]) -> None:
        keys = list(keys)
        shapes: dict[str, dict[str, tuple[int, ...]]] = {}
        for _key, leaf, payload in _layouts_by_key(keys, values):
            _first_shapes(_backend.core.decode_layout(leaf, payload), shapes.setdefault(leaf, {}))
        self.tensors: list[tuple[str, str, torch.dtype, tuple[int, ...]]] = []
        self._where: list[tuple[_LeafPlan, int]] = []
        for leaf, items in split_items(keys, values).items():
            plan = _LeafPlan(leaf, open_layouts(leaf, items.layouts), items.keys, shapes.get(leaf, {}))
            for ti, (fqn, key, dtype, shape, _offsets, _sizes) in enumerate(plan.targets):
                self.tensors.append((fqn, key, torch_dtype(leaf, fqn, key, dtype), tuple(shape)))
                self._where.append((plan, ti))
        self.buffer_reads = 0
        self.buffer_bytes = 0

    def read(self, which: Sequence[int], read: ReadBuffers) -> list[torch.Tensor]:
        """The full tensors ``self.tensors[i]`` for ``i`` in ``which``, in that order: each needed
        bucket read once through ``read``, checked against its layout (dtype, 1-D, length) and
        scattered; a bucket the plan needs that was not handed over is a `CheckpointFormatError`
        (the load's checks, `sparse_ckpt._layouts.bucketed_scatter`)."""
        out: dict[int, torch.Tensor] = {}
        by_plan: dict[int, tuple[_LeafPlan, dict[int, int]]] = {}
        for i in which:
            plan, ti = self._where[i]
            by_plan.setdefault(id(plan), (plan, {}))[1][ti] = i
        for plan, wanted in by_plan.values():
            made = self._read_leaf(plan, {ti: self.tensors[i][2] for ti, i in wanted.items()}, read)
            out.update({wanted[ti]: t for ti, t in made.items()})
        return [out[i] for i in which]

    def _read_leaf(
        self, plan: _LeafPlan, wanted: Mapping[int, torch.dtype], read: ReadBuffers
    ) -> dict[int, torch.Tensor]:
        """Targets ``wanted`` (index -> dtype) of one leaf's plan, filled from the buckets holding them."""
        made = {ti: torch.empty(plan.targets[ti][3], dtype=dtype) for ti, dtype in wanted.items()}
        needed = sorted({op[0] for ti in wanted for op in plan.ops_of[ti]})
        source_of = {plan.key_of(si): si for si in needed}
        consumed = [True] * len(plan.sources)
        for si in needed:
            consumed[si] = False

        def scatter(key: str, buf: Any) -> None:
            si = source_of[key]
            li, bi, dtype, numel = plan.sources[si]
            check_buffer(plan.leaf, key, buf, dtype, numel, bi, plan.checksums[li])
            consumed[si] = True
            self.buffer_reads += 1
            self.buffer_bytes += buf.numel() * buf.element_size()
            for op in plan.by_source[si]:
                target = made.get(op[4])
                if target is not None:
                    _copy_box(buf, op, target)

        read(list(source_of), scatter)
        check_consumed(plan.leaf, consumed, plan.key_of, plan.sources, plan.by_source, plan.targets)
        return made


class _LeafPlan:
    """One leaf's scatter plan of whole tensors: targets, sources (buckets), ops by source and by target."""

    def __init__(
        self,
        leaf: str,
        layouts: Layouts,
        keys: Mapping[tuple[str, int], str],
        shapes: Mapping[str, tuple[int, ...]],
    ) -> None:
        self.leaf, self._layouts, self._keys = leaf, layouts, keys
        self.targets, self.sources, ops = _backend.core.plan_scatter(leaf, [t for _r, t, _c in layouts], _whole(shapes))
        self.checksums = [crcs for _r, _t, crcs in layouts]
        self.by_source: list[list[tuple[Any, ...]]] = [[] for _ in self.sources]
        self.ops_of: list[list[tuple[Any, ...]]] = [[] for _ in self.targets]
        for op in ops:
            self.by_source[op[0]].append(op)
            self.ops_of[op[4]].append(op)

    def key_of(self, si: int) -> str:
        """The item key of source ``si`` (as the checkpoint names it: with or without its dtype)."""
        li, bi, dtype, _numel = self.sources[si]
        ranks = self._layouts[li][0]
        return self._keys.get((ranks, bi)) or buffer_key(self.leaf, ranks, bi, dtype)


def _copy_box(buf: torch.Tensor, op: tuple[Any, ...], target: torch.Tensor) -> None:
    """Run one ``plan_scatter`` op into a whole target tensor (its chunk is the tensor)."""
    _si, src_offset, src_sizes, src_start, _ti, dst_start, box = op
    chunk = buf[src_offset : src_offset + math.prod(src_sizes)].view(src_sizes)
    target[tuple(slice(a, a + n) for a, n in zip(dst_start, box))].copy_(
        chunk[tuple(slice(a, a + n) for a, n in zip(src_start, box))]
    )
