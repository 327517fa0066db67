"""``state_layout="buffers"`` and ``"auto"`` (the default) resharding drills on Gloo ranks (spawned,
explicit CPU mesh): a checkpoint saved by 2 ranks (FSDP2 over float32 and bfloat16 layers, expert parallelism 2) loads
bit-exactly -- parameters, state and lr -- into 2 ranks (same layout, then one more step), into
one process, into 4 ranks (expert parallelism 4, an empty FSDP shard) and into 2 ranks that both
hold every expert (expert-parallel degree 1). Both core backends (each test runs on both).
With ``"auto"`` the save's threshold is lowered to :data:`AUTO_BYTES`, so that the float32
``dense.weight`` (largest chunk 72 bytes) and the experts' weights (144 bytes) are items of their
own while the rest is buffered: the drills then read both kinds.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import _backends
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _spawned import (
    DENSE_LR,
    EXPERT_LR,
    assert_matches,
    build_drill,
    cpu_mesh,
    local_view,
    merge_views,
    run_spawned,
    train_drill,
)

import sparse_ckpt as sc
import sparse_ckpt._layouts as layouts
from sparse_ckpt._format.keys import BUFFERS_PREFIX
from sparse_ckpt._layouts import bucketed_load

AUTO_BYTES = 72
"""The ``auto`` threshold of these drills: a 6x6 float32 weight's 3-row chunk (72 bytes) on 2 ranks."""

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _load(path: str, model: Any, opt: sc.MultiOptimizer) -> list[str]:
    """``dcp.load`` of model and optimizer; returns the buffers keys the optimizer read itself."""
    read: list[str] = []
    original = bucketed_load.BucketReader.read

    def recorded(self: Any, keys: list[str], consume: Any) -> None:
        read.extend(keys)
        original(self, keys, consume)

    bucketed_load.BucketReader.read = recorded  # type: ignore[method-assign]
    try:
        msd = model.state_dict()
        dcp.load({"model": msd, "optim": opt}, checkpoint_id=path, planner=sc.SparseLoadPlanner())
        model.load_state_dict(msd)
    finally:
        bucketed_load.BucketReader.read = original  # type: ignore[method-assign]
    return read


def _save_ep2(rank: int, world_size: int, root: str, layout: str) -> None:
    """Save at EP 2 (rank r: experts 2r, 2r+1, the second idle); reload on the same layout and on
    expert parallelism 1 (both ranks hold every expert); one more step."""
    layouts.AUTO_OWN_ITEM_BYTES = AUTO_BYTES
    mesh = cpu_mesh(world_size)
    model, opt = build_drill((2 * rank, 2 * rank + 1), mesh, state_layout=layout)
    train_drill(model, opt, 2, seed=0, rank=rank)
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{root}/ckpt")
    view = local_view(model, opt)
    torch.save(view, f"{root}/ref{rank}.pt")
    md = dcp.FileSystemReader(f"{root}/ckpt").read_metadata()
    optim = [k.removeprefix("optim.") for k in md.state_dict_metadata if k.startswith("optim.state.")]
    per_item = {k for k in optim if not k.startswith(("state.__packed__.", BUFFERS_PREFIX))}
    if layout == "buffers":
        assert not per_item, per_item
    else:  # the chunks of at least AUTO_BYTES, on every rank alike (dense.weight one sharded item)
        big = ["dense.weight", "experts.0.weight", "experts.2.weight"]
        assert per_item == {f"state.{f}.{k}" for f in big for k in ("exp_avg", "exp_avg_sq")}, per_item
        chunks = md.state_dict_metadata["optim.state.dense.weight.exp_avg"].chunks
        assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (3, 0)]
    # per rank: a layout per leaf, one buffer per (leaf, dtype): dense holds float32 and bfloat16;
    # and one layout index per leaf, the same on every rank (written once)
    assert len([k for k in optim if k.startswith(BUFFERS_PREFIX)]) == world_size * (2 + 3) + 2

    model2, opt2 = build_drill((2 * rank, 2 * rank + 1), mesh, seed=7)
    read = _load(f"{root}/ckpt", model2, opt2)
    assert read and all(k.endswith(f"w2r{rank}") for k in read), read  # only this rank's own buffers
    assert len(read) == 3
    assert_matches(local_view(model2, opt2), view, f"rank {rank} 2 -> 2")
    assert not opt2["experts"].state.get(model2.experts[str(2 * rank + 1)].weight)
    dist.barrier()  # both references written
    _load_ep(rank, world_size, root, 4, "2 -> 2, expert parallelism 1")  # own layout lacks the other experts
    train_drill(model, opt, 1, seed=50, rank=rank)
    train_drill(model2, opt2, 1, seed=50, rank=rank)
    assert_matches(local_view(model2, opt2), local_view(model, opt), f"rank {rank} next step")


def _load_ep(rank: int, world_size: int, root: str, experts_per_rank: int, label: str) -> None:
    """Load into ``world_size`` ranks that each hold ``experts_per_rank``-wide slices of experts
    (all four on every rank when it is 4) and compare with the saved references."""
    mesh = cpu_mesh(world_size)
    first = (rank * experts_per_rank) % 4
    model, opt = build_drill(range(first, first + experts_per_rank), mesh, seed=9)
    _load(f"{root}/ckpt", model, opt)
    reference = merge_views([torch.load(f"{root}/ref{r}.pt") for r in range(2)])
    assert_matches(local_view(model, opt), reference, f"rank {rank} {label}")
    assert [g["lr"] for g in opt["dense"].param_groups] == [DENSE_LR]
    assert [g["lr"] for g in opt["experts"].param_groups] == [EXPERT_LR]
    dist.barrier()


@_backends.ranks
@pytest.mark.parametrize("layout", ["buffers", "auto"])
def test_resharding_drills(tmp_path: Path, layout: str) -> None:
    root = str(tmp_path)
    run_spawned(_save_ep2, 2, root, layout)
    reference = merge_views([torch.load(f"{root}/ref{r}.pt") for r in range(2)])
    assert sorted(reference) == sorted(
        ["dense.weight", "dense.bias", "proj.weight", "proj.bias"]
        + [f"experts.{i}.{p}" for i in range(4) for p in ("weight", "bias")]
    )

    # 2 -> 1: one process, no process group, every expert
    model, opt = build_drill(range(4), None, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load(f"{root}/ckpt", model, opt)
    assert_matches(local_view(model, opt), reference, "2 -> 1")
    assert sorted(n for n, p in model.named_parameters() if opt["experts"].state.get(p)) == [
        "experts.0.bias",
        "experts.0.weight",
        "experts.2.bias",
        "experts.2.weight",
    ]

    run_spawned(_load_ep, 4, root, 1, "2 -> 4, expert parallelism 4")
