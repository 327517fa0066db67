"""The emulated npu's process-group backend (``npu_gloo``, tests/accelerator/emulated_npu_pg.py): on two ranks,
each on ``npu:<rank>``, every collective FSDP2 and DCP call gives the values the collective defines, in ``npu``
outputs, for sum and average. Runs where the ``npu`` type is the emulated one (``.ci/npu.sh``); skipped elsewhere.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import guarded

from bench.drills import ranks


def _collectives(rank: int, world_size: int) -> None:
    device = torch.device("npu", rank)
    assert dist.get_backend() == "npu_gloo"

    def filled(value: float, n: int = 4) -> torch.Tensor:
        return torch.full((n,), float(value), device=device)

    t = filled(rank + 1.0)
    dist.all_reduce(t)
    assert t.device == device and t.tolist() == [3.0] * 4
    t = filled(rank + 1.0)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.tolist() == [1.5] * 4
    t = filled(rank + 1.0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [2.0] * 4

    out = torch.empty(2 * world_size, device=device)
    dist.all_gather_into_tensor(out, torch.arange(2.0, device=device) + 10 * rank)
    assert out.device == device and out.tolist() == [0.0, 1.0, 10.0, 11.0]
    outs = [torch.empty(3, device=device) for _ in range(world_size)]
    dist.all_gather(outs, filled(rank, 3))
    assert [o.tolist() for o in outs] == [[0.0] * 3, [1.0] * 3]

    src = torch.arange(4.0, device=device) * (rank + 1)  # rank 0: 0 1 2 3; rank 1: 0 2 4 6
    shard = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(shard, src)
    assert shard.device == device and shard.tolist() == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])
    dist.reduce_scatter_tensor(shard, src, op=dist.ReduceOp.AVG)
    assert shard.tolist() == ([0.0, 1.5] if rank == 0 else [3.0, 4.5])
    shard = torch.empty(2, device=device)
    dist.reduce_scatter(shard, list(src.chunk(world_size)))
    assert shard.tolist() == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])

    t = filled(rank + 7.0)
    dist.broadcast(t, src=1)
    assert t.tolist() == [8.0] * 4
    gathered = [torch.empty(4, device=device) for _ in range(world_size)] if rank == 0 else None
    dist.gather(filled(rank), gathered, dst=0)
    if rank == 0:
        assert [g.tolist() for g in gathered] == [[0.0] * 4, [1.0] * 4]
    got = torch.empty(4, device=device)
    dist.scatter(got, [filled(5.0), filled(6.0)] if rank == 0 else None, src=0)
    assert got.tolist() == [5.0 + rank] * 4

    objs: list[object] = [None] * world_size
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": 0}, {"rank": 1}]
    box = [{"from": rank}]
    dist.broadcast_object_list(box, src=1)
    assert box == [{"from": 1}]
    cpu = torch.full((2,), float(rank))  # CPU tensors go to Gloo as they are
    dist.all_reduce(cpu)
    assert cpu.tolist() == [1.0, 1.0]
    dist.barrier()


def test_npu_gloo_collectives(device_type: str) -> None:
    """Two ranks on ``npu:0`` and ``npu:1``: the collectives' values, in place on the device."""
    if device_type != "npu" or not getattr(torch.get_device_module("npu"), "emulated", False):
        pytest.skip("npu_gloo is the emulated npu's backend (.ci/npu.sh); a real device has its own")
    if torch.get_device_module("npu").device_count() < 2:
        pytest.skip("needs two npu devices")
    with tempfile.TemporaryDirectory(prefix="npu-gloo-") as err_dir:
        ranks.run_ranks(guarded(_collectives), 2, err_dir=str(Path(err_dir)), timeout=120.0, device="npu")
