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
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import torch

__all__ = ["HUGE_PAGE_BYTES", "empty_host"]

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


def empty_host(size: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(size, dtype=dtype)`` on the CPU, advised to use huge pages before anything is
    written to it when it spans at least two of them (see the module doc)."""
    out = torch.empty(size, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if _MADVISE is not None and nbytes >= 2 * HUGE_PAGE_BYTES:
        ptr = out.data_ptr()
        start = -(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (ptr + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start:
            _MADVISE(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return out
