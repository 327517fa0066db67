"""A loader that does not know sparse_ckpt's format is refused while DCP plans, never half-loads.

Foreign loaders are the ones trainers use: torch DSD's flat layout as the load target (VeOmni's
``DistributedCheckpointer`` with ``allow_partial_load=True``, torchtitan's flat optimizer dict) and
DSD's nested layout (Accelerate, DSD's default). Their targets hold a number at
``param_groups.<fqn>.lr`` / ``param_groups.0.lr``; the checkpoint's foreign-loader guards hold an
empty tensor there, so DCP refuses the plan before it reads anything.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import sparse_ckpt as sc
from sparse_ckpt import tools
from sparse_ckpt._format.keys import NESTED_GUARD_KEY, foreign_guard_keys, is_foreign_guard


def _model() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(3, 3) for _ in range(2)), "vision": nn.Linear(3, 3)})


def _opt(model: nn.ModuleDict) -> sc.MultiOptimizer:
    return sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(model["experts"].parameters(), lr=0.01),
            "vision": torch.optim.AdamW(model["vision"].parameters(), lr=0.01),
        },
    )


def _saved(path: Path) -> tuple[nn.ModuleDict, sc.MultiOptimizer]:
    model, opt = _model(), None
    opt = _opt(model)
    opt["vision"].param_groups[0]["lr"] = 0.0025  # never steps; a scheduler moved its lr
    for _ in range(3):
        opt.zero_grad()
        model["experts"][0](torch.randn(2, 3)).sum().backward()
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"optimizer": opt}, checkpoint_id=str(path))
    return model, opt


def _foreign_target(model: nn.Module, opt: torch.optim.Optimizer, flat: bool) -> dict:
    """What a trainer's stock loader builds (DSD runs its synthetic step on the fresh optimizer)."""
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))


@pytest.mark.parametrize("flat", [True, False], ids=["dsd-flat", "dsd-nested"])
@pytest.mark.parametrize("partial", [True, False], ids=["allow_partial_load", "strict"])
def test_foreign_loader_is_refused_before_reading(tmp_path: Path, flat: bool, partial: bool) -> None:
    _saved(tmp_path)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    target = {"optimizer": _foreign_target(model, opt, flat)}
    before = {k: v.clone() for k, v in opt.state[next(iter(opt.state))].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(CheckpointException, match=r"optimizer\.(param_groups|state)\.") as err:
            dcp.load(target, checkpoint_id=str(tmp_path), planner=DefaultLoadPlanner(allow_partial_load=partial))
    if partial:  # the guard is what refuses it (a strict loader already fails on a missing key)
        assert "param_groups" in str(err.value) and ".lr" in str(err.value)
    after = opt.state[next(iter(opt.state))]
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was read into the live state


def test_without_guards_a_partial_foreign_load_is_silently_wrong(tmp_path: Path) -> None:
    """The documented limit: a dict saved by hand (``sparse_state_dict``, no Stateful) has no guard."""
    model, opt = _saved(tmp_path / "guarded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"optimizer": sc.sparse_state_dict(model, opt)}, checkpoint_id=str(tmp_path / "bare"))
        model2 = _model()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
        target = {"optimizer": _foreign_target(model2, opt2, True)}
        dcp.load(target, checkpoint_id=str(tmp_path / "bare"), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert target["optimizer"]["param_groups.vision.weight.lr"] == 0.01  # not the saved 0.0025
    assert int(target["optimizer"]["state.experts.0.weight.step"]) == 1  # invented, not the saved 3
    report = tools.inspect_checkpoint(tmp_path / "bare")["optimizers"][0]
    assert report["foreign_guards"] == 0 and "no foreign-loader guard" in report["loader"]


def test_own_loaders_skip_the_guards(tmp_path: Path) -> None:
    model, opt = _saved(tmp_path)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    guards = sorted(k for k, v in md.state_dict_metadata.items() if is_foreign_guard(k, v))
    assert guards == sorted(f"optimizer.{k}" for k in foreign_guard_keys(["experts.0.weight", "vision.weight"]))

    model2 = _model()
    opt2 = _opt(model2)
    dcp.load({"optimizer": opt2}, checkpoint_id=str(tmp_path), planner=sc.SparseLoadPlanner())
    assert opt2["vision"].param_groups[0]["lr"] == 0.0025 and not opt2["vision"].state
    assert int(opt2["experts"].state[model2["experts"][0].weight]["step"]) == 3

    # the Stateful's own dict (guards included) loads as a plain dict too
    sd = dict(sc.SparseOptimizerState(model, opt).state_dict())
    assert is_foreign_guard(NESTED_GUARD_KEY, sd[NESTED_GUARD_KEY])
    model3 = _model()
    opt3 = _opt(model3)
    sc.SparseOptimizerState(model3, opt3).load_state_dict(sd)
    assert opt3["vision"].param_groups[0]["lr"] == 0.0025 and not opt3["vision"].state

    report = tools.inspect_checkpoint(tmp_path)["optimizers"][0]
    assert report["foreign_guards"] == 3 and "other loaders are refused" in report["loader"]
    assert (
        report["items"] == len([k for k in md.state_dict_metadata if k.startswith("optimizer.")]) - 3 - 1
    )  # guards, planner guard
    verify = tools.verify_checkpoint(tmp_path)
    assert verify["ok"] and "SparseLoadPlanner" in verify["loaders"]["optimizer"]
