"""The capture's second thread: the work a save can do beside the copy into the buckets.

A ``state_layout="buffers"``/``"auto"`` capture copies the small state tensors into buckets and
computes each bucket's CRC-32C (`sparse_ckpt._format.bucket_checksums`); a capture for
``dcp.async_save`` also copies every other large CPU state tensor into a host buffer before the
call returns (`sparse_ckpt._host_memory.HostPool.snapshot`). Copies (torch's ``stack``/``copy_``)
and the core's ``crc32c`` (above 1 MiB) release the GIL while they run, so one worker thread does
part of them while the capture goes on: the second half of each large bucket, copied and
checksummed while the capture does the first (`sparse_ckpt._layouts.bucketed.fill`; the two CRCs
combine into the bucket's), and the copies of the large tensors while the buckets are filled
(:meth:`CaptureWorker.stage`; a large tensor whose copy the capture started from its plan, with the
buckets', is taken from there: `sparse_ckpt._save.fill_plan`). A job the worker has not begun when
its result is needed runs on the capture's thread instead (so both threads work until all is done).
The capture waits for the worker before it returns (:meth:`CaptureWorker.close`), so no thread
outlives it and every value is copied as of the save.

On one core the worker's jobs simply run interleaved with the capture; the result is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from .._format.bucket_checksums import crc_combine
from .._host_memory import HostPool

__all__ = ["STAGER_DEEP_COPIES", "CaptureWorker"]


def _stager_deep_copies() -> bool:
    from torch.distributed.checkpoint import staging

    return hasattr(staging, "DefaultStager")


STAGER_DEEP_COPIES = _stager_deep_copies()
"""Whether this torch's ``dcp.async_save`` stages the state dict by deep-copying it (its
``DefaultStager``, torch 2.13): only then does a copy the capture makes replace the stager's
(`sparse_ckpt._dcp.stateful.SparseStateDict.__deepcopy__`). Older torch's writer copies the dict into
buffers of its own, so the capture copies nothing but its buckets there."""

_T = TypeVar("_T")


class CaptureWorker:
    """One worker thread for one capture (started by the first job; :meth:`close` waits for the jobs)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparse_ckpt-capture")
        self._crc: dict[int, list[tuple[int | Future[int], int]]] = {}  # bucket -> its parts' (CRC, bytes)
        self._copies: list[tuple[torch.Tensor, Future[torch.Tensor | None]]] = []
        self._jobs: dict[Future[Any], tuple[Callable[..., Any], tuple[Any, ...]]] = {}  # not begun, maybe

    def close(self) -> None:
        """Drop the jobs not begun and wait for the one running (a capture that took its results needs
        none; one that failed needs none). Errors of jobs are raised by :meth:`crcs` and :meth:`copies`."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run ``fn(*args)`` on the worker's thread (jobs run in the order they are submitted); a job the
        worker has not begun when its result is needed is run by the caller instead (:meth:`_result`)."""
        future = self._executor.submit(fn, *args)
        self._jobs[future] = (fn, args)
        return future

    def _unbegun(self, future: Future[Any]) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        """``future``'s job, taken from the worker, where the worker has not begun it; else ``None``."""
        job = self._jobs.pop(future, None)
        return job if job is not None and future.cancel() else None

    def _result(self, future: Future[_T]) -> _T:
        """``future``'s result: run here if the worker has not begun it, else waited for."""
        job = self._unbegun(future)
        if job is not None:
            return job[0](*job[1])  # type: ignore[no-any-return]
        return future.result()

    def add_crc(self, bucket: int, crc: int | Future[int], nbytes: int) -> None:
        """Record the CRC-32C (or the job computing it) of the next ``nbytes`` bytes of bucket ``bucket``."""
        self._crc.setdefault(bucket, []).append((crc, nbytes))

    def crcs(self, n: int) -> list[int]:
        """The CRC-32C of buckets ``0 .. n-1``, each combined over its parts in order (waits for them; a
        bucket with no part is empty: CRC 0)."""
        out = []
        for bucket in range(n):
            value = 0
            for crc, nbytes in self._crc.pop(bucket, ()):
                value = crc_combine(value, self._result(crc) if isinstance(crc, Future) else crc, nbytes)
            out.append(value)
        return out

    def stage(
        self,
        pool: HostPool,
        items: Mapping[str, Any],
        started: Callable[[torch.Tensor], Future[torch.Tensor | None] | None] | None = None,
    ) -> list[torch.Tensor]:
        """Copy each value of ``items`` that `HostPool.takes` (a plain contiguous CPU tensor of at least
        `sparse_ckpt._host_memory.POOLED_MIN_BYTES`) into a buffer of ``pool``, on the worker's thread
        (the copies it has not begun when :meth:`copies` is called are made by the caller instead), or
        take the copy ``started(value)`` gives, one this capture started already (the future of its buffer,
        `sparse_ckpt._save.fill_plan.FillPlans.staged_copy`), where it gives one; return the values staged
        (nothing where :data:`STAGER_DEEP_COPIES` is false)."""
        if not STAGER_DEEP_COPIES:
            return []
        takes = pool.takes
        staged = []
        for v in items.values():
            if takes(v):
                staged.append(v)
                copy = started(v) if started is not None else None
                self._copies.append((v, copy if copy is not None else self.submit(pool.snapshot, v)))
        return staged

    def help(self) -> None:
        """Make, on the calling thread, the staged copies the worker has not begun (from the last one
        back) while the worker goes on with the jobs before them (a capture that would otherwise wait for
        one, `sparse_ckpt._save.fill_plan`); :meth:`copies` returns them with the rest, errors included."""
        for n in range(len(self._copies) - 1, -1, -1):
            original, job = self._copies[n]
            entry = self._unbegun(job)
            if entry is None:
                continue  # begun or done by the worker
            made: Future[torch.Tensor | None] = Future()
            try:
                made.set_result(entry[0](*entry[1]))
            except Exception as e:  # noqa: BLE001 - kept for copies() to raise, as a job's error is
                made.set_exception(e)
            self._copies[n] = (original, made)

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(original, copy)`` of every tensor :meth:`stage` copied: the copies the worker has not
        begun are made here, on the calling thread, from the last one back, while the worker goes on
        from the first (so both threads copy until all are done); then it waits for the worker's."""
        jobs, self._copies = self._copies, []
        out = []
        for original, job in reversed(jobs):
            copy = self._result(job)
            if copy is not None:
                out.append((original, copy))
        return out
