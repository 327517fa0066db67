"""torch DSD's *nested* optimizer dict (``get_optimizer_state_dict``'s default, Accelerate's FSDP2
layout) is read, not refused: in memory by ``load_sparse_state_dict``, from DCP by
``SparseLoadPlanner``, and by the CLI (``inspect``, ``verify``, ``diff``, ``convert``) -- by FQN, every
group's settings, the state the dict holds and no other. Also the origin record that keeps one
rank's dict from being loaded on another (single process here; two ranks in test_accelerate.py).
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_deep_equal, fqn_view, sparse_dcp_load
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import sparse_ckpt as sc
from sparse_ckpt import tools
from sparse_ckpt._dcp.origin import ORIGIN_KEY
from sparse_ckpt._format.nested import nested_kind, nested_to_sparse
from sparse_ckpt.tools import _cli as cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SAME = {"check_order": False, "nan_equal": "none", "mapping": dict}
"""DSD puts ``params`` first in the groups it loads, torch last: compare without key order."""


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dense = nn.Linear(4, 4)
        self.vision = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.dense(x)))


def adamw(model: Net, lr: float = 0.01) -> torch.optim.Optimizer:
    """Group 0: dense and head; group 1: vision (never gets a gradient in :func:`train`)."""
    return torch.optim.AdamW(
        [
            {"params": [*model.dense.parameters(), *model.head.parameters()]},
            {"params": list(model.vision.parameters())},
        ],
        lr=lr,
    )


def train(model: Net, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + i))).pow(2).mean().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)


def trained() -> tuple[Net, torch.optim.Optimizer]:
    """Two steps; vision has no state; a scheduler moved vision's lr to 0.0025."""
    model = Net()
    opt = adamw(model)
    train(model, opt, 2)
    opt.param_groups[1]["lr"] = 0.0025
    return model, opt


def nested_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """DSD's nested dict (``get_optimizer_state_dict`` with default options), values cloned."""
    sd = get_optimizer_state_dict(model, opt)
    return copy.deepcopy({"state": sd["state"], "param_groups": sd["param_groups"]})


def view(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    return fqn_view(model, [opt], groups=True)


# --------------------------------------------------------------------------- in memory


def test_nested_dict_of_a_fully_stepped_optimizer_loads_like_dsd_set() -> None:
    src_model = Net()
    src = adamw(src_model)
    for i in range(2):
        src.zero_grad()
        (
            src_model(torch.randn(3, 4, generator=torch.Generator().manual_seed(i))).sum()
            + src_model.vision(torch.ones(1, 4)).sum()
        ).backward()
        src.step()
    nested = nested_of(src_model, src)
    assert nested_kind(nested) == "fqn"
    ours_model, dsd_model = Net(seed=1), Net(seed=1)
    ours, theirs = adamw(ours_model, lr=0.5), adamw(dsd_model, lr=0.5)
    sc.load_sparse_state_dict(ours_model, ours, nested)
    set_optimizer_state_dict(dsd_model, theirs, copy.deepcopy(nested))
    assert_deep_equal(view(ours_model, ours), view(dsd_model, theirs), "ours vs DSD", **SAME)
    assert_deep_equal(view(ours_model, ours), view(src_model, src), "ours vs source", **SAME)


def test_sparse_nested_dict_loads_exactly_without_inventing_state() -> None:
    """vision never stepped: DSD's dict has no state for it (the optimizer had state, so no
    synthetic step ran); the load keeps it stateless and keeps its moved lr; the next steps are
    bit-identical to the source's."""
    src_model, src = trained()
    nested = nested_of(src_model, src)
    assert set(nested["state"]) == {"dense.weight", "dense.bias", "head.weight", "head.bias"}
    model = Net(seed=1)
    model.load_state_dict(src_model.state_dict())
    opt = adamw(model, lr=0.5)
    sc.load_sparse_state_dict(model, opt, nested)
    assert_deep_equal(view(model, opt), view(src_model, src), **SAME)
    assert all(p not in opt.state for p in model.vision.parameters())
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.0025]
    train(src_model, src, 2, seed=7)
    train(model, opt, 2, seed=7)
    for (name, a), b in zip(src_model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert_deep_equal(view(model, opt), view(src_model, src), **SAME)


def test_nested_dict_written_before_the_first_step_holds_dsds_invented_state_and_loads_it() -> None:
    """Reading is faithful: DSD's save of a never-stepped optimizer invented ``step=1`` (and zero
    moments) for every parameter, and that is what the dict holds and what is loaded."""
    model = Net()
    opt = adamw(model)
    nested = nested_of(model, opt)  # DSD's synthetic step: the live optimizer now has state too
    assert len(opt.state) == 6
    target_model = Net()
    target = adamw(target_model)
    sc.load_sparse_state_dict(target_model, target, nested)
    assert len(target.state) == 6 and all(float(s["step"]) == 1.0 for s in target.state.values())


def test_nested_dict_with_an_empty_group_and_odd_state_keys_round_trips() -> None:
    model = Net()
    opt = adamw(model)
    opt.add_param_group({"params": [], "lr": 0.125})
    train(model, opt, 1)
    w = model.dense.weight
    opt.state[w]["ema.decay"] = torch.tensor(0.5)  # a dotted key
    opt.state[w][7] = 3  # an int key
    opt.state[w]["nested"] = {"a": torch.ones(2)}
    nested = nested_of(model, opt)
    assert list(nested["state"]["dense.weight"]) == ["step", "exp_avg", "exp_avg_sq", "ema.decay", 7, "nested"]
    target_model = Net()
    target = adamw(target_model, lr=0.5)
    target.add_param_group({"params": [], "lr": 0.5})
    sc.load_sparse_state_dict(target_model, target, nested)
    assert_deep_equal(view(target_model, target), view(model, opt))
    assert target.param_groups[2]["lr"] == 0.125 and target.param_groups[2]["params"] == []


def test_nested_dict_loads_by_fqn_into_another_layout() -> None:
    src_model, src = trained()
    nested = nested_of(src_model, src)
    model = Net(seed=1)
    mo = sc.MultiOptimizer(
        model,
        {
            "vision": torch.optim.AdamW(model.vision.parameters(), lr=0.5),
            "rest": torch.optim.AdamW([*model.dense.parameters(), *model.head.parameters()], lr=0.5),
        },
    )
    sc.load_sparse_state_dict(model, mo, nested)
    assert mo["vision"].param_groups[0]["lr"] == 0.0025 and not mo["vision"].state
    assert mo["rest"].param_groups[0]["lr"] == 0.01 and len(mo["rest"].state) == 4


def test_nested_dicts_that_are_not_dsds_layout_are_refused() -> None:
    model, opt = trained()
    with pytest.warns(sc.errors.PositionalLoadWarning, match="by position"):
        sc.load_sparse_state_dict(model, opt, opt.state_dict())  # int ids: by position (test_positional_load.py)
    nested = nested_of(model, opt)
    with pytest.raises(sc.CheckpointFormatError, match="unexpected entries"):
        sc.load_sparse_state_dict(model, opt, {**nested, "extra": 1})
    broken = copy.deepcopy(nested)
    broken["param_groups"][1]["params"] = ["vision.weight", 3]
    with pytest.raises(sc.CheckpointFormatError, match="param group 1 has no 'params' list of FQNs"):
        sc.load_sparse_state_dict(model, opt, broken)
    missing = copy.deepcopy(nested)
    missing["param_groups"][1]["params"] = ["vision.weight"]  # vision.bias is in no saved group
    before = view(model, opt)
    with pytest.raises(sc.CheckpointMismatchError, match="vision.bias"):
        sc.load_sparse_state_dict(model, opt, missing)
    assert_deep_equal(view(model, opt), before)  # a failed load changes nothing


@pytest.mark.parametrize("where", ["params", "state"])
def test_a_nested_dict_mixing_fqns_and_ids_is_refused_with_advice_that_works(where: str) -> None:
    """A DSD nested dict with one parameter given by its int id (in a group's ``params``, or as a
    ``state`` key) is refused; the advice, followed (that entry written as its FQN), loads it exactly
    as the untouched dict. (The advice this replaced, ``optimizer.load_state_dict``, pairs the
    entries by position: a mixed ``state`` key is left in the optimizer as an int, its state lost.)"""
    model, opt = trained()
    nested = nested_of(model, opt)
    mixed = copy.deepcopy(nested)
    if where == "params":
        mixed["param_groups"][0]["params"][1] = 1
    else:
        mixed["state"][0] = mixed["state"].pop("dense.weight")
    target = Net(seed=1)
    target_opt = adamw(target)
    before = view(target, target_opt)
    with pytest.raises(sc.CheckpointFormatError, match="as its parameter's FQN") as info:
        sc.load_sparse_state_dict(target, target_opt, mixed)
    assert "get_optimizer_state_dict(model, optimizer)" in str(info.value)
    assert_deep_equal(view(target, target_opt), before)  # the refusal changed nothing
    # the advice: the entry written as its parameter's FQN
    if where == "params":
        mixed["param_groups"][0]["params"][1] = "dense.bias"
    else:
        mixed["state"]["dense.weight"] = mixed["state"].pop(0)
    sc.load_sparse_state_dict(target, target_opt, mixed)
    expected_model = Net(seed=1)
    expected_opt = adamw(expected_model)
    sc.load_sparse_state_dict(expected_model, expected_opt, nested)
    assert_deep_equal(view(target, target_opt), view(expected_model, expected_opt), **SAME)


def test_nested_to_sparse_is_the_packed_equivalent() -> None:
    model, opt = trained()
    sparse = nested_to_sparse(nested_of(model, opt))
    tables = [k for k in sparse if k.startswith("param_groups.__packed__.optim.")]
    assert len(tables) == 1 and len(sparse) == 1 + 4 * 3  # one table; 4 parameters x (step, exp_avg, exp_avg_sq)
    target_model = Net()
    target = adamw(target_model, lr=0.5)
    sc.load_sparse_state_dict(target_model, target, sparse)
    assert_deep_equal(view(target_model, target), view(model, opt), **SAME)


# --------------------------------------------------------------------------- DCP and the CLI


@pytest.fixture
def nested_ckpt(tmp_path: Path) -> tuple[Path, Net, torch.optim.Optimizer]:
    """A DCP checkpoint as stock Accelerate writes one: ``{"optimizer": <DSD nested dict>}``."""
    model, opt = trained()
    path = tmp_path / "optimizer_0"
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(path), no_dist=True)
    return path, model, opt


def test_nested_dcp_checkpoint_loads_with_the_planner(nested_ckpt: tuple[Path, Net, torch.optim.Optimizer]) -> None:
    path, src_model, src = nested_ckpt
    model = Net(seed=1)
    opt = adamw(model, lr=0.5)
    sparse_dcp_load(str(path), model, opt, key="optimizer", no_dist=True)
    assert_deep_equal(view(model, opt), view(src_model, src), **SAME)
    assert all(p not in opt.state for p in model.vision.parameters())


def test_cli_reads_and_converts_a_nested_checkpoint(
    nested_ckpt: tuple[Path, Net, torch.optim.Optimizer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, src_model, src = nested_ckpt
    assert cli.main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (opt_report,) = report["optimizers"]
    assert opt_report["key"] == "optimizer" and opt_report["format"] == "nested"
    assert (opt_report["params"], opt_report["with_state"], opt_report["without_state"]) == (6, 4, 2)
    assert [g["settings"]["lr"] for g in opt_report["leaves"][0]["groups"]] == [0.01, 0.0025]
    assert report["unrecognised_optimizer_items"] == []
    assert cli.main(["inspect", str(path)]) == 0
    assert "torch DSD nested" in capsys.readouterr().out
    assert cli.main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")

    converted = tmp_path / "converted"
    assert cli.main(["convert", str(path), str(converted), "--to", "packed"]) == 0
    capsys.readouterr()
    assert cli.main(["diff", str(path), str(converted), "--exit-code"]) == 0
    assert tools.inspect_checkpoint(converted)["optimizers"][0]["format"] == "packed"
    model = Net(seed=1)
    opt = adamw(model, lr=0.5)
    sparse_dcp_load(str(converted), model, opt, key="optimizer", no_dist=True)
    assert_deep_equal(view(model, opt), view(src_model, src), **SAME)

    assert cli.main(["export", str(path), str(tmp_path / "export")]) == 2
    assert "convert it first" in capsys.readouterr().err


def test_inspect_names_optimizer_items_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A torch ``Optimizer.state_dict()`` saved through DCP (int ids): inspect says what it is
    (tests/tools/test_cli_torch_state_dict.py); items that look like optimizer state in no layout at
    all are listed, never 'no optimizer entries'."""
    model, opt = trained()
    ids = tmp_path / "ids"
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(ids), no_dist=True)
    assert cli.main(["inspect", str(ids)]) == 0
    assert "torch format" in capsys.readouterr().out

    odd = tmp_path / "odd"
    dcp.save({"optim": {"state.w": torch.ones(2)}, "model": model.state_dict()}, checkpoint_id=str(odd), no_dist=True)
    assert cli.main(["inspect", str(odd)]) == 1
    out, err = capsys.readouterr()
    assert "no optimizer entries found" not in out and "'optim.state.w'" in out and "layout" in err


# --------------------------------------------------------------------------- origin record (single process)


def test_a_single_process_dict_pickles_without_an_origin_record() -> None:
    model, opt = trained()
    sd = sc.SparseOptimizerState(model, opt).state_dict()
    assert ORIGIN_KEY not in pickle.loads(pickle.dumps(sd)) and ORIGIN_KEY not in copy.deepcopy(sd)


def test_a_dict_recording_another_rank_is_refused_and_changes_nothing() -> None:
    model, opt = trained()
    sd = sc.sparse_state_dict(model, opt)
    target_model = Net()
    target = adamw(target_model)
    for record in ({"rank": 1, "world_size": 2}, {"rank": 0, "world_size": 2}):
        with pytest.raises(
            sc.CrossRankStateError, match=r"made on rank \d of 2 and is being loaded on rank 0 of 1.*install\(\)"
        ):
            sc.load_sparse_state_dict(target_model, target, {**sd, ORIGIN_KEY: record})
        assert not target.state
    with pytest.raises(sc.CrossRankStateError, match="malformed"):
        sc.SparseOptimizerState(target_model, target).load_state_dict({**sd, ORIGIN_KEY: "rank 0"})
    sc.load_sparse_state_dict(target_model, target, {**sd, ORIGIN_KEY: {"rank": 0, "world_size": 1}})  # this process
    assert_deep_equal(view(target_model, target), view(model, opt))


def test_an_origin_record_that_reached_a_dcp_checkpoint_is_not_read(tmp_path: Path) -> None:
    """Only pickles carry the record; a DCP checkpoint is every rank's own, so a record that a custom
    stager let onto disk is skipped by the planner (it would name one rank for all)."""
    model, opt = trained()
    sd = {**sc.SparseOptimizerState(model, opt).state_dict().copy(), ORIGIN_KEY: {"rank": 1, "world_size": 2}}
    dcp.save({"optim": sd}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    target_model = Net()
    target = adamw(target_model)
    sparse_dcp_load(str(tmp_path / "ckpt"), target_model, target, no_dist=True)
    assert_deep_equal(view(target_model, target), view(model, opt))
