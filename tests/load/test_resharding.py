"""Resharding: settings and state follow FQNs, not leaf names or group positions.

Saved with leaves {experts, dense}; loaded into one optimizer holding everything, into a layout
that splits the experts over two leaves, with parameters moved between groups of a leaf, from
several "ranks" whose tables differ (expert parallelism) into one, and from one into a shard.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import TiedNet, assert_deep_equal, fqn_view, randomize
from scalar_tables import as_v1
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._format.tags import Keying
from sparse_ckpt._save.save import build_state_dict

FORMATS = ("packed", "flat")


class _Model(nn.Module):
    """``dense`` (2 layers) and ``experts`` (4 layers); FQNs ``dense.{i}.*``, ``experts.{i}.*``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.dense = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
        self.experts = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
        randomize(self, seed)


def _e(model: _Model, *idx: int) -> list[nn.Parameter]:
    return [p for i in idx for p in model.experts[i].parameters()]


def _d(model: _Model, *idx: int) -> list[nn.Parameter]:
    return [p for i in idx for p in model.dense[i].parameters()]


def _train(model: _Model, opt: Any, with_grad: list[nn.Parameter], steps: int = 2) -> None:
    leaves = (
        [opt]
        if isinstance(opt, torch.optim.Optimizer)
        else [o for _, o in opt.leaves()]
        if isinstance(opt, sc.MultiOptimizer)
        else list(opt.values())
    )
    for s in range(steps):
        gen = torch.Generator().manual_seed(s)
        for p in model.parameters():
            p.grad = None
        for p in with_grad:
            p.grad = torch.randn(p.shape, generator=gen)
        for leaf in leaves:
            leaf.step()
    for p in model.parameters():
        p.grad = None


# Views are compared without key order, with NaN never equal and dicts required to be dicts.
SAME = {"check_order": False, "nan_equal": "none", "mapping": dict}


def _source() -> tuple[_Model, sc.MultiOptimizer]:
    """Leaves with identical hyperparameters but different groups; experts 3 never gets a grad."""
    model = _Model()
    opt = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW([{"params": _e(model, 0, 1)}, {"params": _e(model, 2, 3)}], lr=0.01),
            "dense": torch.optim.AdamW([{"params": _d(model, 0)}, {"params": _d(model, 1)}], lr=0.01),
        },
    )
    _train(model, opt, _e(model, 0, 1, 2) + _d(model, 0, 1))
    for _, leaf in opt.leaves():  # a scheduler moved every lr the same way
        for g in leaf.param_groups:
            g["lr"] = 0.0025
    return model, opt


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_leaves_into_one_optimizer(fmt: str) -> None:
    src_model, src = _source()
    sd = sc.sparse_state_dict(src_model, src, format=fmt)
    model = _Model(seed=1)
    opt = torch.optim.AdamW(list(model.parameters()), lr=0.5)
    sc.load_sparse_state_dict(model, opt, sd)
    assert opt.param_groups[0]["lr"] == 0.0025
    assert_deep_equal(fqn_view(model, [opt]), fqn_view(src_model, [o for _, o in src.leaves()]), **SAME)
    assert all(p not in opt.state for p in _e(model, 3))


@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_split_over_two_leaves(fmt: str) -> None:
    src_model, src = _source()
    for i, g in enumerate(src["experts"].param_groups):  # make per-group settings distinguishable
        g["lr"] = 0.001 * (1 + i)
    sd = sc.sparse_state_dict(src_model, src, format=fmt)
    model = _Model(seed=1)
    opt = sc.MultiOptimizer(
        model,
        {
            "dense": torch.optim.AdamW(_d(model, 0, 1), lr=0.5),  # leaf order changed too
            "experts_b": torch.optim.AdamW(_e(model, 2, 3), lr=0.5),
            "experts_a": torch.optim.AdamW(_e(model, 0, 1), lr=0.5),
        },
    )
    sc.load_sparse_state_dict(model, opt, sd)
    src_view = fqn_view(src_model, [o for _, o in src.leaves()])
    assert_deep_equal(fqn_view(model, [o for _, o in opt.leaves()]), src_view, **SAME)
    assert opt["experts_a"].param_groups[0]["lr"] == src["experts"].param_groups[0]["lr"]
    assert opt["experts_b"].param_groups[0]["lr"] == src["experts"].param_groups[1]["lr"]
    assert set(opt["experts_b"].state) == set(_e(model, 2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_parameter_moved_to_another_group_of_the_leaf(fmt: str) -> None:
    src_model = _Model()
    src = torch.optim.SGD(
        [{"params": _e(src_model, 0), "lr": 0.1}, {"params": _e(src_model, 1, 2), "lr": 0.2, "momentum": 0.5}],
        lr=0.3,
        momentum=0.9,
    )
    _train(src_model, src, _e(src_model, 0, 1))
    sd = {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in sc.sparse_state_dict(src_model, src, format=fmt).items()
    }
    model = _Model(seed=1)
    opt = torch.optim.SGD([{"params": _e(model, 2, 1)}, {"params": _e(model, 0)}], lr=0.7, momentum=0.0)
    sc.load_sparse_state_dict(model, opt, sd)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.2, 0.5)
    assert (opt.param_groups[1]["lr"], opt.param_groups[1]["momentum"]) == (0.1, 0.9)
    assert_deep_equal(fqn_view(model, [opt]), fqn_view(src_model, [src]), **SAME)
    # the resumed SGD step uses each parameter's own momentum buffer
    ref_model = _Model(seed=1)
    ref = torch.optim.SGD(
        [{"params": _e(ref_model, 0), "lr": 0.1}, {"params": _e(ref_model, 1, 2), "lr": 0.2, "momentum": 0.5}],
        lr=0.3,
        momentum=0.9,
    )
    ref.load_state_dict(copy.deepcopy(src.state_dict()))  # loads alias the dict's tensors (as torch)
    _train(model, opt, _e(model, 0, 1, 2), steps=1)
    _train(ref_model, ref, _e(ref_model, 0, 1, 2), steps=1)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def _rank(shard: tuple[int, ...], rank: int) -> dict[str, Any]:
    """One expert-parallel "rank" of two: the experts leaf holds only ``shard``; dense is
    replicated. Keyed as ``sparse_state_dict`` keys it on rank ``rank`` of a process group of 2
    (tables by content digest: see *Table keys* in sparse_ckpt._format.keys)."""
    model = _Model()
    opt = {
        "experts": torch.optim.AdamW([{"params": _e(model, i)} for i in shard], lr=0.01),
        "dense": torch.optim.AdamW(_d(model, 0, 1), lr=0.01),
    }
    _train(model, opt, _e(model, shard[0]) + _d(model, 0, 1))
    opt["experts"].param_groups[-1]["lr"] = 0.001 * (1 + shard[-1])
    return build_state_dict(model, opt, "packed", Keying(world=2, rank=rank))


def test_tables_of_several_ranks_load_into_one() -> None:
    """Two ranks' tables of leaf ``experts`` differ (two digests); ``dense`` tables are equal (one key)."""
    r0, r1 = _rank((0, 1), 0), _rank((2, 3), 1)
    tables = sorted(k for k in {**r0, **r1} if k.startswith("param_groups.__packed__."))
    assert sum(k.startswith("param_groups.__packed__.experts.") for k in tables) == 2
    assert sum(k.startswith("param_groups.__packed__.dense.") for k in tables) == 1
    merged = {**r0, **r1}  # what DCP holds after both ranks saved (dense state is replicated)
    model = _Model(seed=1)
    opt = {
        "experts": torch.optim.AdamW(_e(model, 0, 1, 2, 3), lr=0.5),
        "dense": torch.optim.AdamW(_d(model, 0, 1), lr=0.5),
    }
    with pytest.raises(sc.CheckpointMismatchError, match="'experts.0.weight'.*'experts.1.weight'.*'lr'"):
        sc.load_sparse_state_dict(model, opt, merged)  # one group cannot take lr 0.01 and 0.002
    opt["experts"] = torch.optim.AdamW([{"params": _e(model, i)} for i in range(4)], lr=0.5)
    sc.load_sparse_state_dict(model, opt, merged)
    assert [g["lr"] for g in opt["experts"].param_groups] == [0.01, 0.002, 0.01, 0.004]
    assert set(opt["experts"].state) == set(_e(model, 0, 2))
    assert torch.equal(opt["experts"].state[model.experts[2].weight]["exp_avg"], r1["state.experts.2.weight.exp_avg"])


def test_full_checkpoint_into_one_shard() -> None:
    src_model, src = _source()
    sd = sc.sparse_state_dict(src_model, src)
    model = _Model(seed=1)
    shard = {"experts": torch.optim.AdamW(_e(model, 2, 3), lr=0.5), "dense": torch.optim.AdamW(_d(model, 0, 1), lr=0.5)}
    with pytest.raises(sc.CheckpointMismatchError, match="experts.0.weight"):
        sc.load_sparse_state_dict(model, shard, sd)
    sc.load_sparse_state_dict(model, shard, sd, strict=False)
    assert set(shard["experts"].state) == set(_e(model, 2))
    assert shard["experts"].param_groups[0]["lr"] == 0.0025


_Tied = TiedNet


@pytest.mark.parametrize("fmt", FORMATS)
def test_tied_parameter_saved_under_first_fqn_loads_under_alias(fmt: str) -> None:
    model = _Tied()
    src = torch.optim.Adam(model.parameters(), lr=0.01)
    model.enc.weight.grad = torch.ones(3, 3)
    src.step()
    sd = sc.sparse_state_dict(model, src, format=fmt)
    assert "state.enc.weight.exp_avg" in sd and not any("dec.weight" in k for k in sd)
    sd = as_v1(sd)  # per-item keys only (scalar tables name their FQNs inside: see test_packed_v2.py)
    renamed = {
        k.replace("enc.weight", "dec.weight"): v for k, v in sd.items() if not k.startswith("param_groups.__packed__")
    }
    if fmt == "packed":  # the table names enc.weight; state keys use the alias
        renamed.update({k: v for k, v in sd.items() if k.startswith("param_groups.__packed__")})
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    sc.load_sparse_state_dict(model, opt, renamed)
    assert opt.param_groups[0]["lr"] == 0.01
    assert torch.equal(opt.state[model.enc.weight]["exp_avg"], src.state[model.enc.weight]["exp_avg"])


def _named(model: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if n.startswith(prefix)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_param_names_are_per_parameter_not_a_group_setting(fmt: str) -> None:
    """torch's named optimizers keep ``param_names`` in each group. They must not make two groups
    with equal hyperparameters conflict when merged, and they must follow FQNs when params move."""
    src_model = _Model()
    src = torch.optim.AdamW(
        [{"params": _named(src_model, "experts.0.")}, {"params": _named(src_model, "experts.1.")}], lr=0.01
    )
    _train(src_model, src, _e(src_model, 0, 1))
    sd = sc.sparse_state_dict(src_model, src, format=fmt)

    model = _Model(seed=1)
    merged = torch.optim.AdamW(_named(model, "experts.1.") + _named(model, "experts.0."), lr=0.5)
    sc.load_sparse_state_dict(model, merged, sd)
    assert merged.param_groups[0]["param_names"] == [
        "experts.1.weight",
        "experts.1.bias",
        "experts.0.weight",
        "experts.0.bias",
    ]
    assert merged.param_groups[0]["lr"] == 0.01

    swapped = torch.optim.AdamW(
        [{"params": _named(model, "experts.1.")}, {"params": _named(model, "experts.0.")}], lr=0.5
    )
    sc.load_sparse_state_dict(model, swapped, sd)
    assert swapped.param_groups[0]["param_names"] == ["experts.1.weight", "experts.1.bias"]
    assert swapped.param_groups[1]["param_names"] == ["experts.0.weight", "experts.0.bias"]

    same = torch.optim.AdamW([{"params": _named(model, "experts.0.")}, {"params": _named(model, "experts.1.")}], lr=0.5)
    sc.load_sparse_state_dict(model, same, sd)
    ref = torch.optim.AdamW([{"params": _named(model, "experts.0.")}, {"params": _named(model, "experts.1.")}], lr=0.5)
    ref.load_state_dict(src.state_dict())
    for g, r in zip(same.param_groups, ref.param_groups):
        assert list(g) == list(r) and g["param_names"] == r["param_names"]


def test_param_names_with_local_names_and_an_unnamed_target() -> None:
    """Names that are not FQNs (``Linear.named_parameters()``): packed tables still know each
    FQN's name by position; an unnamed target then gains the saved names, as with torch."""
    src_model = _Model()
    src = torch.optim.SGD(
        [
            {"params": list(src_model.experts[0].named_parameters())},
            {"params": list(src_model.experts[1].named_parameters())},
        ],
        lr=0.1,
    )
    sd = sc.sparse_state_dict(src_model, src)
    model = _Model(seed=1)
    opt = torch.optim.SGD([{"params": _e(model, 1)}, {"params": _e(model, 0)}], lr=0.5)
    sc.load_sparse_state_dict(model, opt, sd)
    assert [g["param_names"] for g in opt.param_groups] == [["weight", "bias"], ["weight", "bias"]]
