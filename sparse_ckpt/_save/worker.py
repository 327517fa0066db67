"""The capture's second thread: the work a save can do beside the copy into the buckets.

A ``state_layout="buffers"``/``"auto"`` capture copies the small state tensors into buckets and
computes each bucket's CRC-32C (`sparse_ckpt._format.bucket_checksums`); a capture for
``dcp.async_save`` also copies every other large CPU state tensor into a host buffer before the
call returns (`sparse_ckpt._host_memory.HostPool.snapshot`). Both the CRC and these copies release
the GIL while they run (the core's ``crc32c`` above 1 MiB, torch's ``copy_``), so one worker thread
runs them while the capture goes on: the CRC of each part of a bucket as soon as it is written (in
order: a bucket's CRC is chained over its parts), the copies of the large tensors while the buckets
are filled. The capture waits for the worker before it returns (:meth:`CaptureWorker.close`), so no
thread outlives it and every value is copied as of the save.

On one core the worker's jobs simply run interleaved with the capture; the result is the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .._format.bucket_checksums import tensor_crc
from .._host_memory import HostPool

__all__ = ["CaptureWorker"]


class CaptureWorker:
    """One worker thread for one capture (started by the first job; :meth:`close` waits for the jobs)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparse_ckpt-capture")
        self._crc: dict[int, int] = {}  # bucket -> CRC-32C so far (written by the worker only)
        self._crc_jobs: list[Future[None]] = []
        self._copies: list[tuple[torch.Tensor, Future[torch.Tensor | None]]] = []

    def close(self) -> None:
        """Wait for every job (their errors are raised by :meth:`crcs` and :meth:`copies`)."""
        self._executor.shutdown(wait=True)

    def crc(self, bucket: int, part: torch.Tensor) -> None:
        """Chain the CRC-32C of ``part`` (the next written part of bucket ``bucket``) onto the bucket's."""
        self._crc_jobs.append(self._executor.submit(self._chain, bucket, part))

    def _chain(self, bucket: int, part: torch.Tensor) -> None:
        self._crc[bucket] = tensor_crc(part, self._crc.get(bucket, 0))

    def crcs(self, n: int) -> list[int]:
        """The CRC-32C of buckets ``0 .. n-1`` (waits for their parts)."""
        for job in self._crc_jobs:
            job.result()
        self._crc_jobs.clear()
        return [self._crc.get(i, 0) for i in range(n)]  # (a bucket with no part is empty: CRC 0)

    def stage(self, pool: HostPool, items: Mapping[str, Any]) -> None:
        """Copy each value of ``items`` that `HostPool.snapshot` takes (a plain contiguous CPU tensor
        of at least `sparse_ckpt._host_memory.POOLED_MIN_BYTES`) into a buffer of ``pool``."""
        for v in items.values():
            if type(v) is torch.Tensor and pool.takes(v):
                self._copies.append((v, self._executor.submit(pool.snapshot, v)))

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(original, copy)`` of every tensor :meth:`stage` copied (waits for them)."""
        out = []
        for original, job in self._copies:
            copy = job.result()
            if copy is not None:
                out.append((original, copy))
        self._copies.clear()
        return out
