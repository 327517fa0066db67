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

The large state tensors a ``dcp.async_save`` capture copies into the pool instead (its *staged copies*,
`sparse_ckpt._save.worker.CaptureWorker.stage`) are planned likewise, per tensor: the next capture
copies each one's bytes into a pool buffer in the same call (no checksum), and the capture uses that copy
for a tensor it stages where the tensor is the same object, still takes a pool copy
(`sparse_ckpt._host_memory.HostPool.takes`), has no conj/neg bit and is at the same address with the
same shape and dtype; any other tensor it stages is copied as usual. So the bucket fill and the large
copies run in one call that holds no GIL from the start of the capture, instead of the large copies
waiting for the capture's passes to end.

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
from .._core_py.bucket_collect import plain_address
from .._format.bucket_checksums import crc_combine
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


_Piece = tuple[int, int, list[int], list[int]]
"""One piece of a planned copy: its first byte and byte count in the destination, its sources'
addresses and byte counts (`_split`)."""


@dataclass
class _Plan:
    """What a capture filled for one leaf: its layout entries and table, the core's buckets, per bucket
    its dtype and the pieces of its copy (`_split`: its chunks' addresses and byte counts); the
    storages the addresses are in, and the state tensors only weakly (the plan is dropped when one of
    them is freed: it keeps no state alive that the optimizer dropped)."""

    entries: list[tuple[Any, ...]]
    layout: bytes
    buckets: list[tuple[str, int, list[tuple[int, int]]]]
    addresses: list[int]
    storages: list[torch.UntypedStorage]
    dtypes: list[torch.dtype]
    pieces: list[list[_Piece]]
    tensors: list[weakref.ref[torch.Tensor]] = field(default_factory=list)


@dataclass
class _Staged:
    """A planned staged copy: the state tensor (weakly), where its bytes were, its shape and dtype, and
    the storage they are in (held, so the address stays allocated)."""

    tensor: weakref.ref[torch.Tensor]
    address: int
    shape: torch.Size
    dtype: torch.dtype
    storage: torch.UntypedStorage
    pieces: list[_Piece]


@dataclass
class _StagedPlan:
    """What a capture staged for one leaf: the planned staged copies."""

    entries: list[_Staged]


@dataclass
class _Copy:
    """A copy in progress: the state tensors it reads (held until it is taken or dropped), its bucket
    buffers, its pieces (the core's ``gather_many`` jobs: each bucket's bytes and each staged tensor's, in
    pieces of at most :data:`PIECE_BYTES`) with their claims, per piece its bucket (``-1``: a staged copy)
    and byte count, the worker's call over them (from the first piece on) and the capture's own, if any
    (`FillPlans.help`, from the last piece back); per staged tensor (by ``id``) the tensor, its plan and
    the buffer its bytes are copied into."""

    local: list[torch.Tensor]
    buffers: list[torch.Tensor]
    jobs: list[tuple[memoryview, list[int], list[int], bool]]
    pieces: list[tuple[int, int]]
    staged: dict[int, tuple[torch.Tensor, _Staged, torch.Tensor]]
    claims: bytearray = field(default_factory=bytearray)
    crcs: Future[list[int | None]] = field(default_factory=Future)
    helped: list[int | None] | None = None

    def add(self, bucket: int, dest: memoryview, pieces: list[_Piece]) -> None:
        """Add the jobs copying ``pieces`` into ``dest``, checksummed where ``bucket`` is one (``>= 0``)."""
        checksum = bucket >= 0
        for start, n, addresses, sizes in pieces:
            self.jobs.append((dest[start : start + n], addresses, sizes, checksum))
            self.pieces.append((bucket, n))

    def bucket_crcs(self) -> list[int]:
        """Each bucket's CRC-32C, its pieces' combined (waits for the worker's call)."""
        ran = self.crcs.result()
        out = [0] * len(self.buffers)
        for j, (bucket, nbytes) in enumerate(self.pieces):
            if bucket >= 0:
                crc = ran[j] if ran[j] is not None else self.helped[j] if self.helped is not None else None
                if crc is None:
                    raise RuntimeError(f"piece {j} of the bucket copy was not copied")  # (cannot happen)
                out[bucket] = crc_combine(out[bucket], crc, nbytes)
        return out


class FillPlans:
    """Per leaf, the previous capture's fill (one per `sparse_ckpt.SparseOptimizerState` or
    `sparse_ckpt.MultiOptimizer`, beside its `sparse_ckpt._host_memory.HostPool`; nothing global)."""

    def __init__(self) -> None:
        self._plans: dict[str, _Plan] = {}
        self._staged: dict[str, _StagedPlan] = {}
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
        (else its plan is dropped), into buffers of ``pool``: its buckets and its staged copies, in one
        call to the core's ``gather_many``; nothing where the capture calls code of the user's
        (`runs_user_code` of any leaf: a hook of one leaf could change another's state while its copy
        reads it). The previous capture's copies are gone (`release`)."""
        if any(map(runs_user_code, leaves.values())):
            return
        for leaf in list(dict.fromkeys([*self._plans, *self._staged])):
            plan = self._plans.get(leaf)
            local = [ref() for ref in plan.tensors] if plan is not None else []
            if plan is not None and (leaf not in leaves or not all(map(_alive, local))):
                del self._plans[leaf]
                plan, local = None, []
            staged_plan = self._staged.get(leaf)
            staged = staged_plan.entries if staged_plan is not None else []
            tensors = [entry.tensor() for entry in staged]
            if leaf not in leaves or not all(map(_alive, tensors)):
                self._staged.pop(leaf, None)
                staged, tensors = [], []
            if plan is None and not staged:
                continue
            copy = _Copy(local, [], [], [], {})
            if plan is not None:
                copy.buffers = [pool.take((n,), dtype) for dtype, (_d, n, _m) in zip(plan.dtypes, plan.buckets)]
                for bucket, (buf, pieces) in enumerate(zip(copy.buffers, plan.pieces)):
                    copy.add(bucket, _bytes_of(buf), pieces)
            for entry, t in zip(staged, tensors):
                buf = pool.take(tuple(entry.shape), entry.dtype)
                copy.add(-1, _bytes_of(buf), entry.pieces)
                copy.staged[id(t)] = (t, entry, buf)
            copy.claims = bytearray(len(copy.jobs))
            copy.crcs = worker.submit(_backend.core.gather_many, copy.jobs, copy.claims)
            self._copies[leaf] = copy

    def staged_copy(self, leaf: str, t: torch.Tensor) -> Future[torch.Tensor | None] | None:
        """The copy of ``t``, a tensor the capture of ``leaf`` stages (`HostPool.takes` it), that this
        capture started from its plan, where ``t`` is the planned object with no conj/neg bit at the same
        address with the same shape and dtype: a future of the buffer (``None`` where the copy was
        cancelled or failed: the tensor is then copied the usual way); else ``None``."""
        copy = self._copies.get(leaf)
        found = copy.staged.get(id(t)) if copy is not None else None
        if found is None or found[0] is not t:
            return None
        _t, entry, buf = found
        if plain_address(t) != entry.address or t.shape != entry.shape or t.dtype is not entry.dtype:
            return None
        out: Future[torch.Tensor | None] = Future()

        def done(job: Future[Any]) -> None:
            out.set_result(buf if not job.cancelled() and job.exception() is None else None)

        copy.crcs.add_done_callback(done)  # type: ignore[union-attr]
        return out

    def record_staged(self, leaf: str, staged: list[torch.Tensor]) -> None:
        """Plan the next capture's copies of the tensors the capture of ``leaf`` staged (``staged``), each
        with no conj/neg bit (the others: not planned)."""
        self._staged.pop(leaf, None)
        kept = [(t, address) for t in staged if (address := plain_address(t)) is not None]
        if not kept:
            return
        plan = self._staged[leaf] = _StagedPlan([])
        forget = _forgetter(weakref.ref(self), "_staged", leaf, weakref.ref(plan))
        plan.entries = [
            _Staged(weakref.ref(t, forget), a, t.shape, t.dtype, t.untyped_storage(), _split([(a, t.nbytes)]))
            for t, a in kept
        ]

    def help(self, leaf: str | None = None) -> None:
        """Copy, on the calling thread, the pieces of the copy of ``leaf`` (``None``: of every leaf) the
        worker has not claimed yet, from the last one back, while the worker goes on from the first (both
        calls hold no GIL: the two threads copy until all pieces are done)."""
        for name, copy in list(self._copies.items()):
            if (leaf is None or name == leaf) and copy.helped is None and not copy.crcs.done():
                copy.helped = _backend.core.gather_many(copy.jobs, copy.claims, True)

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
        copy = self._copies.get(leaf)
        plan = self._plans.get(leaf)
        if copy is None or plan is None or not copy.buffers:
            return None  # (a copy of staged tensors only: kept for them until `release`)
        del self._copies[leaf]
        if (
            len(local) == len(copy.local)
            and all(map(is_, local, copy.local))
            and entries == plan.entries
            and addresses == plan.addresses
            and copy.crcs.exception() is None  # (waits for it; a copy that failed is not used)
        ):
            return plan.layout, plan.buckets, copy.buffers, copy.bucket_crcs()
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
        dtypes, pieces = [], []
        for _dtype, numel, members in buckets:
            first = members[0][0]
            itemsize = entries[first][3]
            dtypes.append(local[first].dtype)
            ends = [offset for _i, offset in members[1:]] + [numel]
            pieces.append(_split([(where[i], (end - offset) * itemsize) for (i, offset), end in zip(members, ends)]))
        storages = [t.untyped_storage() for t in local]
        plan = self._plans[leaf] = _Plan(list(entries), layout, buckets, where, storages, dtypes, pieces)
        forget = _forgetter(weakref.ref(self), "_plans", leaf, weakref.ref(plan))
        plan.tensors = [weakref.ref(t, forget) for t in local]

    def drop_unused(self) -> None:
        """Drop the copies no leaf took (a leaf gone, a capture that failed), once they are finished."""
        copies, self._copies = self._copies, {}
        for copy in copies.values():
            _drop(copy)


def _forgetter(owner: weakref.ref[FillPlans], table: str, leaf: str, plan: weakref.ref[Any]) -> Any:
    """The weak reference callback of a plan's tensors: drop the plan of ``leaf`` in the table ``table``
    (``_plans`` or ``_staged``) and the storages it holds when one of them is freed, unless it was
    replaced or dropped already (refers to nothing strongly)."""

    def forget(_ref: Any) -> None:
        plans, recorded = owner(), plan()
        if plans is not None and recorded is not None:
            kept = getattr(plans, table)
            if kept.get(leaf) is recorded:
                kept.pop(leaf, None)

    return forget


PIECE_BYTES = 4 << 20
"""The most bytes of one piece of a copy: the unit the worker and the capture share out
(`FillPlans.help`); each bucket piece's CRC-32C is combined into the bucket's."""


def _split(sources: list[tuple[int, int]]) -> list[_Piece]:
    """The pieces that copy ``sources`` (``(address, bytes)``, in order) into one destination, each of at
    most :data:`PIECE_BYTES` (a source split where it does not fit); none for no bytes."""
    out: list[_Piece] = []
    start = filled = 0
    addresses: list[int] = []
    sizes: list[int] = []
    for address, n in sources:
        while n:
            take = min(n, PIECE_BYTES - filled)
            addresses.append(address)
            sizes.append(take)
            address, n, filled = address + take, n - take, filled + take
            if filled == PIECE_BYTES:
                out.append((start, filled, addresses, sizes))
                start, filled, addresses, sizes = start + filled, 0, [], []
    if filled:
        out.append((start, filled, addresses, sizes))
    return out


def _bytes_of(buf: torch.Tensor) -> memoryview:
    """A writable view of the bytes of ``buf`` (a contiguous CPU tensor)."""
    return memoryview(buf.reshape(-1).view(torch.uint8).numpy())


def _drop(copy: _Copy) -> None:
    """Forget ``copy`` (not begun and copying no staged tensor, which a capture may have taken by then:
    cancelled; else once it finished, since it writes the pool's buffers)."""
    if (not copy.staged and copy.crcs.cancel()) or copy.crcs.cancelled():
        return
    copy.crcs.exception()  # (waits; a dropped copy's failure changes nothing)
