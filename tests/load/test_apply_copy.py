"""``copy_group``/``copy_settings``: the loaded groups share nothing mutable with the checkpoint."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch

from sparse_ckpt._load.apply import copy_group, copy_settings


def test_copy_group_equals_deepcopy_and_shares_nothing_mutable() -> None:
    lr = torch.tensor(0.01)
    group = {
        "params": [0, 1, 2],
        "lr": lr,
        "betas": (0.9, 0.999),
        "nested": {"a": [1, 2], "b": (1, [3])},
        "name": "experts",
        "flag": None,
        "od": OrderedDict(x=1),
    }
    out = copy_group(group)
    ref = copy.deepcopy(group)
    assert list(out) == list(ref)
    assert out["params"] is group["params"]  # replaced by the caller; never mutated
    assert out["betas"] is group["betas"]  # an immutable tuple is shared, as deepcopy shares it
    assert out["lr"] is not lr and torch.equal(out["lr"], lr)
    assert out["nested"] == ref["nested"] and out["nested"] is not group["nested"]
    assert out["nested"]["a"] is not group["nested"]["a"]
    assert out["nested"]["b"][1] is not group["nested"]["b"][1]
    assert type(out["od"]) is OrderedDict and out["od"] == group["od"] and out["od"] is not group["od"]
    out["nested"]["a"].append(3)
    assert group["nested"]["a"] == [1, 2]


def test_copy_settings_of_a_non_dict_group_falls_back_to_deepcopy() -> None:
    odd = OrderedDict(params=[0], lr=[0.1])
    out = copy_group(odd)
    assert type(out) is OrderedDict and out == odd and out["lr"] is not odd["lr"]
    assert copy_settings(True) is True and copy_settings(3.5) == 3.5


def _two_group_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "tags": ["a"]}, {"params": model[1].parameters(), "tags": ["a"]}],
        lr=torch.tensor(0.01),
    )
    return model, opt


def _assert_groups_share_nothing_mutable(opt: torch.optim.Optimizer) -> None:
    g0, g1 = opt.param_groups
    assert torch.equal(g0["lr"], g1["lr"]) and g0["lr"] is not g1["lr"]
    assert g0["tags"] == g1["tags"] == ["a"] and g0["tags"] is not g1["tags"]
    g0["tags"].append("b")
    g0["lr"].mul_(0.5)  # a scheduler's in-place update must stay in its group and out of the checkpoint
    assert g1["tags"] == ["a"] and torch.equal(g1["lr"], torch.tensor(0.01))


@pytest.mark.parametrize("with_pre_hook", [False, True])
def test_loaded_groups_share_no_mutable_value(with_pre_hook: bool) -> None:
    """Equal saved settings are interned on load; every loaded group still gets its own tensor lr
    and list values (as torch's deepcopy gives), with or without a load pre-hook."""
    from sparse_ckpt import load_sparse_state_dict, sparse_state_dict

    model, opt = _two_group_model()
    sd = sparse_state_dict(model, opt)
    fresh_model, fresh = _two_group_model()
    if with_pre_hook:
        fresh.register_load_state_dict_pre_hook(lambda o, s: None)
    load_sparse_state_dict(fresh_model, fresh, sd)
    _assert_groups_share_nothing_mutable(fresh)
    third_model, third = _two_group_model()  # the checkpoint itself was not changed by those updates
    load_sparse_state_dict(third_model, third, sd)
    assert all(torch.equal(g["lr"], torch.tensor(0.01)) and g["tags"] == ["a"] for g in third.param_groups)
