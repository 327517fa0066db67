"""``state_layout="buffers"``, the checkpoint tools' view: buffered state as the tools see
per-item state (:func:`layout_view`, DCP metadata only) or as full CPU tensors (:func:`full_state`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import _backend
from .._format.keys import BUFFERS_PREFIX, check_table, key_parts, split_buffers_key
from .._format.layout_index import check_index, decode_index
from .._fqn import FqnMap
from ..errors import CheckpointFormatError, CheckpointMismatchError
from .bucketed import Chunk, buffer_key, dtype_name, torch_dtype
from .bucketed_load import expand


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
                bkey = buffer_key(leaf, ranks, bi)  # written before the dtype was part of the key
            if bkey not in values:
                raise CheckpointMismatchError(f"leaf {leaf!r}: buffer item {bkey!r} of layout {key!r} is missing")
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


def _check_indexes(keys: Iterable[str], values: Mapping[str, Any], tables: Mapping[str, dict[str, Any]]) -> None:
    """Each layout index among ``keys`` agrees with its leaf's layout tables (``tables``: leaf ->
    rank tag -> decoded entries), else a :class:`CheckpointFormatError` (`sparse_ckpt._format.layout_index.check_index`)."""
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
    whole = FqnMap(canonical={f: f for f in shapes}, param_of={f: torch.empty(s, device="meta") for f, s in shapes.items()})
    return expand(keys, values, whole, None)
