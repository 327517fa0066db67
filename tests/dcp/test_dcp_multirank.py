"""Multi-rank DCP on CPU/Gloo in real processes: FSDP2, world-size changes, expert parallelism.

Each scenario starts its process group once (``_dist.run_ranks``) and runs all its checks inside;
workers assert, and a failing rank fails the test with its traceback.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import _backends
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import (  # the FSDP2 model and its builders, full snapshots
    HEAD_LR,
    MULTI_RANK,
    assert_snapshots_equal,
    assert_state_placed_like_params,
    build_fsdp,
    full_snapshot,
    run_ranks,
    train_body,
    trained_fsdp,
)
from torch import nn
from torch.distributed.tensor import DTensor

import sparse_ckpt as sc
from sparse_ckpt.tools import inspect_checkpoint

pytestmark = MULTI_RANK


# --------------------------------------------------------------------------- save, load (snapshots: tests/_dist.py)


def save(path: str, model: nn.Module, opt: sc.MultiOptimizer) -> None:
    dcp.save({"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=path)


def load(path: str, model: nn.Module, opt: sc.MultiOptimizer) -> None:
    msd = model.state_dict()
    dcp.load(
        {"model": msd, "optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=path, planner=sc.SparseLoadPlanner()
    )
    model.load_state_dict(msd)


# --------------------------------------------------------------------------- (a) FSDP2 resume


def _fsdp_resume(rank: int, world_size: int, ckpt: str) -> None:
    model, opt = trained_fsdp(sharded=True)
    before = full_snapshot(model, opt)
    local_before = [p.to_local().clone() for p in model.parameters()]
    save(ckpt, model, opt)
    assert_snapshots_equal(full_snapshot(model, opt), before, "source after save", state_key_order=False)
    assert all(torch.equal(a, p.to_local()) for a, p in zip(local_before, model.parameters()))
    assert not opt["head"].state

    model2, opt2 = build_fsdp(seed=1, sharded=True)
    assert not torch.equal(model2.layers[0].weight.to_local(), model.layers[0].weight.to_local())
    load(ckpt, model2, opt2)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p.to_local(), p2.to_local()), f"rank {rank}: shard of {name}"
    assert [g["lr"] for g in opt2["head"].param_groups] == [HEAD_LR], f"rank {rank}"
    assert not opt2["head"].state, f"rank {rank}: the never-stepped leaf got state"
    for p, p2 in zip(model.layers.parameters(), model2.layers.parameters()):
        for k, v in opt["body"].state[p].items():
            v2 = opt2["body"].state[p2][k]
            local = v.to_local() if isinstance(v, DTensor) else v
            local2 = v2.to_local() if isinstance(v2, DTensor) else v2
            assert torch.equal(local, local2), f"rank {rank}: state {k}"
    assert_state_placed_like_params(model2, opt2)
    assert_snapshots_equal(full_snapshot(model2, opt2), before, "loaded", state_key_order=False)

    train_body(model, opt, 1, seed=100)
    train_body(model2, opt2, 1, seed=100)
    assert_snapshots_equal(full_snapshot(model2, opt2), full_snapshot(model, opt), "next step", state_key_order=False)


@_backends.ranks
def test_fsdp2_two_ranks_resume(tmp_path: Path) -> None:
    run_ranks(_fsdp_resume, 2, str(tmp_path / "ckpt"))


# --------------------------------------------------------------------------- (b) world-size changes


def _save_sharded(rank: int, world_size: int, ckpt: str, ref: str) -> None:
    model, opt = trained_fsdp(sharded=True)
    snap = full_snapshot(model, opt)
    save(ckpt, model, opt)
    if rank == 0:
        torch.save(snap, ref)


def _load_resharded(rank: int, world_size: int, sources: list[tuple[str, str]], ckpt: str, ref: str) -> None:
    for src, src_ref in sources:
        model, opt = build_fsdp(seed=5, sharded=True)
        load(src, model, opt)
        where = f"rank {rank} loading {src}"
        assert_snapshots_equal(full_snapshot(model, opt), torch.load(src_ref), where, state_key_order=False)
        assert not opt["head"].state
        assert_state_placed_like_params(model, opt)
    train_body(model, opt, 1, seed=200)
    snap = full_snapshot(model, opt)
    save(ckpt, model, opt)
    if rank == 0:
        torch.save(snap, ref)


@_backends.ranks
def test_world_size_changes(tmp_path: Path) -> None:
    """1 -> 2, 4 -> 2 and 2 -> 1 (a plain, unsharded model in a process without a process group)."""
    ck1, ck2, ck4 = (str(tmp_path / f"ws{n}") for n in (1, 2, 4))
    model, opt = trained_fsdp(sharded=False)
    torch.save(full_snapshot(model, opt), tmp_path / "ref1.pt")
    save(ck1, model, opt)

    run_ranks(_save_sharded, 4, ck4, str(tmp_path / "ref4.pt"))
    run_ranks(
        _load_resharded,
        2,
        [(ck4, str(tmp_path / "ref4.pt")), (ck1, str(tmp_path / "ref1.pt"))],
        ck2,
        str(tmp_path / "ref2.pt"),
    )

    model, opt = build_fsdp(seed=9, sharded=False)
    load(ck2, model, opt)
    assert_snapshots_equal(full_snapshot(model, opt), torch.load(tmp_path / "ref2.pt"), "2 -> 1", state_key_order=False)
    assert not opt["head"].state and [g["lr"] for g in opt["head"].param_groups] == [HEAD_LR]
    assert_state_placed_like_params(model, opt)


# --------------------------------------------------------------------------- (c) expert parallelism


class EPNet(nn.Module):
    """A shared layer (same on every rank) and this rank's experts ``experts.{2r}``, ``experts.{2r+1}``."""

    def __init__(self, rank: int, seed: int, extra: tuple[int, ...] = ()) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shared = nn.Linear(4, 4)
        torch.manual_seed(seed * 100 + rank + 1)
        self.experts = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in (2 * rank, 2 * rank + 1, *extra)})
        self.active = str(2 * rank)  # expert 2r+1 never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[self.active](torch.tanh(self.shared(x)))


def expert_lr(rank: int) -> float:
    return 0.001 * (rank + 1)


def build_ep(rank: int, seed: int, extra: tuple[int, ...] = ()) -> tuple[EPNet, sc.MultiOptimizer]:
    model = EPNet(rank, seed, extra)
    opt = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(model.experts.parameters(), lr=0.5),
            "shared": torch.optim.AdamW(model.shared.parameters(), lr=0.5),
        },
    )
    return model, opt


def train_ep(model: EPNet, opt: sc.MultiOptimizer, steps: int, seed: int) -> None:
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + i))
        model(x).pow(2).mean().backward()
        for p in model.shared.parameters():  # data parallel over the shared layer
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()


def _expert_parallel(rank: int, world_size: int, ckpt: str) -> None:
    model, opt = build_ep(rank, seed=0)
    for leaf, lr in (("experts", expert_lr(rank)), ("shared", 0.01)):
        for group in opt[leaf].param_groups:
            group["lr"] = lr
    train_ep(model, opt, 2, seed=0)
    st = sc.SparseOptimizerState(model, opt)
    dcp.save({"model": model.state_dict(), "app": {"optim": st.state_dict()}}, checkpoint_id=ckpt)

    tables = [k for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata if "__packed__" in k]
    for kind in ("param_groups", "state"):  # group tables and scalar (step) tables
        assert len([k for k in tables if f".{kind}.__packed__.experts." in k]) == 2, tables  # one per rank
        assert len([k for k in tables if f".{kind}.__packed__.shared." in k]) == 1, tables  # identical: written once

    model2, opt2 = build_ep(rank, seed=9)
    st2 = sc.SparseOptimizerState(model2, opt2)
    target = {"model": model2.state_dict(), "app": {"optim": st2.state_dict()}}
    dcp.load(target, checkpoint_id=ckpt, planner=sc.SparseLoadPlanner())
    model2.load_state_dict(target["model"])
    planned = target["app"]["optim"]
    other = {str(2 * (1 - rank)), str(2 * (1 - rank) + 1)}
    assert not [k for k in planned if k.startswith("state.experts.") and k.split(".")[2] in other], list(planned)
    assert len([k for k in planned if "__packed__" in k]) == 6  # every rank's group and scalar tables are read
    st2.load_state_dict(planned)

    assert [g["lr"] for g in opt2["experts"].param_groups] == [expert_lr(rank)]
    assert [g["lr"] for g in opt2["shared"].param_groups] == [0.01]
    own, idle = model.experts[str(2 * rank)], model2.experts[str(2 * rank + 1)]
    for p, p2 in zip(own.parameters(), model2.experts[str(2 * rank)].parameters()):
        for k, v in opt["experts"].state[p].items():
            assert torch.equal(v, opt2["experts"].state[p2][k]), f"rank {rank}: {k}"
    assert not any(opt2["experts"].state.get(p) for p in idle.parameters())
    for p, p2 in zip(model.shared.parameters(), model2.shared.parameters()):
        assert all(torch.equal(v, opt2["shared"].state[p2][k]) for k, v in opt["shared"].state[p].items())
    train_ep(model, opt, 1, seed=50)
    train_ep(model2, opt2, 1, seed=50)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2), f"rank {rank}: next step differs"

    # A local parameter the checkpoint lacks still fails (strict), naming it.
    model3, opt3 = build_ep(rank, seed=9, extra=(8 + rank,))
    st3 = sc.SparseOptimizerState(model3, opt3)
    target3 = {"app": {"optim": st3.state_dict()}}
    dcp.load(target3, checkpoint_id=ckpt, planner=sc.SparseLoadPlanner())
    with pytest.raises(sc.CheckpointMismatchError, match=rf"experts\.{8 + rank}\.weight"):
        st3.load_state_dict(target3["app"]["optim"])
    assert not opt3["experts"].state


@_backends.ranks
def test_expert_parallel_tables(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ep")
    run_ranks(_expert_parallel, 2, ckpt)

    # One process, all four experts: every rank's table and state merge; per-rank groups keep their lr.
    model = nn.Module()
    model.shared = nn.Linear(4, 4)
    model.experts = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(4)})
    groups = [
        {"params": [*model.experts[str(2 * r)].parameters(), *model.experts[str(2 * r + 1)].parameters()]}
        for r in range(2)
    ]
    opt = sc.MultiOptimizer(
        model, {"experts": torch.optim.AdamW(groups), "shared": torch.optim.AdamW(model.shared.parameters())}
    )
    st = sc.SparseOptimizerState(model, opt)
    target = {"app": {"optim": st.state_dict()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=ckpt, planner=sc.SparseLoadPlanner())
    st.load_state_dict(target["app"]["optim"])
    assert [g["lr"] for g in opt["experts"].param_groups] == [expert_lr(0), expert_lr(1)]
    with_state = sorted(n for n, p in model.named_parameters() if opt["experts"].state.get(p))
    assert with_state == ["experts.0.bias", "experts.0.weight", "experts.2.bias", "experts.2.weight"]

    # The CLI's reader merges the ranks' tables of one leaf and flags that their settings differ.
    [report] = inspect_checkpoint(ckpt)["optimizers"]
    assert report["key"] == "app.optim"
    experts = next(leaf for leaf in report["leaves"] if leaf["name"] == "experts")
    assert (experts["params"], experts["with_state"], experts["without_state"]) == (8, 4, 4)
    assert experts["groups"][0]["settings_vary_across_tables"] is True
