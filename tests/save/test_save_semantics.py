"""Save semantics: the motivating case -- a leaf that never stepped keeps its scheduled lr.

Two Linear layers, one AdamW leaf each. The first leaf trains; the second never steps, but a real
scheduler moved its lr from 0.01 to 0.0025. The sparse dict must carry 0.0025 for every parameter
of the second leaf, hold no state for it, and saving must not mutate anything.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import (
    assert_deep_equal,
    assert_optimizer_equal,
    clone_value,
    decoded_settings,
    flat_settings,
    snapshot_optimizer,
    state_keys,
)
from scalar_tables import as_v1, scalar_table_keys
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._core_py import PACKED_MARKER
from sparse_ckpt._format.keys_record import without_key_record

FIRST = ("0.weight", "0.bias")
SECOND = ("1.weight", "1.bias")


def _motivating_case() -> tuple[nn.Module, sc.MultiOptimizer, torch.optim.AdamW, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    first = torch.optim.AdamW(model[0].parameters(), lr=0.01)
    second = torch.optim.AdamW(model[1].parameters(), lr=0.01)
    opt = sc.MultiOptimizer(model, {"first": first, "second": second})
    sched = torch.optim.lr_scheduler.StepLR(second, step_size=1, gamma=0.5)
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).square().mean().backward()
        first.step()
        if i < 2:
            with warnings.catch_warnings():
                # "lr_scheduler.step() before optimizer.step()": exactly the situation under test.
                warnings.simplefilter("ignore", UserWarning)
                sched.step()
    assert second.param_groups[0]["lr"] == 0.0025
    assert first.param_groups[0]["lr"] == 0.01
    assert len(second.state) == 0 and len(first.state) == 2
    # The second layer's grads exist (it is in the graph): saving must leave them alone too.
    assert all(p.grad is not None for p in model[1].parameters())
    return model, opt, first, second


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_never_stepped_leaf_keeps_scheduled_lr(fmt: str) -> None:
    model, opt, first, second = _motivating_case()
    before = snapshot_optimizer(opt)
    first_sd_before = first.state_dict()

    sd = sc.sparse_state_dict(model, opt, format=fmt)

    settings = decoded_settings(model, sd) if fmt == "packed" else flat_settings(sd)
    assert set(settings) == set(FIRST + SECOND)
    for fqn in SECOND:
        assert settings[fqn]["lr"] == 0.0025, fqn
        assert settings[fqn]["initial_lr"] == 0.01, fqn
        assert settings[fqn]["betas"] == (0.9, 0.999)
    for fqn in FIRST:
        assert settings[fqn]["lr"] == 0.01, fqn
        assert "initial_lr" not in settings[fqn]

    if fmt == "packed":  # packed version 2: every step in one scalar table of leaf 'first'
        assert [k.split(".")[2] for k in scalar_table_keys(sd)] == ["first"]
        assert not [k for k in sd if k.endswith(".step")]
    v1 = as_v1(sd)
    keys = state_keys(v1)
    assert not [k for k in keys if k.startswith(tuple(f"state.{f}." for f in SECOND))]
    assert keys == [f"state.{f}.{k}" for f in FIRST for k in ("step", "exp_avg", "exp_avg_sq")]
    for i, p in enumerate(model[0].parameters()):
        for k, v in first.state[p].items():
            assert_deep_equal(v1[f"state.{FIRST[i]}.{k}"], v, FIRST[i])

    if fmt == "packed":
        tables = [k for k in sd if k.startswith(f"param_groups.{PACKED_MARKER}.")]
        assert [k.split(".")[2] for k in tables] == ["first", "second"]
        assert all(isinstance(sd[k], bytes) for k in tables)
        assert not [k for k in sd if k.startswith("param_groups.") and k not in tables]
    else:
        assert not [k for k in sd if PACKED_MARKER in k]

    # Nothing was mutated: no state created, no .grad replaced or changed, no parameter moved.
    assert len(second.state) == 0
    assert_optimizer_equal(before, opt, identity=True)
    assert_deep_equal(first.state_dict(), first_sd_before, "first.state_dict()")


def test_never_stepped_leaf_round_trips_and_resumes_exactly() -> None:
    """Loading the motivating checkpoint restores lr 0.0025 and no synthetic state for the second leaf."""
    model, opt, _first, _second = _motivating_case()
    # Clone, as a trip through storage would: an in-process load shares tensors (as torch's does).
    sd = clone_value(sc.sparse_state_dict(model, opt))

    model2 = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model2.load_state_dict(model.state_dict())
    first2 = torch.optim.AdamW(model2[0].parameters(), lr=0.5)
    second2 = torch.optim.AdamW(model2[1].parameters(), lr=0.5)
    opt2 = sc.MultiOptimizer(model2, {"first": first2, "second": second2})
    sc.load_sparse_state_dict(model2, opt2, sd)

    assert second2.param_groups[0]["lr"] == 0.0025
    assert len(second2.state) == 0
    for p, q in zip(model.parameters(), model2.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    assert_optimizer_equal(opt, opt2)
    opt.step()
    opt2.step()
    assert_optimizer_equal(opt, opt2)


def test_single_leaf_sparse_dict_equals_torch_state_dict_content() -> None:
    """For one plain optimizer the flat dict is exactly torch's state_dict re-keyed by FQN."""
    model, _opt, first, _second = _motivating_case()
    sd = sc.sparse_state_dict(model, first, format="flat")
    torch_sd = first.state_dict()
    expected: dict[str, object] = {}
    for pid, state in torch_sd["state"].items():
        for k, v in state.items():
            expected[f"state.{FIRST[pid]}.{k}"] = v
    for group in torch_sd["param_groups"]:
        for pid in group["params"]:
            for k, v in group.items():
                if k != "params":
                    expected[f"param_groups.{FIRST[pid]}.{k}"] = v
    assert_deep_equal(without_key_record(sd), expected, "flat")  # and the key record
