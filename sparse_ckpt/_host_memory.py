"""Large host buffers (a ``state_layout="buffers"`` save's buckets, a load's directly read items)
backed by transparent huge pages where the OS offers them.

A fresh buffer costs a page fault per 4 KiB page on its first write, and on a 2-core VM that is
most of the time a bucket takes: filling a new 149 MiB bucket from 9 552 tensors took 107 ms,
of which the copy itself (into memory already touched) is 17 ms. With ``madvise(MADV_HUGEPAGE)``
on the buffer before its first write the kernel maps it in 2 MiB pages: 30 ms (Linux with
``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``madvise``, its common default, or
``always``; ``bench/README.md``). The advice covers only the 2 MiB-aligned part inside the
tensor's own allocation, so nothing outside memory this library allocated is touched, and the
allocation is freed as usual. Where ``madvise`` or the constant is missing (not Linux) or refuses,
the buffer is an ordinary ``torch.empty``.

``SPARSE_CKPT_HUGE_PAGES=0`` (or ``off``) turns the advice off, ``1`` (``on``, the default) keeps it.

On a VM whose kernel reports free memory to the hypervisor (a virtio balloon with free page
reporting, as on this project's Firecracker VM) memory left free for a few seconds goes back to
the host and is faulted in again on its next use: a huge-page buffer landing on it took 160-300 ms
per 149 MiB instead of 15 ms (4 KiB pages: 62-84 ms). Whole saves after such idle gaps were as
slow with 4 KiB pages (the page cache's fresh pages pay the same), so the advice stays on there too;
``bench/README.md`` (*Scale*) has the figures.

Staging of accelerator state (:func:`staging_host`): a bucket whose chunks live on an accelerator
is copied into a host buffer. ``SPARSE_CKPT_PINNED_STAGING=1`` (or ``on``) makes that buffer pinned
host memory of the accelerator (``torch.empty(..., pin_memory=True)``, any accelerator type that
registers a pinned allocator: CUDA, NPU, ...), so the device-to-host copy is a direct one; off by
default (``0``/``off``), because torch's pinned allocator keeps freed pinned blocks for reuse (as
DCP's own pinned staging does): the host memory of every bucket stays pinned after the save.
Where the accelerator has no pinned allocator the buffer is an ordinary one.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref
from typing import Any

import torch

__all__ = [
    "HUGE_PAGES_ENV",
    "HUGE_PAGE_BYTES",
    "PINNED_STAGING_ENV",
    "POOLED_MIN_BYTES",
    "HostPool",
    "empty_host",
    "huge_pages_wanted",
    "pinned_staging_wanted",
    "staging_host",
]

HUGE_PAGE_BYTES = 2 << 20
"""The huge page size advised for (x86-64 and arm64 with 4 KiB base pages); a buffer smaller than
two of them is left alone (it would hold no whole aligned huge page worth the call)."""

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _load_madvise() -> Any:
    if _MADV_HUGEPAGE is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _load_madvise()  # the C library's function, looked up once (not state: never changes)


HUGE_PAGES_ENV = "SPARSE_CKPT_HUGE_PAGES"
"""``0``/``off``: no huge-page advice; unset, ``1``/``on``: advise (the default)."""


PINNED_STAGING_ENV = "SPARSE_CKPT_PINNED_STAGING"
"""``1``/``on``: accelerator state staged in pinned host memory; unset, ``0``/``off``: not (the default)."""


def _switch(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/on or 0/off")


def huge_pages_wanted() -> bool:
    """Whether :func:`empty_host` advises huge pages (:data:`HUGE_PAGES_ENV`, read at each call)."""
    return _switch(HUGE_PAGES_ENV, "1")


def pinned_staging_wanted() -> bool:
    """Whether :func:`staging_host` pins (:data:`PINNED_STAGING_ENV`, read at each call)."""
    return _switch(PINNED_STAGING_ENV, "0")


def staging_host(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D host buffer for ``numel`` elements copied from ``device``: pinned host memory of the
    accelerator when ``device`` is one (the current accelerator's type), it offers pinned memory and
    :func:`pinned_staging_wanted`; else :func:`empty_host`."""
    if device.type != "cpu" and pinned_staging_wanted():
        current = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        if current is not None and current.type == device.type:
            try:
                return torch.empty(numel, dtype=dtype, pin_memory=True)
            except RuntimeError:  # an accelerator without a pinned allocator: an ordinary buffer
                pass
    return empty_host(numel, dtype)


def empty_host(size: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(size, dtype=dtype)`` on the CPU, advised to use huge pages before anything is
    written to it when it spans at least two of them and :func:`huge_pages_wanted` (see the
    module doc)."""
    out = torch.empty(size, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if _MADVISE is not None and nbytes >= 2 * HUGE_PAGE_BYTES and huge_pages_wanted():
        ptr = out.data_ptr()
        start = -(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (ptr + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start:
            _MADVISE(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return out


class HostPool:
    """Host buffers reused from one ``dcp.async_save`` to the next (one pool per
    `sparse_ckpt.SparseOptimizerState` or `sparse_ckpt.MultiOptimizer`; nothing global).

    A capture for ``dcp.async_save`` copies the state into host buffers before the call returns
    (the buckets, and the stager's copy of every other large tensor). A new buffer pays a page
    fault per page on its first write; a buffer of the previous save, already mapped, does not.
    :meth:`take` hands out a distinct tensor object that aliases a pooled buffer (``Tensor.set_``,
    not a view, so a view DCP derives from it keeps it alive) and keeps only a weak reference to
    it: the buffer is reused once that object is gone, that is once DCP dropped the staged dict
    after writing it. A buffer still referenced (a save in flight) is never handed out again; a
    new one is allocated instead. :meth:`begin` (at each capture) drops the free buffers the
    previous capture did not use, so the pool holds at most the buffers of the last capture and
    of the saves still in flight: the host memory of one staged copy of the state stays
    allocated between saves (docs/dcp.md)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int], list[_Pooled]] = {}
        self._lock = threading.Lock()
        self._round = 0
        self.allocated = 0
        """How many buffers this pool allocated (a count the tests and the benchmark read)."""

    def __getstate__(self) -> dict[str, Any]:
        """A copy or a pickle of its owner gets an empty pool (buffers are not state)."""
        return {"buffers": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __len__(self) -> int:
        """How many buffers the pool holds (free or handed out)."""
        with self._lock:
            return sum(len(entries) for entries in self._free.values())

    def begin(self) -> None:
        """Start a capture: forget the free buffers the previous capture took none of."""
        with self._lock:
            self._round += 1
            for key, entries in list(self._free.items()):
                kept = [e for e in entries if e.round >= self._round - 1 or not e.free()]
                if kept:
                    self._free[key] = kept
                else:
                    del self._free[key]

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CPU tensor of ``shape`` and ``dtype`` (contents undefined) in a pooled buffer nobody
        else references, or in a new :func:`empty_host` buffer added to the pool."""
        numel = math.prod(shape)
        with self._lock:
            entries = self._free.setdefault((dtype, numel), [])
            entry = next((e for e in entries if e.free()), None)
            if entry is None:
                entry = _Pooled(empty_host(numel, dtype))
                entries.append(entry)
                self.allocated += 1
            out = torch.empty(0, dtype=dtype).set_(entry.base.untyped_storage(), 0, shape)
            entry.held = weakref.ref(out)
            entry.round = self._round
        return out

    @staticmethod
    def takes(t: torch.Tensor) -> bool:
        """Whether :meth:`snapshot` copies ``t``: a plain contiguous CPU tensor without autograd that
        holds all of its storage and has at least :data:`POOLED_MIN_BYTES`."""
        if type(t) is not torch.Tensor or t.layout is not torch.strided or t.nbytes < POOLED_MIN_BYTES:
            return False  # (most state tensors are decided here)
        return (
            t.device.type == "cpu"
            and not t.requires_grad
            and t.is_contiguous()
            and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.nbytes
        )

    def snapshot(self, t: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``t`` in a pooled buffer (:meth:`take`) where :meth:`takes` it; else ``None``
        (the caller copies it the usual way)."""
        if not self.takes(t):
            return None
        out = self.take(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out


POOLED_MIN_BYTES = 64 << 10
"""Tensors smaller than this are copied the usual way by ``dcp.async_save``'s stager (a pool
lookup would cost more than their page faults)."""


class _Pooled:
    """A pooled buffer and a weak reference to the tensor last handed out over it."""

    __slots__ = ("base", "held", "round")

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base
        self.held: weakref.ref[torch.Tensor] | None = None
        self.round = 0

    def free(self) -> bool:
        """Whether nothing handed out over the buffer is alive."""
        return self.held is None or self.held() is None
