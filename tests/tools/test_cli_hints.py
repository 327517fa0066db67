"""Each hint a CLI refusal gives, followed, works (the load's own: tests/load/test_first_contact.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import sparse_dcp_load
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt.tools import _cli as cli
from sparse_ckpt.tools import inspect_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_convert_to_flat_with_an_empty_group_follows_its_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW([{"params": model.parameters()}, {"params": [], "lr": 0.3}], lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    src = str(tmp_path / "packed")
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=src, no_dist=True)
    assert cli.main(["convert", src, str(tmp_path / "refused"), "--to", "flat"]) == 1
    assert "pass --drop-empty-groups to drop it" in capsys.readouterr().err
    out = str(tmp_path / "flat")
    assert cli.main(["convert", src, out, "--to", "flat", "--drop-empty-groups"]) == 0
    assert inspect_checkpoint(out)["optimizers"][0]["format"] == "flat"
    target = torch.optim.AdamW(model.parameters(), lr=0.5)
    sparse_dcp_load(out, model, target, no_dist=True)
    assert target.param_groups[0]["lr"] == 0.01
    assert all(torch.equal(target.state[p][k], opt.state[p][k]) for p in model.parameters() for k in opt.state[p])
