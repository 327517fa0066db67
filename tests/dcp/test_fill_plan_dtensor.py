"""The speculative bucket fill (`sparse_ckpt._save.fill_plan`) with DTensor parameters, as FSDP2 makes
them (one-process Gloo group, 1-rank CPU mesh): a state DTensor's local tensor is the same object from
save to save, so the second ``dcp.async_save`` uses the copy its capture started, with autograd on as
in a training loop; the checkpoint restores exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, dcp_loaded_adamw, snapshot_optimizer
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import sparse_ckpt as sc

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(mesh: object, placement: object) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    for i in range(6):
        model.register_parameter(f"w{i}", nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [placement])))
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements)
    opt.step()


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard", "replicate"])
def test_dtensor_state_uses_the_copy(tmp_path: Path, takes: list[bool], mesh: object, placement: object) -> None:
    model = _model(mesh, placement)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    state = sc.SparseOptimizerState(model, opt)
    assert torch.is_grad_enabled()
    for name in ("a", "b", "c"):
        at_save = snapshot_optimizer(opt)
        dcp.async_save({"optim": state}, checkpoint_id=tmp_path / name).result()
        assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / name, model), grads=False)
        _step(model, opt)
    assert takes == [False, True, True]
