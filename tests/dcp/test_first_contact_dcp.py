"""What a new user meets first, through DCP: ``dcp.save({"optim": optimizer.state_dict()})`` loads into
`SparseOptimizerState` / `MultiOptimizer` by position (or is refused saying what it is), a checkpoint
that matches nothing or was written by another optimizer class is refused in every mode and layout,
and one rank's pickled ``sparse_state_dict()`` is refused on another rank. (In memory:
tests/load/test_first_contact.py.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import _backends
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import build_fsdp, run_ranks, trained_fsdp
from helpers import assert_deep_equal, snapshot_optimizer
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt.errors import PositionalLoadWarning

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Net(nn.Module):
    def __init__(self, seed: int = 0, name: str = "experts") -> None:
        super().__init__()
        torch.manual_seed(seed)
        setattr(self, name, nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)


class Wrapped(nn.Module):
    """A `Net` under ``name``: renaming it renames every parameter."""

    def __init__(self, seed: int, name: str) -> None:
        super().__init__()
        setattr(self, name, Net(seed))


def stepped(opt_cls: type = torch.optim.AdamW, name: str = "experts") -> tuple[Net, torch.optim.Optimizer]:
    """``head`` stepped once (``experts`` has no state), lr 0.01."""
    model = Net(0, name)
    opt = opt_cls(model.parameters(), lr=0.01)
    model.head(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def save(path: Path, value: Any) -> str:
    dcp.save({"optim": value}, checkpoint_id=str(path), no_dist=True)
    return str(path)


def load(path: str, model: nn.Module, opt: Any, **kw: Any) -> None:
    target = opt if isinstance(opt, sc.MultiOptimizer) else sc.SparseOptimizerState(model, opt, **kw)
    dcp.load({"optim": target}, checkpoint_id=path, planner=sc.SparseLoadPlanner(), no_dist=True)


def same_state(a: Any, b: Any) -> None:
    sa, sb = snapshot_optimizer(a), snapshot_optimizer(b)
    for la, lb in zip(sa.values(), sb.values()):
        for part in ("groups", "state"):
            assert_deep_equal(la[part], lb[part], part)


def refused(path: str, model: nn.Module, opt: Any, match: str, **kw: Any) -> str:
    before = snapshot_optimizer(opt)
    with pytest.raises(sc.CheckpointMismatchError, match=match) as info:
        load(path, model, opt, **kw)
    assert_deep_equal(snapshot_optimizer(opt), before)
    return str(info.value)


# --------------------------------------------------------------------------- torch's own dict through DCP


@pytest.mark.parametrize("strict", [True, False])
def test_dcp_saved_torch_state_dict_loads_by_position(tmp_path: Path, strict: bool) -> None:
    _src_model, src = stepped()
    path = save(tmp_path / "ckpt", src.state_dict())
    model = Net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    with pytest.warns(PositionalLoadWarning, match="by position"):
        load(path, model, opt, strict=strict)
    ref = torch.optim.AdamW(model.parameters(), lr=0.5)
    ref.load_state_dict(copy.deepcopy(src.state_dict()))
    assert opt.param_groups[0]["lr"] == 0.01 and len(opt.state) == 2
    same_state(opt, ref)
    # ... and into a MultiOptimizer of the same groups, leaf after leaf
    model2 = Net(1)
    multi = sc.MultiOptimizer(
        model2,
        {
            "experts": torch.optim.AdamW(model2.experts.parameters(), lr=0.5),
            "head": torch.optim.AdamW(model2.head.parameters(), lr=0.5),
        },
    )
    two_groups = torch.optim.AdamW(
        [{"params": src.param_groups[0]["params"][:2]}, {"params": src.param_groups[0]["params"][2:]}], lr=0.01
    )
    two_groups.load_state_dict(
        {
            **src.state_dict(),
            "param_groups": [
                {**src.state_dict()["param_groups"][0], "params": [0, 1]},
                {**src.state_dict()["param_groups"][0], "params": [2, 3]},
            ],
        }
    )
    path2 = save(tmp_path / "ckpt2", two_groups.state_dict())
    with pytest.warns(PositionalLoadWarning, match=r"\[2, 2\]"):
        load(path2, model2, multi)
    assert not multi["experts"].state and len(multi["head"].state) == 2
    for p, p_ref in zip(model2.head.parameters(), model.head.parameters()):
        assert all(torch.equal(multi["head"].state[p][k], ref.state[p_ref][k]) for k in ref.state[p_ref])


def test_dcp_saved_torch_state_dict_that_never_stepped_loads_its_groups(tmp_path: Path) -> None:
    """DCP writes no item for the empty ``state``: the groups alone are still that optimizer's."""
    path = save(tmp_path / "ckpt", torch.optim.AdamW(Net().parameters(), lr=0.01).state_dict())
    model = Net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    with pytest.warns(PositionalLoadWarning):
        load(path, model, opt)
    assert opt.param_groups[0]["lr"] == 0.01 and not opt.state


def test_dcp_saved_torch_state_dict_whose_groups_disagree_is_refused_in_every_mode(tmp_path: Path) -> None:
    _src_model, src = stepped()
    path = save(tmp_path / "ckpt", src.state_dict())
    model = Net(1)
    split = torch.optim.AdamW([{"params": model.experts.parameters()}, {"params": model.head.parameters()}], lr=0.5)
    for strict in (True, False):
        message = refused(path, model, split, r"torch optimizer\.state_dict\(\)", strict=strict)
        assert "1 param group(s) of [4] parameters" in message
    built_as_saved = torch.optim.AdamW(model.parameters(), lr=0.5)  # the hint, followed
    with pytest.warns(PositionalLoadWarning):
        load(path, model, built_as_saved)
    assert built_as_saved.param_groups[0]["lr"] == 0.01 and len(built_as_saved.state) == 2


# --------------------------------------------------------------------------- nothing matched, another class


@pytest.mark.parametrize(
    ("fmt", "layout"), [("packed", "auto"), ("packed", "per_tensor"), ("packed", "buffers"), ("flat", "per_tensor")]
)
def test_a_renamed_module_is_refused_in_every_mode_and_layout(tmp_path: Path, fmt: str, layout: str) -> None:
    src_model = Wrapped(0, "experts")
    src = torch.optim.AdamW(src_model.parameters(), lr=0.01)
    src_model.experts.head(torch.randn(3, 4)).sum().backward()
    src.step()
    path = save(tmp_path / "ckpt", sc.SparseOptimizerState(src_model, src, format=fmt, state_layout=layout))
    model = Wrapped(1, "moe")
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    for strict in (True, False):
        message = refused(path, model, opt, r"none of the checkpoint's 4 saved parameter", strict=strict)
        assert "'experts.experts.weight'" in message and "'moe.experts.weight'" in message
    named = Wrapped(1, "experts")  # the hint: a model whose parameters have the saved names
    opt2 = torch.optim.AdamW(named.parameters(), lr=0.5)
    load(path, named, opt2)
    same_state(opt2, src)


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_another_optimizer_class_is_refused_through_dcp(tmp_path: Path, fmt: str) -> None:
    src_model, src = stepped(torch.optim.AdamW)
    path = save(tmp_path / "ckpt", sc.SparseOptimizerState(src_model, src, format=fmt))
    model = Net(1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    message = refused(path, model, sgd, r"another optimizer class than torch\.optim\.SGD")
    assert "'betas'" in message and "'momentum'" in message
    multi = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(model.experts.parameters(), lr=0.5),
            "head": torch.optim.SGD(model.head.parameters(), lr=0.5, momentum=0.9),
        },
    )
    refused(path, model, multi, r"leaf 'head' group 0: .*another optimizer class than torch\.optim\.SGD")
    load(path, model, sgd, strict=False)  # the hint: the saved settings, SGD's own momentum kept
    assert sgd.param_groups[0]["lr"] == 0.01 and sgd.param_groups[0]["momentum"] == 0.9
    model.head(torch.randn(3, 4)).sum().backward()
    sgd.step()


# --------------------------------------------------------------------------- one rank's pickled dict


def _pickle_each_rank(rank: int, world_size: int, out: str, single: str) -> None:
    model, opt = trained_fsdp(sharded=True)
    sd = sc.sparse_state_dict(model, opt)
    torch.save(sd, f"{out}.{rank}")
    torch.distributed.barrier()
    model2, opt2 = build_fsdp(seed=1, sharded=True)
    other = torch.load(f"{out}.{1 - rank}", weights_only=False)
    with pytest.raises(
        sc.CrossRankStateError, match=rf"made on rank {1 - rank} of 2 and is being loaded on rank {rank} of 2"
    ):
        sc.load_sparse_state_dict(model2, opt2, other)
    assert not opt2["body"].state
    sc.load_sparse_state_dict(model2, opt2, torch.load(f"{out}.{rank}", weights_only=False))  # its own rank's: loads
    assert opt2["body"].state
    # A single process's dict carries no record: it loads on any rank.
    plain_model, plain_opt = build_fsdp(seed=1, sharded=False)
    sc.load_sparse_state_dict(plain_model, plain_opt, torch.load(single, weights_only=True))
    assert plain_opt["body"].state


@_backends.ranks
@pytest.mark.usefixtures("forbid_fork")
def test_one_ranks_pickled_sparse_state_dict_is_refused_elsewhere(tmp_path: Path) -> None:
    model, opt = trained_fsdp(sharded=False)
    single = str(tmp_path / "single.pt")
    torch.save(sc.sparse_state_dict(model, opt), single)
    out = str(tmp_path / "rank.pt")
    run_ranks(_pickle_each_rank, 2, out, single)
    target_model, target = build_fsdp(seed=1, sharded=False)
    with pytest.raises(sc.CrossRankStateError, match="made on rank 1 of 2 and is being loaded on rank 0 of 1"):
        sc.load_sparse_state_dict(target_model, target, torch.load(f"{out}.1", weights_only=False))
    assert not target["body"].state
