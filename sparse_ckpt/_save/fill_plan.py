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
  conj/neg bits, at the same address (`sparse_ckpt._core_py.bucket_collect.plain_address`, read by
  the capture's collect pass while it visits the tensor).

Then the copy holds exactly the bytes the usual fill would have written (the trainer is blocked in
the save, so no state changed between the copy and the check), and each bucket's CRC-32C came with it.
Otherwise the copy is dropped (after it finished: it writes buffers of the pool) and the buckets are
filled as usual.

Nothing freed is read: the plan holds the storage of each state tensor it recorded (the memory its
bytes were in), so the recorded addresses stay allocated, whatever happens to the tensors (given
another storage by ``set_``, ``.data =`` or a resize that reallocates: the tensor is then at another
address and the copy is not used). The plan refers to the tensors themselves weakly: when one of them
is freed (the optimizer dropped its state, or the optimizer is gone) the plan is dropped, and with it
the storages; a storage a living tensor no longer uses is held until the next capture drops the plan.
A copy is started only where the capture calls no code of the user's (`runs_user_code`, any leaf: a
``state_dict`` hook could change the state while the copy reads it). What a tensor's strides, bits and
address are is checked when the layout is known, after the per-tensor passes have just read each
tensor (one visit per tensor: their objects are scattered in memory, and this pass is on the
trainer's time); nothing is read per tensor before the copy starts.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from operator import is_
from typing import TYPE_CHECKING, Any

import torch

from .. import _backend
from .._adapters import adapter_for
from .._torch_internals import state_dict_post_hooks, state_dict_pre_hooks

if TYPE_CHECKING:
    from .._host_memory import HostPool
    from .worker import CaptureWorker


def runs_user_code(optimizer: torch.optim.Optimizer) -> bool:
    """Whether capturing ``optimizer`` calls code of the user's (``state_dict`` pre- or post-hooks, a
    registered adapter), which could change its state while a copy started beside the capture reads it."""
    return (
        adapter_for(type(optimizer)) is not None
        or bool(state_dict_pre_hooks(optimizer))
        or bool(state_dict_post_hooks(optimizer))
    )


def _alive(t: torch.Tensor | None) -> bool:
    return t is not None  # (not `None in local`: that compares tensors with ==)


@dataclass
class _Plan:
    """What a capture filled for one leaf: its layout entries and table, the core's buckets, and per
    bucket its dtype, its chunks' addresses and byte counts; the storages the addresses are in, and
    the state tensors only weakly (the plan is dropped when one of them is freed: it keeps no state
    alive that the optimizer dropped)."""

    entries: list[tuple[Any, ...]]
    layout: bytes
    buckets: list[tuple[str, int, list[tuple[int, int]]]]
    addresses: list[int]
    storages: list[torch.UntypedStorage]
    dtypes: list[torch.dtype]
    where: list[list[int]]
    sizes: list[list[int]]
    tensors: list[weakref.ref[torch.Tensor]] = field(default_factory=list)


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

    def start(self, pool: HostPool, worker: CaptureWorker, leaves: Mapping[str, torch.optim.Optimizer]) -> None:
        """Start copying, on ``worker``, each planned leaf of ``leaves`` whose state tensors are all alive
        (else its plan is dropped), into buffers of ``pool``; nothing where the capture calls code of the
        user's (`runs_user_code` of any leaf: a hook of one leaf could change another's state while its
        copy reads it). The previous capture's copies are gone (`release`)."""
        if any(map(runs_user_code, leaves.values())):
            return
        for leaf, plan in list(self._plans.items()):
            local = [ref() for ref in plan.tensors]
            if leaf not in leaves or not all(map(_alive, local)):
                del self._plans[leaf]
                continue
            buffers = [pool.take((numel,), dtype) for dtype, (_d, numel, _m) in zip(plan.dtypes, plan.buckets)]
            jobs = [
                (memoryview(buf.view(torch.uint8).numpy()), where, sizes)
                for buf, where, sizes in zip(buffers, plan.where, plan.sizes)
            ]
            self._copies[leaf] = _Copy(local, buffers, worker.submit(_gather_all, _backend.core.gather_crc, jobs))  # type: ignore[arg-type]

    def busy(self, leaf: str) -> bool:
        """Whether a copy was started for ``leaf`` and is not finished."""
        copy = self._copies.get(leaf)
        return copy is not None and not copy.crcs.done()

    def take(
        self,
        leaf: str,
        entries: list[tuple[Any, ...]],
        local: list[torch.Tensor],
        addresses: list[int | None] | None,
    ) -> tuple[bytes, list[Any], list[torch.Tensor], list[int]] | None:
        """``(layout, buckets, filled buffers, CRCs)`` of the copy started for ``leaf``, where this
        capture's layout ``entries`` and state tensors ``local`` (at ``addresses``: each one's
        `sparse_ckpt._core_py.bucket_collect.plain_address`, read by the capture's collect pass) are the
        plan's (see the module doc); else ``None``, and the copy, if any, is dropped."""
        copy = self._copies.pop(leaf, None)
        if copy is None:
            return None
        plan = self._plans[leaf]
        if (
            len(local) == len(copy.local)
            and all(map(is_, local, copy.local))
            and entries == plan.entries
            and addresses == plan.addresses
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
        addresses: list[int | None] | None,
    ) -> None:
        """Plan the next capture's copy of ``leaf`` from this one's layout, where every bucket is a CPU
        buffer of two or more chunks, all plain (each at its address in ``addresses``); else plan none."""
        self._plans.pop(leaf, None)
        if not local or addresses is None or any(len(members) < 2 for _d, _n, members in buckets):
            return
        if None in addresses:  # (ints and None: compared by identity or as ints, no tensor's ==)
            return
        where: list[int] = addresses  # type: ignore[assignment]
        dtypes, bucket_where, sizes = [], [], []
        for _dtype, numel, members in buckets:
            first = members[0][0]
            itemsize = entries[first][3]
            dtypes.append(local[first].dtype)
            bucket_where.append([where[i] for i, _offset in members])
            ends = [offset for _i, offset in members[1:]] + [numel]
            sizes.append([(end - offset) * itemsize for (_i, offset), end in zip(members, ends)])
        storages = [t.untyped_storage() for t in local]
        plan = self._plans[leaf] = _Plan(list(entries), layout, buckets, where, storages, dtypes, bucket_where, sizes)
        forget = _forgetter(weakref.ref(self), leaf, weakref.ref(plan))
        plan.tensors = [weakref.ref(t, forget) for t in local]

    def drop_unused(self) -> None:
        """Drop the copies no leaf took (a leaf gone, a capture that failed), once they are finished."""
        copies, self._copies = self._copies, {}
        for copy in copies.values():
            _drop(copy)


def _forgetter(owner: weakref.ref[FillPlans], leaf: str, plan: weakref.ref[_Plan]) -> Any:
    """The weak reference callback of a plan's tensors: drop the plan (and the storages it holds) when
    one of them is freed, unless it was replaced or dropped already (refers to nothing strongly)."""

    def forget(_ref: Any) -> None:
        plans, recorded = owner(), plan()
        if plans is not None and recorded is not None and plans._plans.get(leaf) is recorded:
            plans._plans.pop(leaf, None)

    return forget


def _gather_all(gather: Any, jobs: list[tuple[memoryview, list[int], list[int]]]) -> list[int]:
    return [gather(dest, where, sizes) for dest, where, sizes in jobs]


def _drop(copy: _Copy) -> None:
    """Forget ``copy`` (not begun: cancelled; else once it finished, since it writes the pool's buffers)."""
    if copy.crcs.cancel():
        return
    copy.crcs.exception()  # (waits; a dropped copy's failure changes nothing)
