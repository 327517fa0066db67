"""``state_layout="buffers"``, load side, second half: a leaf's scatter plan carried out.

:mod:`.bucketed_load` decides which layout tables a load reads and gets the core's scatter plan
over them (``plan_scatter``: targets, sources, ops); :func:`scatter` turns that plan into state
tensors. Each bucket the plan needs is taken from the dict or read (one at a time), checked against
its layout (:func:`check_buffer`), and its chunks become the state tensors: a target one whole saved
chunk fills, on a CPU parameter, is a view of its bucket (no copy); every other target is allocated
like its parameter and copied into, box by box. The tensors join the decoded state at their key's
path (:func:`put_states`), as per-item entries would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from .._dcp.items import allocate_like
from .._dcp.saved_tensor import contiguous_strides
from .._format.bucket_checksums import check_bucket
from .._format.keys import is_plain_part, key_parts
from .._fqn import FqnMap
from ..errors import CheckpointFormatError, CheckpointMismatchError
from .bucketed import dtype_name, torch_dtype


class BucketSource(Protocol):
    """What `scatter` needs of a reader of buckets (`.bucketed_load.BucketReader` is one): the
    item keys it can read, and a read that hands each bucket to a callback."""

    keys: Any

    def read(self, inner_keys: list[str], consume: Callable[[str, Any], None]) -> None: ...


Plan = tuple[list[tuple[Any, ...]], list[tuple[int, int, str, int]], list[tuple[Any, ...]]]
"""The core's ``plan_scatter`` result: ``(targets, sources, ops)``."""


def scatter(
    leaf: str,
    plan: Plan,
    held: list[Any],
    key_of: Callable[[int], str],
    reader: BucketSource | None,
    fmap: FqnMap,
    out: dict[str, dict[str, Any]],
    checksums: Sequence[tuple[int, ...] | None] = (),
) -> None:
    """Carry out ``plan`` into ``out`` (``canonical FQN -> {key path: tensor}``).

    ``held[si]``: source ``si``'s bucket when the load has it already, else ``None`` (it is read
    through ``reader``); ``key_of(si)``: its item key. A bucket that is neither held nor readable,
    or that the reader did not hand over, is refused naming the first state it holds.
    ``checksums[li]``: the bucket checksums of the plan's layout ``li`` (``None`` or left out:
    written without them), each bucket checked against its own (:func:`check_buffer`)."""
    targets, sources, ops = plan
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
    consumed = [False] * len(sources)

    def fill(si: int, buf: Any) -> None:
        li, bi, dtype, numel = sources[si]
        check_buffer(leaf, key_of(si), buf, dtype, numel, bi, checksums[li] if checksums else None)
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
    for si, buf in enumerate(held):
        if buf is not None:
            fill(si, buf)
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
        reader.read(list(wanted), lambda key, value: fill(wanted[key], value))
    check_consumed(leaf, consumed, key_of, sources, by_source, targets)
    canonical = fmap.canonical
    put_states(out, leaf, ((canonical[t[0]], t[1], value) for t, value in zip(targets, made)))


def put_states(out: dict[str, dict[str, Any]], leaf: str, entries: Iterable[tuple[str, str, Any]]) -> None:
    """Each ``(fqn, key, value)`` into ``out[fqn]`` at the path of state key ``key`` (a plain part
    is one key; other keys' parts are unescaped and nest, nested dicts created). A value already
    at that path (a state both in a buffer and a per-item entry) is a `CheckpointFormatError`."""
    parts_of: dict[str, list[Any]] = {}  # key -> its parts (the same few keys recur for every parameter)
    for fqn, key, value in entries:
        state = out.get(fqn)
        if state is None:
            state = out[fqn] = {}
        parts = parts_of.get(key)
        if parts is None:
            parts = parts_of[key] = [key] if is_plain_part(key) else key_parts(key)
        node = state
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        last = parts[-1]
        if last in node:
            raise CheckpointFormatError(
                f"leaf {leaf!r}: state {key!r} of {fqn!r} is both in a buffer and a per-item entry (corrupt or "
                "edited checkpoint)"
            )
        node[last] = value


def check_consumed(
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


def check_buffer(
    leaf: str, key: str, buf: Any, dtype: str, numel: int, bucket: int = 0, crcs: tuple[int, ...] | None = None
) -> None:
    """A bucket as its layout describes it: a plain 1-D tensor of ``dtype`` and ``numel`` elements
    whose bytes have the CRC-32C ``crcs[bucket]`` (unchecked when ``crcs`` is ``None``: a layout
    written without checksums; `sparse_ckpt._format.bucket_checksums`)."""
    if not isinstance(buf, torch.Tensor) or isinstance(buf, DTensor):
        raise CheckpointFormatError(f"leaf {leaf!r}: buffer item {key!r} is a {type(buf).__name__}, expected a tensor")
    if buf.ndim != 1 or dtype_name(buf.dtype) != dtype or buf.numel() != numel:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: buffer item {key!r} is a {dtype_name(buf.dtype)} tensor of shape {tuple(buf.shape)}, its "
            f"layout table says {dtype} of {numel} elements (truncated, or the layout disagrees with the data)"
        )
    check_bucket(leaf, key, buf, bucket, crcs)


def _allocate(leaf: str, target: tuple[Any, ...], fmap: FqnMap) -> torch.Tensor:
    """A new state tensor for ``target`` (core ``plan_scatter``), allocated like its parameter."""
    fqn, key, dtype_name_, shape, _offsets, sizes = target
    t = allocate_like(shape, torch_dtype(leaf, fqn, key, dtype_name_), fmap.param_of[fmap.canonical[fqn]])
    if isinstance(t, DTensor) and tuple(t.to_local().shape) != tuple(
        sizes
    ):  # pragma: no cover - the chunk is the parameter's
        raise CheckpointMismatchError(f"leaf {leaf!r}: state {key!r} of {fqn!r}: local shape differs from its chunk")
    return t


def _on_cpu(p: torch.Tensor) -> bool:
    """Whether the parameter's state lives on the CPU (a plain tensor there, or a DTensor on a CPU mesh)."""
    if isinstance(p, DTensor):
        return p.device_mesh.device_type == "cpu"
    return p.device.type in ("cpu", "meta")


def _wrap(local: torch.Tensor, target: tuple[Any, ...], fmap: FqnMap) -> torch.Tensor:
    """``local`` (a whole chunk) as the state tensor: itself, or a DTensor like the parameter, with
    the strides torch gives a contiguous tensor of the global shape (what `_allocate` gives)."""
    p = fmap.param_of[fmap.canonical[target[0]]]
    if not isinstance(p, DTensor):
        return local
    shape = tuple(target[3])
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape), stride=contiguous_strides(shape)
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
