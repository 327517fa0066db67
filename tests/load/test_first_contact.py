"""What a new user meets first, in memory (``load_sparse_state_dict``): a plain torch
``optimizer.state_dict()`` loads by position where it provably fits, or is refused saying what it
is; no mode applies none of a checkpoint's saved parameters silently; another optimizer class's
settings are refused; and every hint a refusal gives, followed, loads. (Through DCP:
tests/dcp/test_first_contact_dcp.py.)"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from helpers import assert_deep_equal, snapshot_optimizer
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt.errors import PositionalLoadWarning


class Net(nn.Module):
    """``a`` (4x4 and 4) and ``b`` (2x4 and 2): positions with different shapes."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)


def stepped(opt_cls: type = torch.optim.AdamW, seed: int = 0, **kw: Any) -> tuple[Net, torch.optim.Optimizer]:
    """A Net whose ``b`` stepped once (``a`` has no state), lr 0.01."""
    model = Net(seed)
    opt = opt_cls(model.parameters(), lr=0.01, **kw)
    model.b(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def fresh(opt_cls: type = torch.optim.AdamW, **kw: Any) -> tuple[Net, torch.optim.Optimizer]:
    model = Net(1)
    return model, opt_cls(model.parameters(), lr=0.5, **kw)


def per_layer(model: Net, lr_a: float, lr_b: float, b_cls: type = torch.optim.AdamW, **b_kw: Any) -> sc.MultiOptimizer:
    """Leaf ``a``: AdamW over ``model.a``, lr ``lr_a``; leaf ``b``: ``b_cls`` over ``model.b``, lr ``lr_b``."""
    return sc.MultiOptimizer(
        model,
        {"a": torch.optim.AdamW(model.a.parameters(), lr=lr_a), "b": b_cls(model.b.parameters(), lr=lr_b, **b_kw)},
    )


def torch_loaded(model: nn.Module, src: torch.optim.Optimizer, opt_cls: type = torch.optim.AdamW) -> Any:
    """What torch's own ``load_state_dict`` makes of ``src``'s dict on a fresh optimizer over ``model``."""
    ref = opt_cls(model.parameters(), lr=0.5)
    ref.load_state_dict(copy.deepcopy(src.state_dict()))
    return ref


def same_state(a: Any, b: Any) -> None:
    """``a`` and ``b`` hold equal groups and state, position by position (their models differ)."""
    sa, sb = snapshot_optimizer(a), snapshot_optimizer(b)
    assert list(sa) == list(sb)
    for leaf in sa:
        for part in ("groups", "state"):
            assert_deep_equal(sa[leaf][part], sb[leaf][part], f"{leaf} {part}")


def refused(model: nn.Module, opt: Any, sd: Any, match: str, **kw: Any) -> str:
    """Assert the load is refused (CheckpointMismatchError matching ``match``) and changes nothing."""
    before = snapshot_optimizer(opt)
    with pytest.raises(sc.CheckpointMismatchError, match=match) as info:
        sc.load_sparse_state_dict(model, opt, sd, **kw)
    assert_deep_equal(snapshot_optimizer(opt), before)
    return str(info.value)


# --------------------------------------------------------------------------- torch's own dict, by position


@pytest.mark.parametrize("strict", [True, False])
def test_a_torch_state_dict_loads_by_position_as_torch_loads_it(strict: bool) -> None:
    _src_model, src = stepped()
    model, opt = fresh()
    with pytest.warns(PositionalLoadWarning, match=r"by position: 1 group\(s\) of \[4\] parameters, state of 2"):
        sc.load_sparse_state_dict(model, opt, src.state_dict(), strict=strict)
    assert opt.param_groups[0]["lr"] == 0.01 and len(opt.state) == 2
    same_state(opt, torch_loaded(model, src))


def test_a_never_stepped_torch_state_dict_loads_its_groups() -> None:
    src = torch.optim.AdamW(Net().parameters(), lr=0.01)
    model, opt = fresh()
    with pytest.warns(PositionalLoadWarning):
        sc.load_sparse_state_dict(model, opt, src.state_dict())
    assert opt.param_groups[0]["lr"] == 0.01 and not opt.state


def test_a_torch_state_dict_of_several_groups_loads_into_a_multi_optimizer_leaf_by_leaf() -> None:
    """The saved groups in order onto the leaves' groups in order (torch numbers them so)."""
    src_model = Net()
    src = torch.optim.AdamW(
        [{"params": src_model.a.parameters(), "lr": 0.01}, {"params": src_model.b.parameters(), "lr": 0.02}]
    )
    src_model.b(torch.randn(3, 4)).sum().backward()
    src.step()
    model = Net(1)
    multi = per_layer(model, 0.5, 0.5)
    with pytest.warns(PositionalLoadWarning, match=r"2 group\(s\) of \[2, 2\]"):
        sc.load_sparse_state_dict(model, multi, src.state_dict())
    ref = torch.optim.AdamW([{"params": model.a.parameters()}, {"params": model.b.parameters()}])
    ref.load_state_dict(copy.deepcopy(src.state_dict()))
    assert [multi["a"].param_groups[0]["lr"], multi["b"].param_groups[0]["lr"]] == [0.01, 0.02]
    assert not multi["a"].state
    for p in model.b.parameters():
        assert all(torch.equal(multi["b"].state[p][k], ref.state[p][k]) for k in ref.state[p])


def test_a_torch_state_dict_whose_groups_disagree_is_refused_and_its_hint_loads() -> None:
    """Other group sizes: refused saying what the dict is and how the optimizer it loads into is built;
    an optimizer built that way loads it (the hint, followed)."""
    _src_model, src = stepped()
    model = Net(1)
    split = torch.optim.AdamW([{"params": model.a.parameters()}, {"params": model.b.parameters()}], lr=0.5)
    for strict in (True, False):
        message = refused(
            model, split, src.state_dict(), r"optimizer\.state_dict\(\) \(int parameter ids", strict=strict
        )
        assert "1 param group(s) of [4] parameters" in message and "[2, 2]" in message
    built_as_saved = torch.optim.AdamW(model.parameters(), lr=0.5)
    with pytest.warns(PositionalLoadWarning):
        sc.load_sparse_state_dict(model, built_as_saved, src.state_dict())
    same_state(built_as_saved, torch_loaded(model, src))


def test_a_torch_state_dict_whose_shapes_disagree_at_their_positions_is_refused() -> None:
    """Same group size, parameters passed in another order: the state would land on the wrong parameters."""
    _src_model, src = stepped()
    model = Net(1)
    reordered = torch.optim.AdamW([*model.b.parameters(), *model.a.parameters()], lr=0.5)
    for strict in (True, False):
        message = refused(model, reordered, src.state_dict(), "does not fit parameter", strict=strict)
        assert "in the order they were passed to the optimizer" in message


# --------------------------------------------------------------------------- nothing matched, in every mode


class Renamed(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        setattr(self, name, nn.Linear(2, 2))


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_a_renamed_module_is_refused_in_every_mode_and_its_hint_loads(fmt: str) -> None:
    src_model = Renamed("experts")
    src = torch.optim.AdamW(src_model.parameters(), lr=0.01)
    src_model.experts(torch.ones(1, 2)).sum().backward()
    src.step()
    sd = sc.sparse_state_dict(src_model, src, format=fmt)
    model = Renamed("moe")
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    for strict in (True, False):
        message = refused(model, opt, sd, r"none of the checkpoint's 2 saved parameter\(s\)", strict=strict)
        assert "'experts.weight'" in message and "'moe.weight'" in message
    # The hint: a model whose parameters have the saved names loads it.
    named = Renamed("experts")
    opt2 = torch.optim.AdamW(named.parameters(), lr=0.5)
    sc.load_sparse_state_dict(named, opt2, sd)
    same_state(opt2, src)


def test_a_partly_matching_checkpoint_follows_the_missing_hint() -> None:
    """'strict=False loads what there is and keeps those groups' current settings', followed."""
    src_model, src = stepped()
    sd = {
        k: v for k, v in sc.sparse_state_dict(src_model, src, format="flat").items() if ".a." not in f".{k}"
    }  # a flat checkpoint without a's entries
    model = Net(1)
    part = torch.optim.AdamW([{"params": model.a.parameters()}, {"params": model.b.parameters()}], lr=0.5)
    refused(model, part, sd, r"strict=False loads what there is")
    sc.load_sparse_state_dict(model, part, sd, strict=False)
    assert [g["lr"] for g in part.param_groups] == [0.5, 0.01]
    assert set(part.state) == set(model.b.parameters())


def test_extra_saved_parameters_follow_their_hints() -> None:
    """'Load into all the optimizers ... at once, or pass strict=False', both followed."""
    src_model = Net()
    src = per_layer(src_model, 0.01, 0.02)
    sd = sc.sparse_state_dict(src_model, src)
    model = Net(1)
    only_b = torch.optim.AdamW(model.b.parameters(), lr=0.5)
    refused(model, only_b, sd, r"at once .*or pass strict=False")
    sc.load_sparse_state_dict(model, only_b, sd, strict=False)
    assert only_b.param_groups[0]["lr"] == 0.02
    both = per_layer(model, 0.5, 0.5)
    sc.load_sparse_state_dict(model, both, sd)
    assert [both["a"].param_groups[0]["lr"], both["b"].param_groups[0]["lr"]] == [0.01, 0.02]


def test_unmatched_keys_follow_their_hint() -> None:
    """'strict=False ignores them', followed: the rest loads."""
    src_model, src = stepped()
    sd = {**sc.sparse_state_dict(src_model, src), "state.gone.weight.exp_avg": torch.zeros(2)}
    model, opt = fresh()
    refused(model, opt, sd, r"match no model parameter.*strict=False ignores them")
    sc.load_sparse_state_dict(model, opt, sd, strict=False)
    same_state(opt, src)


def test_an_empty_group_of_a_leaf_the_target_lacks_follows_its_hints() -> None:
    src_model = Net()
    src = sc.MultiOptimizer(
        src_model,
        {"a": torch.optim.AdamW(src_model.parameters(), lr=0.01), "e": torch.optim.AdamW([{"params": []}], lr=0.03)},
    )
    sd = sc.sparse_state_dict(src_model, src)
    model = Net(1)
    only_a = torch.optim.AdamW(model.parameters(), lr=0.5)
    refused(model, only_a, sd, r"empty group 0.*or pass strict=False")
    sc.load_sparse_state_dict(model, only_a, sd, strict=False)
    assert only_a.param_groups[0]["lr"] == 0.01
    both = sc.MultiOptimizer(
        model, {"a": torch.optim.AdamW(model.parameters(), lr=0.5), "e": torch.optim.AdamW([{"params": []}], lr=0.5)}
    )
    sc.load_sparse_state_dict(model, both, sd)
    assert both["e"].param_groups[0]["lr"] == 0.03


# --------------------------------------------------------------------------- another optimizer class


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_another_optimizer_class_is_refused_naming_its_keys_and_the_hints_load(fmt: str) -> None:
    src_model, src = stepped(torch.optim.AdamW)
    sd = sc.sparse_state_dict(src_model, src, format=fmt)
    model, sgd = fresh(torch.optim.SGD, momentum=0.9)
    message = refused(model, sgd, sd, r"another optimizer class than torch\.optim\.SGD")
    assert "['betas', 'eps', 'amsgrad']" in message and "['momentum', 'dampening', 'nesterov']" in message
    assert "torch.optim.AdamW" in message
    # Hint 1: an optimizer of the class it was saved from.
    adamw = torch.optim.AdamW(model.parameters(), lr=0.5)
    sc.load_sparse_state_dict(model, adamw, sd)
    same_state(adamw, src)
    # Hint 2: strict=False loads the saved settings, keeping SGD's own momentum (so step() runs).
    sc.load_sparse_state_dict(model, sgd, sd, strict=False)
    group = sgd.param_groups[0]
    assert group["lr"] == 0.01 and group["momentum"] == 0.9 and group["betas"] == (0.9, 0.999)
    model.b(torch.randn(3, 4)).sum().backward()
    sgd.step()


def test_another_optimizer_class_into_a_multi_optimizer_leaf_is_refused() -> None:
    src_model = Net()
    src = per_layer(src_model, 0.01, 0.01)
    sd = sc.sparse_state_dict(src_model, src)
    model = Net(1)
    multi = per_layer(model, 0.5, 0.5, torch.optim.SGD, momentum=0.9)
    before = snapshot_optimizer(multi["a"])
    with pytest.raises(sc.CheckpointMismatchError, match=r"leaf 'b' group 0: .*torch\.optim\.SGD"):
        sc.load_sparse_state_dict(model, multi, sd)
    assert_deep_equal(snapshot_optimizer(multi["a"]), before)  # nothing applied: leaf 'a' is checked with the rest


def test_a_torch_state_dict_of_another_class_is_refused_by_position_too() -> None:
    _src_model, src = stepped(torch.optim.AdamW)
    model, sgd = fresh(torch.optim.SGD, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PositionalLoadWarning)
        refused(model, sgd, src.state_dict(), r"another optimizer class than torch\.optim\.SGD")


def test_keys_newer_torch_or_a_scheduler_adds_are_not_another_class() -> None:
    """A checkpoint without keys a newer torch added to the class's defaults (an older torch wrote it),
    or with ``initial_lr`` a scheduler added, is the same class: it loads."""
    src_model, src = stepped(torch.optim.AdamW)
    torch.optim.lr_scheduler.LambdaLR(src, lambda epoch: 1.0)  # adds initial_lr to the saved groups
    nested = {
        "state": {f"b.{n}": v for n, v in zip(("weight", "bias"), [src.state[p] for p in src_model.b.parameters()])},
        "param_groups": [
            {
                **{
                    k: v
                    for k, v in src.param_groups[0].items()
                    if k not in ("params", "decoupled_weight_decay", "differentiable", "fused", "foreach", "capturable")
                },
                "params": ["a.weight", "a.bias", "b.weight", "b.bias"],
            }
        ],
    }
    assert "initial_lr" in nested["param_groups"][0]
    model, opt = fresh(torch.optim.AdamW)
    sc.load_sparse_state_dict(model, opt, nested)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["initial_lr"] == 0.01
    model.b(torch.randn(3, 4)).sum().backward()
    opt.step()


@pytest.mark.parametrize(
    "cls",
    [
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.SGD,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adamax,
    ],
)
def test_the_same_class_always_loads(cls: type) -> None:
    src_model, src = stepped(cls)
    model, opt = fresh(cls)
    sc.load_sparse_state_dict(model, opt, sc.sparse_state_dict(src_model, src))
    same_state(opt, src)


def test_strict_false_keeps_each_groups_own_value_of_the_keys_the_checkpoint_lacks() -> None:
    src_model, src = stepped(torch.optim.AdamW)
    sd = sc.sparse_state_dict(src_model, src)
    model = Net(1)
    sgd = torch.optim.SGD(
        [{"params": model.a.parameters(), "momentum": 0.9}, {"params": model.b.parameters(), "momentum": 0.5}], lr=0.5
    )
    sc.load_sparse_state_dict(model, sgd, sd, strict=False)
    assert [(g["lr"], g["momentum"]) for g in sgd.param_groups] == [(0.01, 0.9), (0.01, 0.5)]


def test_a_group_key_of_the_users_own_is_not_another_class() -> None:
    """A saved key no torch optimizer class has (a group's name) loads as torch loads it."""
    src_model = Net()
    src = torch.optim.AdamW([{"params": src_model.parameters(), "name": "all"}], lr=0.01)
    model, opt = fresh()
    sc.load_sparse_state_dict(model, opt, sc.sparse_state_dict(src_model, src))
    assert opt.param_groups[0]["name"] == "all" and opt.param_groups[0]["lr"] == 0.01
