"""The process-group backend of the emulated ``npu`` device: ``npu_gloo``, a Gloo group through host copies.

The emulated device (tests/accelerator/emulated_npu.py) keeps its tensors in host memory but as a device
type of its own, which Gloo refuses. :class:`NpuGlooGroup` is a Python ``ProcessGroup`` (as torch's
``torch.testing._internal.distributed.multi_threaded_pg`` writes one) that runs each collective on a Gloo
group of the same ranks: the ``npu`` inputs are copied to the host, Gloo runs the collective and waits,
and the results are copied back into the ``npu`` outputs. Every call completes before it returns (the
returned work is Gloo's, already waited on), which is what an emulated device whose kernels never wait
needs. It serves ``cpu`` tensors too (passed to Gloo as they are), so ``init_process_group("npu_gloo")``
alone carries both DCP's CPU objects and FSDP2's all-gathers and reduce-scatters on ``npu`` tensors.

It emulates the *collectives' semantics*, not HCCL: no overlap, no speed. ``ReduceOp.AVG`` (which Gloo
lacks) is a sum divided by the group size; ``PREMUL_SUM`` is not supported (FSDP2 asks for it on NCCL only).
:func:`register` is idempotent and is called by ``emulated_npu.register()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

NAME = "npu_gloo"
"""The backend name ``init_process_group`` takes (``"npu_gloo"`` or ``"cpu:gloo,npu:npu_gloo"``)."""


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when on the host, else a host copy (contiguous: Gloo wants dense buffers)."""
    return t if t.device.type == "cpu" and t.is_contiguous() else t.detach().to("cpu").contiguous()


def _back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a host result into ``dst`` unless they are the same tensor."""
    if dst is not src:
        dst.copy_(src)


def _each(single: Callable[..., Any], outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> Any:
    """A coalesced collective as one ``single(output, input, opts)`` per pair; the last one's work."""
    work = None
    for out, inp in zip(outputs, inputs):
        work = single(out, inp, opts)
    return work


def _back_lists(dsts: list[list[torch.Tensor]], srcs: list[list[torch.Tensor]]) -> None:
    """:func:`_back` for each tensor of lists of tensors (a gather's outputs)."""
    for outs, hosts in zip(dsts, srcs):
        for t, h in zip(outs, hosts):
            _back(t, h)


def _is_avg(opts: Any) -> bool:
    return getattr(opts, "reduceOp", None) == dist.ReduceOp.AVG


def _sum_opts(opts: Any, cls: type) -> Any:
    """``opts`` with ``AVG`` replaced by ``SUM`` (the division by the group size is done after)."""
    if not _is_avg(opts):
        return opts
    out = cls()
    out.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "timeout"):
        out.timeout = opts.timeout
    return out


class NpuGlooGroup(dist.ProcessGroup):
    """A ``ProcessGroup`` for ``npu`` (and ``cpu``) tensors that runs every collective on a Gloo group."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
        super().__init__(rank, world_size)
        self._rank = rank
        self._world_size = world_size
        self._group_name = ""
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{NAME}/", store), rank, world_size, timeout)

    # -- helpers ----------------------------------------------------------------------------------
    def _avg(self, opts: Any, tensors: Sequence[torch.Tensor]) -> None:
        if _is_avg(opts):
            for t in tensors:
                t.div_(self._world_size)

    # -- reductions -------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        host = [_host(t) for t in tensors]
        work = self._gloo.allreduce(host, _sum_opts(opts, dist.AllreduceOptions))
        work.wait()
        self._avg(opts, host)
        for t, h in zip(tensors, host):
            _back(t, h)
        return work

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        work = None
        for t in tensors:
            work = self.allreduce([t], dist.AllreduceOptions() if opts is None else _as_allreduce(opts))
        return work if work is not None else self.barrier()

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        """Each rank's output ``i`` is the reduction of every rank's ``inputs[i][rank]`` (an all-reduce of
        the whole input list on the host, then this rank's slice)."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = None
        for out, ins in zip(outputs, inputs):
            host = torch.cat([_host(t).reshape(-1) for t in ins])
            work = self.allreduce([host], _to_allreduce(opts))
            _back(out, host.split([t.numel() for t in ins])[self._rank].view_as(out))
        return work

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.reduce_scatter([output], [list(input.chunk(self._world_size))], opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _each(self.reduce_scatter_single, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- gathers and broadcast --------------------------------------------------------------------
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllgatherOptions()
        host_out = [
            [_host(t) if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype) for t in outs]
            for outs in outputs
        ]
        host_out = [[t if t.is_contiguous() else t.contiguous() for t in outs] for outs in host_out]
        work = self._gloo.allgather(host_out, [_host(t) for t in inputs], opts)
        work.wait()
        _back_lists(outputs, host_out)
        return work

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        host = torch.empty(output.shape, dtype=output.dtype)
        work = self.allgather([list(host.chunk(self._world_size))], [input], opts)
        _back(output, host)
        return work

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _each(self.all_gather_single, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return _each(lambda outs, inp, o: self.allgather([outs], [inp], o), outputs, inputs, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BroadcastOptions()
        host = [_host(t) for t in tensors]
        work = self._gloo.broadcast(host, opts)
        work.wait()
        for t, h in zip(tensors, host):
            _back(t, h)
        return work

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.GatherOptions()
        host_out = [[torch.empty(t.shape, dtype=t.dtype) for t in outs] for outs in outputs]
        work = self._gloo.gather(host_out, [_host(t) for t in inputs], opts)
        work.wait()
        _back_lists(outputs, host_out)
        return work

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ScatterOptions()
        host = [torch.empty(t.shape, dtype=t.dtype) for t in outputs]
        work = self._gloo.scatter(host, [[_host(t) for t in ins] for ins in inputs], opts)
        work.wait()
        for t, h in zip(outputs, host):
            _back(t, h)
        return work

    def barrier(self, opts: Any = None) -> Any:
        work = self._gloo.barrier(opts if opts is not None else dist.BarrierOptions())
        work.wait()
        return work

    # -- identity ---------------------------------------------------------------------------------
    def size(self) -> int:
        return self._world_size

    def _set_group_name(self, name: str) -> None:
        """Keep the name torch gives the group (a Python group has no backend to hold it)."""
        self._group_name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._group_name

    def _get_backend(self, device: torch.device) -> Any:
        """The Gloo group under this one, for any device (``init_process_group(device_id=...)`` asks it
        whether it splits: it does not, so no eager connect is attempted)."""
        return self._gloo

    def getBackendName(self) -> str:
        return NAME

    def __repr__(self) -> str:
        return f"NpuGlooGroup(rank={self._rank}, world_size={self._world_size})"


def _to_allreduce(opts: Any) -> Any:
    """``AllreduceOptions`` with the reduce op (and timeout) of reduce-scatter ``opts``."""
    out = dist.AllreduceOptions()
    out.reduceOp = opts.reduceOp
    if hasattr(opts, "timeout"):
        out.timeout = opts.timeout
    return out


def _as_allreduce(opts: Any) -> Any:
    """``AllreduceCoalescedOptions`` as ``AllreduceOptions``."""
    return _to_allreduce(opts)


def _create(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> NpuGlooGroup:
    return NpuGlooGroup(store, rank, world_size, timeout)


def register() -> str:
    """Register :data:`NAME` with ``torch.distributed`` for ``cpu`` and ``npu`` tensors; idempotent. Returns it."""
    if NAME.upper() not in dist.Backend.__dict__:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", "npu"])
    return NAME
