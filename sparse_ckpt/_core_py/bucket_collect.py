"""Python twin of ``csrc/bucket_collect.cpp``: the save-time pass that picks a leaf's
parameter-shaped state tensors for the buffers layout (part of :mod:`sparse_ckpt._core_py`).

The caller (`sparse_ckpt._layouts.bucketed.collect`) owns the semantics and the caches; this pass
is its per-state-tensor loop, the hot part of a ``state_layout="auto"``/``"buffers"`` capture
(every state tensor of a model without DTensors goes through it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._format.keys import STATE_PREFIX

_MISSING = object()


def collect_plain(
    state_fqn: Mapping[str, Any],
    items: dict[str, Any],
    param_of: Mapping[str, Any],
    tensor_type: type,
    dtensor_type: type,
    strided: Any,
    parts: dict[str, str | None],
    part_of: Callable[[Any], str | None],
    wholes: dict[Any, tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], int]],
    whole: Callable[[Any], tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], int]],
    spec_of: Callable[[Any, int], tuple[str, int, Any]],
    sharded: Callable[[str, Any, dict, list, list], None],
    addresses: list[int | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[Any]]:
    """Take the parameter-shaped state tensors of plain parameters out of ``items`` (the leaf's
    per-item entries, keyed ``state.{fqn}.{part}``): ``(entries, locals)``, each entry
    ``(fqn, part, dtype name, item size, shape, offsets, sizes)`` for the core's ``encode_layout``
    and each entry's tensor.

    Per ``(fqn, state)`` of ``state_fqn`` in order: skipped when ``param_of.get(fqn)`` is ``None``
    or ``type(state) is not dict``; a parameter that is an instance of ``dtensor_type`` is handed
    to ``sharded(fqn, param, state, entries, locals)`` (which appends what it takes). Else, with
    ``((shape, offsets, sizes), largest) = wholes.get(param.shape) or whole(param.shape)``, each
    ``(key, value)`` of ``state`` in order is taken when all hold, checked in this order:
    ``type(value) is tensor_type``; its part (``parts.get(key)`` for a ``str`` key, else or when
    absent ``part_of(key)``) is not ``None``; ``state.{fqn}.{part}`` is in ``items``;
    ``value.shape == param.shape``, ``value.layout is strided``, not ``value.is_meta``; and
    ``largest < limit``, where ``(name, item size, limit) = spec_of(value.dtype,
    value.element_size())`` (called when the dtype differs from the previous taken-or-sized
    value's). A taken value's item is deleted from ``items``; with an ``addresses`` list, its
    `plain_address` is appended to it (read right after the value's other reads: the object was just
    fetched; ``sharded`` appends those of what it takes itself).
    """
    entries: list[tuple[Any, ...]] = []
    local: list[Any] = []
    dtype: Any = None
    name, itemsize, limit = "", 0, None
    for fqn, state in state_fqn.items():
        p = param_of.get(fqn)
        if p is None or type(state) is not dict:
            continue
        if isinstance(p, dtensor_type):
            sharded(fqn, p, state, entries, local)
            continue
        pshape = p.shape
        (shape, offsets, sizes), largest = wholes.get(pshape) or whole(pshape)
        prefix = f"{STATE_PREFIX}{fqn}."
        for key, v in state.items():
            if type(v) is not tensor_type:
                continue
            part = parts.get(key, _MISSING) if type(key) is str else _MISSING
            if part is _MISSING:
                part = part_of(key)
            if part is None:
                continue
            item = prefix + part
            if item not in items:
                continue  # a 0-d parameter's state went into the scalar table
            if v.shape != pshape or v.layout is not strided or v.is_meta:
                continue
            if v.dtype is not dtype:
                dtype = v.dtype
                name, itemsize, limit = spec_of(dtype, v.element_size())
            if largest >= limit:
                continue  # large enough to be an item of its own: no copy into a buffer
            del items[item]
            entries.append((fqn, part, name, itemsize, shape, offsets, sizes))
            local.append(v)
            if addresses is not None:
                addresses.append(plain_address(v))
    return entries, local


def plain_address(t: Any) -> int | None:
    """``t``'s data address where it is a plain contiguous CPU tensor without conj/neg bits (its bytes are
    then its elements in order), else ``None``; reads ``is_cpu``, ``is_contiguous()``, ``is_conj()``,
    ``is_neg()`` in this order, as far as they decide, then ``data_ptr()``."""
    if not (t.is_cpu and t.is_contiguous()) or t.is_conj() or t.is_neg():
        return None
    return t.data_ptr()  # type: ignore[no-any-return]
