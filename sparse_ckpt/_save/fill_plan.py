"""Speculative bucket fill: a ``dcp.async_save`` capture copies the buckets of the previous capture's
layout while it works out this one's, and uses the copy only where the layout turns out the same.

Filling a leaf's buckets (`sparse_ckpt._layouts.bucketed.fill`) copies every buffered state tensor
once; it can only start when the layout is known, at the end of the capture's per-tensor passes, so
the trainer waited for the passes and then for the copy. In a training run the layout rarely changes
from one checkpoint to the next (the same state tensors, the same shapes), so :class:`FillPlans`
keeps, per leaf, what the previous capture filled: its layout entries, the state tensors (the
objects) and where their bytes were. The next capture starts copying those bytes on its worker
thread at once, in one call to the core's ``gather_crc`` that holds no GIL (so the capture's own
passes go on beside it), and when its layout is known it uses the copy only if all of this holds:

* the layout entries are equal (the same parameters, state keys, dtypes, shapes, chunks, in order),
  so the layout table and buckets are the previous ones;
* every state tensor is the same object as before, still a plain contiguous CPU tensor without
  conj/neg bits, at the same address (:func:`addresses`).

Then the copy holds exactly the bytes the usual fill would have written (the trainer is blocked in
the save, so no state changed between the copy and the check), and each bucket's CRC-32C came with it.
Otherwise the copy is dropped (after it finished: it writes buffers of the pool) and the buckets are
filled as usual.

Before it starts, the copy checks that each planned tensor is alive (the plan holds them weakly) and
still at its recorded address: the same object at the same data address is the same allocation (a
tensor given another storage, by ``set_``, ``.data =`` or a resize that reallocates, gets the new one
before the old is freed, so at another address), which still holds the recorded bytes (torch never
shrinks an allocation in place), so nothing freed is read. What a tensor's strides and bits are is
checked when the layout is known, after the per-tensor passes have just read each tensor (one visit
per tensor: their objects are scattered in memory, and this pass is on the trainer's time).
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from operator import is_
from typing import TYPE_CHECKING, Any

import torch

from .. import _backend

if TYPE_CHECKING:
    from .._host_memory import HostPool
    from .worker import CaptureWorker


def addresses(chunks: list[torch.Tensor]) -> list[int] | None:
    """Each chunk's data address where every chunk is a plain contiguous CPU tensor without conj/neg
    bits (its bytes are then its elements in order); else ``None``. One visit per tensor (its
    objects are scattered in memory: a pass per attribute would fetch them five times)."""
    out = []
    append = out.append
    for t in chunks:
        if not (t.is_cpu and t.is_contiguous()) or t.is_conj() or t.is_neg():
            return None
        append(t.data_ptr())
    return out


def _alive(t: torch.Tensor | None) -> bool:
    return t is not None  # (not `None in local`: that compares tensors with ==)


@dataclass
class _Plan:
    """What a capture filled for one leaf: its layout entries and table, the core's buckets, and per
    bucket its dtype, its chunks' addresses and byte counts; the state tensors only weakly (a plan
    keeps no state alive that the optimizer dropped)."""

    entries: list[tuple[Any, ...]]
    layout: bytes
    buckets: list[tuple[str, int, list[tuple[int, int]]]]
    tensors: list[weakref.ref[torch.Tensor]]
    addresses: list[int]
    dtypes: list[torch.dtype]
    where: list[list[int]]
    sizes: list[list[int]]


@dataclass
class _Copy:
    """A copy in progress: the state tensors it reads (held until it is taken or dropped), its
    buffers, and the job giving each bucket's CRC-32C."""

    local: list[torch.Tensor]
    buffers: list[torch.Tensor]
    crcs: Future[list[int]]


class FillPlans:
    """Per leaf, the previous capture's fill (one per `sparse_ckpt.SparseOptimizerState` or
    `sparse_ckpt.MultiOptimizer`, beside its `sparse_ckpt._host_memory.HostPool`; nothing global)."""

    def __init__(self) -> None:
        self._plans: dict[str, _Plan] = {}
        self._copies: dict[str, _Copy] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """A copy or a pickle of its owner gets no plans (they describe this process's memory)."""
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def claim(self) -> bool:
        """Take the plans for one capture: ``False`` while another capture (in another thread) has them;
        that one then captures without them (the plans are one capture's at a time)."""
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        """End a capture that claimed the plans: drop the copies no leaf took, give the plans back."""
        try:
            self.drop_unused()
        finally:
            self._lock.release()

    def start(self, pool: HostPool, worker: CaptureWorker) -> None:
        """Start copying, on ``worker``, each planned leaf whose state tensors are all alive and still
        at their recorded addresses (else its plan is dropped), into buffers of ``pool`` (the previous
        capture's copies are gone: `release`)."""
        for leaf, plan in list(self._plans.items()):
            local = [ref() for ref in plan.tensors]
            if not all(map(_alive, local)) or list(map(torch.Tensor.data_ptr, local)) != plan.addresses:
                del self._plans[leaf]
                continue
            buffers = [pool.take((numel,), dtype) for dtype, (_d, numel, _m) in zip(plan.dtypes, plan.buckets)]
            jobs = [
                (memoryview(buf.view(torch.uint8).numpy()), where, sizes)
                for buf, where, sizes in zip(buffers, plan.where, plan.sizes)
            ]
            self._copies[leaf] = _Copy(local, buffers, worker.submit(_gather_all, _backend.core.gather_crc, jobs))  # type: ignore[arg-type]

    def take(
        self, leaf: str, entries: list[tuple[Any, ...]], local: list[torch.Tensor]
    ) -> tuple[bytes, list[Any], list[torch.Tensor], list[int]] | None:
        """``(layout, buckets, filled buffers, CRCs)`` of the copy started for ``leaf``, where this
        capture's layout ``entries`` and state tensors ``local`` are the plan's (see the module doc);
        else ``None``, and the copy, if any, is dropped."""
        copy = self._copies.pop(leaf, None)
        if copy is None:
            return None
        plan = self._plans[leaf]
        if (
            len(local) == len(copy.local)
            and all(map(is_, local, copy.local))
            and entries == plan.entries
            and addresses(local) == plan.addresses
            and copy.crcs.exception() is None  # (waits for it; a copy that failed is not used)
        ):
            return plan.layout, plan.buckets, copy.buffers, copy.crcs.result()
        del self._plans[leaf]
        _drop(copy)
        return None

    def record(
        self,
        leaf: str,
        entries: list[tuple[Any, ...]],
        layout: bytes,
        buckets: list[tuple[str, int, list[tuple[int, int]]]],
        local: list[torch.Tensor],
    ) -> None:
        """Plan the next capture's copy of ``leaf`` from this one's layout, where every bucket is a CPU
        buffer of two or more chunks, all plain (`addresses`); else plan none."""
        self._plans.pop(leaf, None)
        if not local or any(len(members) < 2 for _d, _n, members in buckets):
            return
        where = addresses(local)
        if where is None:
            return
        dtypes, bucket_where, sizes = [], [], []
        for _dtype, numel, members in buckets:
            first = members[0][0]
            itemsize = entries[first][3]
            dtypes.append(local[first].dtype)
            bucket_where.append([where[i] for i, _offset in members])
            ends = [offset for _i, offset in members[1:]] + [numel]
            sizes.append([(end - offset) * itemsize for (_i, offset), end in zip(members, ends)])
        self._plans[leaf] = _Plan(
            list(entries), layout, buckets, [weakref.ref(t) for t in local], where, dtypes, bucket_where, sizes
        )

    def drop_unused(self) -> None:
        """Drop the copies no leaf took (a leaf gone, a capture that failed), once they are finished."""
        copies, self._copies = self._copies, {}
        for copy in copies.values():
            _drop(copy)


def _gather_all(gather: Any, jobs: list[tuple[memoryview, list[int], list[int]]]) -> list[int]:
    return [gather(dest, where, sizes) for dest, where, sizes in jobs]


def _drop(copy: _Copy) -> None:
    """Forget ``copy`` (not begun: cancelled; else once it finished, since it writes the pool's buffers)."""
    if copy.crcs.cancel():
        return
    copy.crcs.exception()  # (waits; a dropped copy's failure changes nothing)
