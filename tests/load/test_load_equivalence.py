"""Differential test: ``load_sparse_state_dict(sparse_state_dict(src))`` == ``load_state_dict(src.state_dict())``.

Randomized optimizers (AdamW, SGD with momentum, Adagrad, RMSprop), several groups, tensor or
float lrs, some parameters that never get a gradient (no state), float32 or float64 targets,
packed and flat formats. The loaded optimizer must equal torch's own load of the same source:
same state keys, ``torch.equal`` values with the same dtypes/devices, same ``param_groups``
(values and key order), and one more step must give bit-identical parameters and state.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from helpers import assert_deep_equal, clone_state_dict, fqn_view
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scalar_tables import write_packed_v1
from torch import nn

import sparse_ckpt as sc

KINDS = ("adamw", "sgd", "adagrad", "rmsprop")
SHAPES = ((2,), (2, 3), ())


# Exact comparison, key order included, with NaN never equal and dicts required to be dicts.
SAME = {"nan_equal": "none", "mapping": dict}


def _model(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> nn.ParameterList:
    gen = torch.Generator().manual_seed(0)
    return nn.ParameterList(nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes)


def _optimizer(case: dict[str, Any], model: nn.ParameterList) -> torch.optim.Optimizer:
    groups: list[dict[str, Any]] = []
    for g in range(case["n_groups"]):
        lr = case["lrs"][g]
        groups.append(
            {
                "params": [p for p, a in zip(model, case["assign"]) if a == g],
                "lr": torch.tensor(lr) if case["tensor_lr"] else lr,
                "weight_decay": case["wds"][g],
            }
        )
    kind, flag = case["kind"], case["flag"]
    if kind == "adamw":
        return torch.optim.AdamW(groups, amsgrad=flag)
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.9, nesterov=flag)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr_decay=0.01 if flag else 0.0)
    return torch.optim.RMSprop(groups, momentum=0.5, centered=flag)


def _step(model: nn.ParameterList, opt: torch.optim.Optimizer, mask: list[bool], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p, has_grad in zip(model, mask):
        g = torch.randn(p.shape, generator=gen)
        p.grad = g.to(p.dtype) if has_grad else None
    opt.step()


def _assert_equivalent(
    ma: nn.ParameterList, a: torch.optim.Optimizer, mb: nn.ParameterList, b: torch.optim.Optimizer
) -> None:
    (sa, ga), (sb, gb) = fqn_view(ma, [a], groups=True), fqn_view(mb, [b], groups=True)  # names: list indices
    assert sorted(sa) == sorted(sb)
    for i in sa:
        assert_deep_equal(sa[i], sb[i], f"state[{i}]", **SAME)
    assert_deep_equal(ga, gb, "param_groups", **SAME)
    assert [list(g) for g in a.param_groups] == [list(g) for g in b.param_groups]  # where `params` sits too


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 6))
    n_groups = draw(st.integers(1, min(3, n)))
    assign = draw(
        st.permutations(
            list(range(n_groups))
            + draw(st.lists(st.integers(0, n_groups - 1), min_size=n - n_groups, max_size=n - n_groups))
        )
    )
    return {
        "kind": draw(st.sampled_from(KINDS)),
        "flag": draw(st.booleans()),
        "shapes": [draw(st.sampled_from(SHAPES)) for _ in range(n)],
        "n_groups": n_groups,
        "assign": assign,
        "lrs": [draw(st.sampled_from([0.1, 0.01, 0.0025])) for _ in range(n_groups)],
        "wds": [draw(st.sampled_from([0.0, 0.1])) for _ in range(n_groups)],
        "tensor_lr": draw(st.booleans()),
        "steps": draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), max_size=3)),
        "target_dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "format": draw(st.sampled_from(["packed", "flat"])),
        "scheduled": draw(st.booleans()),
    }


@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_cases())
def test_sparse_round_trip_equals_torch_load_state_dict(case: dict[str, Any]) -> None:
    src_model = _model(case["shapes"], torch.float32)
    src = _optimizer(case, src_model)
    for s, mask in enumerate(case["steps"]):
        _step(src_model, src, mask, seed=s)
    if case["scheduled"]:  # a scheduler-moved lr plus `initial_lr` in every group
        sched = torch.optim.lr_scheduler.ExponentialLR(src, gamma=0.5)
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()" when no step ran
            warnings.simplefilter("ignore", UserWarning)
            sched.step()

    sd = clone_state_dict(sc.sparse_state_dict(src_model, src, format=case["format"]), detach=False)
    model = _model(case["shapes"], case["target_dtype"])
    opt = _optimizer(case, model)
    sc.load_sparse_state_dict(model, opt, sd)

    ref_model = _model(case["shapes"], case["target_dtype"])
    ref = _optimizer(case, ref_model)
    ref.load_state_dict(copy.deepcopy(src.state_dict()))

    _assert_equivalent(ref_model, ref, model, opt)
    for i, p in enumerate(model):  # stateless params stay stateless (no {} entry)
        assert (p in opt.state) == (src_model[i] in src.state)

    # one more step from the restored state is bit-identical
    mask = [True] * len(case["shapes"])
    _step(model, opt, mask, seed=99)
    _step(ref_model, ref, mask, seed=99)
    _assert_equivalent(ref_model, ref, model, opt)
    for p, q in zip(model, ref_model):
        assert torch.equal(p, q)


@pytest.mark.parametrize("scalar_tables", [True, False], ids=["packed-v2", "packed-v1"])
def test_state_tensors_are_taken_not_copied_like_torch(scalar_tables: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ``load_state_dict`` keeps the dict's own tensors when dtype and device already match
    (``Tensor.to`` is a no-op) and copies them when a cast is needed; sparse_ckpt does the same."""
    write_packed_v1(monkeypatch, not scalar_tables)
    model = _model([(2,), (3,)], torch.float32)
    src = torch.optim.AdamW(list(model))
    _step(model, src, [True, True], seed=0)
    sd = sc.sparse_state_dict(model, src)
    opt = torch.optim.AdamW(list(model))
    sc.load_sparse_state_dict(model, opt, sd)
    ref = torch.optim.AdamW(list(model))
    packed = src.state_dict()
    ref.load_state_dict(packed)
    assert opt.state[model[0]]["exp_avg"] is sd["state.0.exp_avg"]
    assert ref.state[model[0]]["exp_avg"] is packed["state"][0]["exp_avg"]

    m64 = _model([(2,), (3,)], torch.float64)
    opt64 = torch.optim.AdamW(list(m64))
    sc.load_sparse_state_dict(m64, opt64, sd)
    assert opt64.state[m64[0]]["exp_avg"] is not sd["state.0.exp_avg"]
    if not scalar_tables:
        assert opt64.state[m64[0]]["step"] is sd["state.0.step"]  # `step` is never cast here
        return
    # packed version 2: `step` comes from the scalar table, a CPU tensor of its own per parameter
    # (an optimizer steps it in place), never cast here
    steps = [opt64.state[p]["step"] for p in m64]
    assert steps[0] is not steps[1] and steps[0].untyped_storage().data_ptr() != steps[1].untyped_storage().data_ptr()
    for p, q in zip(m64, model):
        assert opt64.state[p]["step"].dtype == torch.float32 and torch.equal(
            opt64.state[p]["step"], src.state[q]["step"]
        )
