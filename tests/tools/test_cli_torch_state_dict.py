"""The CLI on what users already have: ``dcp.save({"optim": optimizer.state_dict()})`` (int ids).
``inspect`` describes it and what loads it; ``convert`` converts it by FQN given the parameters'
FQNs (``--fqns``), or says precisely what it needs; the converted checkpoint loads by FQN."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import sparse_dcp_load
from torch import nn

from sparse_ckpt.errors import PositionalLoadWarning
from sparse_ckpt.tools import _cli as cli
from sparse_ckpt.tools import inspect_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def model_and_ckpt(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model[1](torch.randn(3, 4)).sum().backward()
    opt.step()
    path = str(tmp_path / "torch")
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path, no_dist=True)
    return model, opt, path


def test_inspect_describes_a_torch_state_dict_and_what_loads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _model, _opt, path = model_and_ckpt(tmp_path)
    [summary] = inspect_checkpoint(path)["optimizers"]
    assert summary["format"] == "torch" and summary["params"] == 4 and summary["with_state"] == 2
    assert "by position" in summary["loader"] and "--fqns FILE" in summary["loader"]
    assert cli.main(["inspect", path]) == 0
    assert "torch format" in capsys.readouterr().out


def test_convert_says_what_it_needs_and_converts_when_given_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt, path = model_and_ckpt(tmp_path)
    assert cli.main(["convert", path, str(tmp_path / "out"), "--to", "packed"]) == 2
    err = capsys.readouterr().err
    assert "FQNs of its 4 parameter(s) in the optimizer's order" in err and "--fqns FILE" in err
    # What it needs, written as the message says:
    names = [name for g in opt.param_groups for p in g["params"] for name, q in model.named_parameters() if q is p]
    fqns = tmp_path / "fqns.txt"
    fqns.write_text("\n".join(names[:3]) + "\n")
    assert cli.main(["convert", path, str(tmp_path / "short"), "--to", "packed", "--fqns", str(fqns)]) == 2
    assert "3 FQN(s) given for the 4 parameter(s)" in capsys.readouterr().err
    fqns.write_text("\n".join(names) + "\n")
    out = str(tmp_path / "out")
    assert cli.main(["convert", path, out, "--to", "packed", "--fqns", str(fqns)]) == 0
    assert inspect_checkpoint(out)["optimizers"][0]["format"] == "packed"
    # The converted checkpoint loads by FQN (no positions), even into other groups.
    torch.manual_seed(1)
    target_model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    target = torch.optim.AdamW(
        [{"params": target_model[1].parameters()}, {"params": target_model[0].parameters()}], lr=0.5
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PositionalLoadWarning)
        sparse_dcp_load(out, target_model, target, no_dist=True)
    ref = torch.optim.AdamW(target_model.parameters(), lr=0.5)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["lr"] for g in target.param_groups] == [0.01, 0.01]
    for p in target_model[1].parameters():
        assert all(torch.equal(target.state[p][k], ref.state[p][k]) for k in ref.state[p])
    assert not any(p in target.state for p in target_model[0].parameters())


def test_convert_names_a_torch_state_dict_by_its_saved_param_names(tmp_path: Path) -> None:
    """torch's named optimizers save ``param_names``: convert needs nothing more."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = str(tmp_path / "named")
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path, no_dist=True)
    out = str(tmp_path / "out")
    assert cli.main(["convert", path, out, "--to", "flat"]) == 0
    target = torch.optim.AdamW(model.parameters(), lr=0.5)
    sparse_dcp_load(out, model, target, no_dist=True)
    assert target.param_groups[0]["lr"] == 0.01 and len(target.state) == 2
