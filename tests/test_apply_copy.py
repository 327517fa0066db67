"""``copy_group``/``copy_settings``: the loaded groups share nothing mutable with the checkpoint."""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch

from sparse_ckpt.apply import copy_group, copy_settings


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
