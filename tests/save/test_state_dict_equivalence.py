"""Differential test: ``capture_packed`` must equal ``optimizer.state_dict()`` exactly.

Hypothesis draws tiny optimizers -- AdamW, SGD with momentum, Adagrad, RMSprop; float or tensor
lr; several groups (possibly empty) with mixed settings and user keys; a shuffled parameter
order; parameters that never get a grad -- optionally with state_dict pre/post hooks (a post-hook
that edits values, one that returns a new dict). The packed dict must have the same keys in the
same order and equal (``torch.equal``) tensors as torch's. Then the FQN remap is checked: the
flat (and decoded packed) ``fqn -> settings`` equals the settings of the serialized group holding
that parameter, and the state entries are torch's, re-keyed by FQN, in torch's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from helpers import assert_deep_equal, decoded_settings, flat_settings, state_keys
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scalar_tables import as_v1, scalar_table_keys
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._save.capture import capture_packed

SHAPES = ((3,), (2, 2), (), (1, 3))
KINDS = ("adamw", "sgd", "adagrad", "rmsprop")
HOOKS = ("all", "post_new", "post_edit", "pre", "none")


@dataclass
class Case:
    """One drawn optimizer configuration."""

    kind: str
    shapes: list[tuple[int, ...]]
    order: list[int]
    group_of: list[int]
    group_settings: list[dict[str, Any]]
    grad_masks: list[list[bool]]
    hooks: str


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Draw a tiny optimizer configuration (few primitive draws, to keep 200 examples fast)."""
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.integers(1, 4))
    shapes = [SHAPES[i] for i in draw(st.lists(st.integers(0, len(SHAPES) - 1), min_size=n, max_size=n))]
    order = draw(st.permutations(range(n)))
    n_groups = draw(st.integers(1, 3))
    group_of = draw(st.lists(st.integers(0, n_groups - 1), min_size=n, max_size=n))
    group_settings = []
    for _ in range(n_groups):
        lr = draw(st.sampled_from([0.1, 0.01, "t0.1", "t0.003"]))
        s: dict[str, Any] = {"lr": torch.tensor(float(lr[1:])) if isinstance(lr, str) else lr}
        flags = draw(st.integers(0, 15))
        s["weight_decay"] = 0.1 if flags & 1 else 0.0
        s["maximize"] = bool(flags & 2)
        if kind == "adamw":
            s["amsgrad"] = bool(flags & 4)
        elif kind == "sgd":
            s["momentum"] = 0.9 if flags & 4 else 0.5
            s["nesterov"] = bool(flags & 8)
        elif kind == "rmsprop":
            s["centered"] = bool(flags & 4)
            s["momentum"] = 0.9 if flags & 8 else 0.0
        tag = draw(st.sampled_from([None, "experts", ""]))
        if tag is not None:
            s["tag"] = tag
        group_settings.append(s)
    steps = draw(st.integers(0, 3))
    masks = draw(st.lists(st.integers(0, 2**n - 1), min_size=steps, max_size=steps))
    grad_masks = [[bool(m >> i & 1) for i in range(n)] for m in masks]
    hooks = draw(st.sampled_from(HOOKS))
    return Case(kind, shapes, list(order), group_of, group_settings, grad_masks, hooks)


class Bag(nn.Module):
    """A model whose parameters live in a nested ParameterList (FQNs ``inner.ps.{i}``)."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(len(shapes))
        self.inner = nn.Module()
        self.inner.ps = nn.ParameterList(nn.Parameter(torch.randn(s, generator=gen)) for s in shapes)


def build(case: Case) -> tuple[Bag, torch.optim.Optimizer, list[int]]:
    """Model, stepped optimizer and the pre-hook call counter for ``case``."""
    model = Bag(case.shapes)
    params = list(model.inner.ps)
    groups: list[dict[str, Any]] = [{"params": [], **s} for s in case.group_settings]
    for i in case.order:
        groups[case.group_of[i]]["params"].append(params[i])
    cls = {
        "adamw": torch.optim.AdamW,
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "rmsprop": torch.optim.RMSprop,
    }[case.kind]
    opt = cls(groups, lr=0.05, foreach=False)
    for step, mask in enumerate(case.grad_masks):
        for p, has_grad in zip(params, mask):
            p.grad = torch.full_like(p, 0.5 + step) if has_grad else None
        opt.step()
    pre_calls = [0]
    if case.hooks in ("pre", "all"):

        def pre_hook(o: torch.optim.Optimizer) -> None:
            pre_calls[0] += 1
            o.param_groups[0].setdefault("pre_mark", "seen")

        opt.register_state_dict_pre_hook(pre_hook)
    if case.hooks in ("post_edit", "all"):

        def post_edit(o: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
            sd["param_groups"][-1]["weight_decay"] = 0.25
            sd["param_groups"][0]["edited"] = (1, "x", None)
            sd["extra_top_level"] = 7

        opt.register_state_dict_post_hook(post_edit)
    if case.hooks in ("post_new", "all"):

        def post_new(o: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
            return {
                "param_groups": [dict(g, replaced=True) for g in reversed(sd["param_groups"])],
                "state": dict(reversed(list(sd["state"].items()))),
            }

        opt.register_state_dict_post_hook(post_new)
    return model, opt, pre_calls


def check_case(case: Case) -> None:
    """Run the differential and remap checks for one drawn case."""
    model, opt, pre_calls = build(case)
    packed, id_to_param = capture_packed("optim", opt)
    torch_sd = opt.state_dict()
    assert_deep_equal(packed, torch_sd, "capture_packed vs state_dict")
    if case.hooks in ("pre", "all"):
        assert pre_calls[0] == 2
        assert opt.param_groups[0]["pre_mark"] == "seen"
        assert sum(g.get("pre_mark") == "seen" for g in packed["param_groups"]) == 1
    live = [p for g in opt.param_groups for p in g["params"]]
    assert len(id_to_param) == len(live) and all(a is b for a, b in zip(id_to_param, live))

    name_of = {id(p): f"inner.ps.{i}" for i, p in enumerate(model.inner.ps)}
    fqn_of_id = [name_of[id(p)] for p in live]
    expected_settings: dict[str, dict[str, Any]] = {}
    for group in torch_sd["param_groups"]:
        s = {k: v for k, v in group.items() if k != "params"}
        for pid in group["params"]:
            expected_settings[fqn_of_id[pid]] = s
    if case.hooks in ("none", "pre"):
        # Without post-hooks the serialized groups are the live groups.
        for group in opt.param_groups:
            for p in group["params"]:
                assert_deep_equal(
                    expected_settings[name_of[id(p)]], {k: v for k, v in group.items() if k != "params"}, "live"
                )
    expected_state = {
        f"state.{fqn_of_id[pid]}.{k}": v for pid, state in torch_sd["state"].items() for k, v in state.items()
    }

    flat = sc.sparse_state_dict(model, opt, format="flat")
    assert_deep_equal(flat_settings(flat), expected_settings, "flat settings", check_order=False)
    assert_deep_equal({k: flat[k] for k in state_keys(flat)}, expected_state, "flat state")

    packed_sd = sc.sparse_state_dict(model, opt)
    # one leaf: one scalar table when any parameter has state (it records every parameter's state keys)
    assert len(scalar_table_keys(packed_sd)) == int(any(torch_sd["state"].values()))
    v1 = as_v1(packed_sd, name_of.values())  # with the scalar tables expanded: the per-item layout
    # FQNs whose whole state is scalars (a 0-d parameter's) sit in the table, not in state order:
    # the order of FQNs is not kept, each FQN's key order is.
    assert_deep_equal({k: v1[k] for k in state_keys(v1)}, expected_state, "packed state", check_order=False)
    assert _keys_by_fqn(state_keys(v1), name_of.values()) == _keys_by_fqn(list(expected_state), name_of.values())
    assert_deep_equal(decoded_settings(model, packed_sd), expected_settings, "packed settings", check_order=False)


def _keys_by_fqn(keys: list[str], fqns: Any) -> dict[str, list[str]]:
    known = set(fqns)
    out: dict[str, list[str]] = {}
    for k in keys:
        body = k[len("state.") :]
        fqn = max((f for f in known if body.startswith(f + ".")), key=len)
        out.setdefault(fqn, []).append(body[len(fqn) + 1 :])
    return out


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_capture_equals_torch_state_dict(case: Case) -> None:
    check_case(case)


def test_fixed_case_with_all_hooks_and_stateless_params() -> None:
    """A hand-written case that always covers every branch (hypothesis may not draw it first)."""
    case = Case(
        kind="adamw",
        shapes=[(3,), (2, 2), (), (1, 3)],
        order=[2, 0, 3, 1],
        group_of=[0, 1, 1, 2],
        group_settings=[
            {"lr": torch.tensor(0.01), "weight_decay": 0.0, "maximize": False, "amsgrad": True, "tag": "a"},
            {"lr": 0.1, "weight_decay": 0.1, "maximize": True, "amsgrad": False},
            {"lr": 0.003, "weight_decay": 0.0, "maximize": False, "amsgrad": False},
        ],
        grad_masks=[[True, False, True, False], [True, False, False, False]],
        hooks="all",
    )
    _model, opt, _ = build(case)
    assert len(opt.state) == 2  # two parameters never got a grad
    check_case(case)


def test_differential_check_detects_a_wrong_id_assignment() -> None:
    """Guard against a vacuous comparison: a packed dict with shifted ids must not compare equal."""
    case = Case(
        "sgd",
        [(3,), (3,)],
        [0, 1],
        [0, 1],
        [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.2, "momentum": 0.9}],
        [[True, True]],
        "none",
    )
    _model, opt, _ = build(case)
    packed, _ = capture_packed("optim", opt)
    packed["param_groups"][1]["params"] = [0]
    try:
        assert_deep_equal(packed, opt.state_dict())
    except AssertionError:
        return
    raise AssertionError("assert_deep_equal accepted different param ids")
