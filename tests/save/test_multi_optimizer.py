"""``MultiOptimizer``: fan-out, container protocol, hooks, and its sparse state dict."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from helpers import (
    assert_deep_equal,
    assert_optimizer_equal,
    clone_value,
    decoded_settings,
    experts_and_dense,
    make_batch,
    make_moe,
    snapshot_optimizer,
    state_keys,
    train,
)

import sparse_ckpt as sc
from sparse_ckpt._dcp.stateful import SparseStateDict
from sparse_ckpt._format.keys import PACKED_MARKER, PLANNER_GUARD_KEY, is_foreign_guard


def _mo(model: Any, lr_experts: float = 0.01, lr_dense: float = 0.02) -> sc.MultiOptimizer:
    return sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(model.expert_params(), lr=lr_experts),
            "dense": torch.optim.AdamW(model.dense_params(), lr=lr_dense),
        },
    )


def _set_grads(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


# ----------------------------------------------------------------------------- optimizer protocol


def test_step_and_zero_grad_fan_out() -> None:
    model = make_moe(0)
    mo = experts_and_dense(model, lambda params: torch.optim.SGD(params, lr=0.1))
    ref_model = make_moe(0)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    _set_grads(model, 1)
    _set_grads(ref_model, 1)
    before = [p.detach().clone() for p in model.parameters()]
    mo.step()
    ref.step()
    for p, q, b in zip(model.parameters(), ref_model.parameters(), before):
        assert torch.equal(p, q)
        assert not torch.equal(p, b)
    mo.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    mo.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("returns_loss", [True, False])
def test_step_closure_evaluated_once(returns_loss: bool) -> None:
    model = make_moe(0)
    mo = sc.MultiOptimizer(
        model,
        {
            "a": torch.optim.SGD(model.expert_params(), lr=0.1),
            "b": torch.optim.SGD(model.dense_params()[:2], lr=0.1),
            "c": torch.optim.SGD(model.dense_params()[2:], lr=0.1),
        },
    )
    ref_model = make_moe(0)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    x = make_batch(3)
    calls = [0]

    def closure() -> torch.Tensor | None:
        calls[0] += 1
        mo.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss if returns_loss else None

    def ref_closure() -> torch.Tensor:
        ref.zero_grad()
        loss = ref_model(x).square().mean()
        loss.backward()
        return loss

    out = mo.step(closure)
    ref_loss = ref.step(ref_closure)
    assert calls[0] == 1
    if returns_loss:
        assert isinstance(out, torch.Tensor) and torch.equal(out, ref_loss)
    else:
        assert out is None
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_param_groups_view_and_state_view() -> None:
    model = make_moe(0)
    experts = torch.optim.AdamW(
        [{"params": model.experts[0].parameters()}, {"params": [p for e in model.experts[1:] for p in e.parameters()]}]
    )
    dense = torch.optim.AdamW(model.dense_params())
    mo = sc.MultiOptimizer(model, {"experts": experts, "dense": dense})
    groups = mo.param_groups
    assert len(groups) == 3
    assert groups[0] is experts.param_groups[0] and groups[1] is experts.param_groups[1]
    assert groups[2] is dense.param_groups[0]
    groups[2]["lr"] = 0.123  # a scheduler driving mo.param_groups changes the leaf
    assert dense.param_groups[0]["lr"] == 0.123
    train(model, mo, 1, only_experts=[0])
    assert set(mo.state) == set(experts.state) | set(dense.state)
    assert len(mo.state) == len(experts.state) + len(dense.state) == 3 + len(model.dense_params())


def test_container_protocol() -> None:
    model = make_moe(0)
    e = torch.optim.SGD(model.expert_params(), lr=0.1)
    d = torch.optim.SGD(model.dense_params(), lr=0.1)
    mo = sc.MultiOptimizer(model, {"experts": e, "dense": d})
    assert len(mo) == 2
    assert mo["experts"] is e and mo["dense"] is d
    assert list(mo) == ["experts", "dense"] == mo.keys()
    assert mo.leaves() == [("experts", e), ("dense", d)]
    assert "dense" in mo and "nope" not in mo
    with pytest.raises(KeyError):
        mo["nope"]
    assert "experts" in repr(mo)


def test_step_hooks_fan_out_and_remove() -> None:
    model = make_moe(0)
    e = torch.optim.SGD(model.expert_params(), lr=0.1)
    d = torch.optim.SGD(model.dense_params(), lr=0.1)
    mo = sc.MultiOptimizer(model, {"experts": e, "dense": d})
    log: list[tuple[str, Any]] = []
    pre = mo.register_step_pre_hook(lambda opt, args, kwargs: log.append(("pre", opt)))
    post = mo.register_step_post_hook(lambda opt, args, kwargs: log.append(("post", opt)))
    _set_grads(model, 0)
    mo.step()
    assert log == [("pre", e), ("post", e), ("pre", d), ("post", d)]
    pre.remove()
    log.clear()
    mo.step()
    assert log == [("post", e), ("post", d)]
    post.remove()
    log.clear()
    mo.step()
    assert log == []
    with mo.register_step_pre_hook(lambda opt, args, kwargs: log.append(("ctx", opt))):
        mo.step()
    mo.step()
    assert log == [("ctx", e), ("ctx", d)]


# ----------------------------------------------------------------------------- state dicts


def test_state_dict_equals_sparse_state_dict() -> None:
    model = make_moe(0)
    mo = _mo(model)
    train(model, mo, 2, only_experts=[1, 3])
    sd = mo.state_dict()
    assert isinstance(sd, SparseStateDict) and PLANNER_GUARD_KEY in sd  # the DCP Stateful's dict
    guards = {k for k, v in sd.items() if is_foreign_guard(k, v)}  # one per leaf (its first FQN), one nested
    assert guards == {"param_groups.experts.0.up.weight.lr", "param_groups.embed.weight.lr", "param_groups.0.lr"}
    sd = {k: v for k, v in sd.items() if k != PLANNER_GUARD_KEY and k not in guards}
    assert mo.state_layout == "auto"  # the DCP default; sparse_state_dict's is per_tensor (live tensors)
    assert_deep_equal(sd, sc.sparse_state_dict(model, mo, state_layout="auto"), "mo.state_dict() vs sparse_state_dict")
    mo.state_layout = "per_tensor"
    sd = {k: v for k, v in mo.state_dict().items() if k != PLANNER_GUARD_KEY and k not in guards}
    assert_deep_equal(sd, sc.sparse_state_dict(model, mo), "mo.state_dict() vs sparse_state_dict")
    tables = [k for k in sd if k.startswith(f"param_groups.{PACKED_MARKER}.")]
    assert [k.split(".")[2] for k in tables] == ["experts", "dense"]
    assert not [k for k in state_keys(sd) if k.startswith(("state.experts.0.", "state.experts.2."))]
    assert [k for k in state_keys(sd) if k.startswith("state.experts.1.")]


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_load_state_dict_round_trip_then_identical_steps(fmt: str) -> None:
    model = make_moe(0)
    mo = _mo(model)
    train(model, mo, 2, only_experts=[0, 2])
    sd = clone_value(sc.sparse_state_dict(model, mo, format=fmt))

    model2 = copy.deepcopy(model)
    mo2 = _mo(model2, lr_experts=0.9, lr_dense=0.9)
    mo2.load_state_dict(sd)
    assert_optimizer_equal(mo, mo2, grads=False)
    assert len(mo2["experts"].state) == 6  # experts 1 and 3 got no state: none invented on load
    train(model, mo, 2, seed=10)
    train(model2, mo2, 2, seed=10)
    assert_optimizer_equal(mo, mo2)


def test_load_state_dict_strict_flag_is_forwarded() -> None:
    model = make_moe(0)
    mo = _mo(model)
    sd = sc.sparse_state_dict(model, {"experts": mo["experts"]})  # the dense leaf is missing
    mo2 = _mo(copy.deepcopy(model), lr_dense=0.5)
    with pytest.raises(sc.CheckpointMismatchError):
        mo2.load_state_dict(sd)
    mo2.load_state_dict(sd, strict=False)
    assert mo2["dense"].param_groups[0]["lr"] == 0.5


# ----------------------------------------------------------------------------- construction errors


def test_param_in_two_leaves_raises() -> None:
    model = make_moe(0)
    shared = model.head.weight
    with pytest.raises(ValueError, match=r"'a'.*'b'"):
        sc.MultiOptimizer(
            model,
            {"a": torch.optim.SGD([shared], lr=0.1), "b": torch.optim.SGD([model.head.bias, shared], lr=0.1)},
        )


def test_param_in_two_leaves_of_a_mapping_raises_on_save() -> None:
    model = make_moe(0)
    shared = model.head.weight
    leaves = {"a": torch.optim.SGD([shared], lr=0.1), "b": torch.optim.SGD([shared], lr=0.1)}
    with pytest.raises(sc.CheckpointMismatchError, match=r"head\.weight"):
        sc.sparse_state_dict(model, leaves)


@pytest.mark.parametrize("bad", [1, None, ("a",), ""])
def test_non_string_leaf_names_raise(bad: Any) -> None:
    model = make_moe(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="leaf name"):
        sc.MultiOptimizer(model, {bad: opt})
    with pytest.raises(ValueError, match="leaf name"):
        sc.sparse_state_dict(model, {bad: opt})


def test_bad_constructor_arguments() -> None:
    model = make_moe(0)
    with pytest.raises(TypeError):
        sc.MultiOptimizer(object(), {"a": torch.optim.SGD(model.parameters(), lr=0.1)})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        sc.MultiOptimizer(model, {})
    with pytest.raises(TypeError, match="'a'"):
        sc.MultiOptimizer(model, {"a": object()})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        sc.sparse_state_dict(model, [torch.optim.SGD(model.parameters(), lr=0.1)])


@pytest.mark.parametrize("bad", [[("a", "opt")], ("opt",), 5, "experts"])
def test_optimizers_not_a_mapping_is_a_type_error(bad: Any) -> None:
    model = make_moe(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    value = [(n, opt) for n, _ in bad] if isinstance(bad, list) else (opt,) if isinstance(bad, tuple) else bad
    with pytest.raises(TypeError, match="mapping of leaf name to optimizer"):
        sc.MultiOptimizer(model, value)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- other optimizer arguments


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_plain_mapping_equals_multi_optimizer(fmt: str) -> None:
    model = make_moe(0)
    mo = _mo(model)
    train(model, mo, 2, only_experts=[1])
    leaves = {"experts": mo["experts"], "dense": mo["dense"]}
    expected = sc.sparse_state_dict(model, mo, format=fmt)
    assert_deep_equal(sc.sparse_state_dict(model, leaves, format=fmt), expected, "dict")
    assert_deep_equal(sc.sparse_state_dict(model, types.MappingProxyType(leaves), format=fmt), expected, "proxy")

    model2 = copy.deepcopy(model)
    mo2 = _mo(model2, 0.5, 0.5)
    sc.load_sparse_state_dict(model2, {"experts": mo2["experts"], "dense": mo2["dense"]}, clone_value(expected))
    assert_optimizer_equal(mo, mo2, grads=False)


def test_single_optimizer_is_leaf_optim() -> None:
    model = make_moe(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 1, only_experts=[0])
    before = snapshot_optimizer(opt)
    sd = sc.sparse_state_dict(model, opt)
    tables = [k for k in sd if k.startswith("param_groups.")]
    assert len(tables) == 1 and tables[0].startswith(f"param_groups.{PACKED_MARKER}.optim.")
    assert_deep_equal(sd, sc.sparse_state_dict(model, {"optim": opt}), "single vs {'optim': opt}")
    assert set(decoded_settings(model, sd)) == {n for n, _ in model.named_parameters()}
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.5)
    sc.load_sparse_state_dict(model, opt2, clone_value(sd))
    assert_optimizer_equal(before, opt2)
