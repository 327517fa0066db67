"""state_dict hooks, reentrancy, unsupported overrides and ownership errors during save."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import (
    assert_optimizer_equal,
    decoded_settings,
    flat_settings,
    snapshot_optimizer,
    state_keys,
)
from scalar_tables import v1_state_keys
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import _adapters as adapters_mod

FQNS = ("a.weight", "a.bias", "b.weight")


class Two(nn.Module):
    """``a``: Linear(3, 2); ``b``: Linear(2, 1, bias=False)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))


def _stepped(model: Two, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model.b(model.a(torch.ones(4, 3))).sum().backward()
    opt.step()


def _two_groups(model: Two) -> torch.optim.Optimizer:
    """Group 0 holds a.weight + a.bias (lr 0.1), group 1 holds b.weight (lr 0.2): unequal sizes."""
    return torch.optim.Adam(
        [{"params": [model.a.weight, model.a.bias], "lr": 0.1}, {"params": [model.b.weight], "lr": 0.2}]
    )


def _settings(model: nn.Module, sd: dict[str, Any], fmt: str) -> dict[str, dict[str, Any]]:
    return decoded_settings(model, sd) if fmt == "packed" else flat_settings(sd)


@pytest.fixture
def model() -> Two:
    """A fresh :class:`Two`."""
    return Two()


# ----------------------------------------------------------------------------- reordering hooks


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_post_hook_reversing_live_and_serialized_groups_keeps_fqns_right(model: Two, fmt: str) -> None:
    opt = _two_groups(model)
    _stepped(model, opt)
    live_before = [list(g["params"]) for g in opt.param_groups]
    calls = [0]

    def reverse_both(o: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        calls[0] += 1
        o.param_groups.reverse()
        sd["param_groups"].reverse()

    handle = opt.register_state_dict_post_hook(reverse_both)
    try:
        sd = sc.sparse_state_dict(model, opt, format=fmt)
    finally:
        handle.remove()
        if calls[0] % 2:
            opt.param_groups.reverse()
    assert calls[0] == 1
    assert [list(g["params"]) for g in opt.param_groups] == live_before
    settings = _settings(model, sd, fmt)
    assert {f: s["lr"] for f, s in settings.items()} == {"a.weight": 0.1, "a.bias": 0.1, "b.weight": 0.2}
    # State is keyed by the right FQN too: b.weight's exp_avg has b.weight's shape.
    assert sd["state.b.weight.exp_avg"].shape == model.b.weight.shape
    assert sd["state.a.bias.exp_avg"].shape == model.a.bias.shape
    assert torch.equal(sd["state.a.weight.exp_avg"], opt.state[model.a.weight]["exp_avg"])


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_post_hook_returning_new_dict_is_honored(model: Two, fmt: str) -> None:
    opt = _two_groups(model)
    _stepped(model, opt)
    before = snapshot_optimizer(opt)

    def replace(o: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        groups = [dict(g, lr=g["lr"] * 10, note="hooked") for g in sd["param_groups"]]
        state = {pid: s for pid, s in sd["state"].items() if pid != 2}  # drop b.weight's state
        return {"state": state, "param_groups": groups}

    opt.register_state_dict_post_hook(replace)
    sd = sc.sparse_state_dict(model, opt, format=fmt)
    settings = _settings(model, sd, fmt)
    assert {f: s["lr"] for f, s in settings.items()} == {"a.weight": 1.0, "a.bias": 1.0, "b.weight": 2.0}
    assert all(s["note"] == "hooked" for s in settings.values())
    assert sorted({k.rsplit(".", 1)[0] for k in v1_state_keys(sd)}) == ["state.a.bias", "state.a.weight"]
    assert_optimizer_equal(before, opt, identity=True)


def test_post_hook_returning_non_dict_is_a_format_error(model: Two) -> None:
    opt = _two_groups(model)
    opt.register_state_dict_post_hook(lambda o, sd: ["not", "a", "dict"])
    with pytest.raises(sc.CheckpointFormatError, match="'optim'"):
        sc.sparse_state_dict(model, opt)


def test_hooks_run_in_torch_order(model: Two) -> None:
    opt = _two_groups(model)
    log: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: log.append("pre1"))
    opt.register_state_dict_pre_hook(lambda o: log.append("pre0"), prepend=True)
    opt.register_state_dict_post_hook(lambda o, sd: log.append("post1"))
    opt.register_state_dict_post_hook(lambda o, sd: log.append("post0"), prepend=True)
    opt.state_dict()
    torch_log = list(log)
    log.clear()
    sc.sparse_state_dict(model, opt)
    assert log == torch_log == ["pre0", "pre1", "post0", "post1"]


# ----------------------------------------------------------------------------- raising hooks, guard


class HookBoom(RuntimeError):
    """Raised by a test hook."""


@pytest.mark.parametrize("where", ["pre", "post"])
def test_raising_hook_propagates_and_releases_guard(model: Two, where: str) -> None:
    opt = _two_groups(model)
    _stepped(model, opt)
    before = snapshot_optimizer(opt)

    def boom(*_args: Any) -> None:
        raise HookBoom(where)

    handle = opt.register_state_dict_pre_hook(boom) if where == "pre" else opt.register_state_dict_post_hook(boom)
    with pytest.raises(HookBoom, match=where):
        sc.sparse_state_dict(model, opt)
    handle.remove()
    sd = sc.sparse_state_dict(model, opt)  # the guard was released: no ReentrantSerializationError
    assert len(v1_state_keys(sd)) == 9
    assert_optimizer_equal(before, opt, identity=True)


@pytest.mark.parametrize("where", ["pre", "post"])
def test_hook_serializing_same_optimizer_is_reentrant_error(model: Two, where: str) -> None:
    opt = _two_groups(model)
    inner_errors: list[BaseException] = []

    def reenter(*_args: Any) -> None:
        try:
            sc.sparse_state_dict(model, opt)
        except sc.ReentrantSerializationError as exc:
            inner_errors.append(exc)
            raise

    handle = opt.register_state_dict_pre_hook(reenter) if where == "pre" else opt.register_state_dict_post_hook(reenter)
    with pytest.raises(sc.ReentrantSerializationError, match="'optim'"):
        sc.sparse_state_dict(model, opt)
    assert len(inner_errors) == 1
    handle.remove()
    sc.sparse_state_dict(model, opt)  # released


def test_hook_serializing_same_optimizer_inside_multi_optimizer(model: Two) -> None:
    """Reentrancy is per optimizer: re-entering via another container of the same leaf also raises."""
    a = torch.optim.SGD([model.a.weight, model.a.bias], lr=0.1)
    b = torch.optim.SGD([model.b.weight], lr=0.1)
    mo = sc.MultiOptimizer(model, {"a": a, "b": b})
    b.register_state_dict_pre_hook(lambda o: sc.sparse_state_dict(model, {"again": b}))
    with pytest.raises(sc.ReentrantSerializationError, match="'again'"):
        sc.sparse_state_dict(model, mo)


def test_hook_serializing_a_different_optimizer_works(model: Two) -> None:
    a = torch.optim.SGD([model.a.weight, model.a.bias], lr=0.1, momentum=0.9)
    b = torch.optim.SGD([model.b.weight], lr=0.3)
    _stepped(model, a)
    results: list[dict[str, Any]] = []
    a.register_state_dict_post_hook(lambda o, sd: results.append(sc.sparse_state_dict(model, b, format="flat")))
    sd = sc.sparse_state_dict(model, a, format="flat")
    assert len(results) == 1
    assert flat_settings(results[0])["b.weight"]["lr"] == 0.3
    assert state_keys(results[0]) == []
    assert set(flat_settings(sd)) == {"a.weight", "a.bias"}
    assert v1_state_keys(sd) == ["state.a.weight.momentum_buffer", "state.a.bias.momentum_buffer"]
    # And the leaf of the same MultiOptimizer that is not being captured may be serialized from a hook.
    mo = sc.MultiOptimizer(model, {"a": a, "b": b})
    sd_mo = sc.sparse_state_dict(model, mo)
    assert len(results) == 2
    assert set(decoded_settings(model, sd_mo)) == set(FQNS)


# ----------------------------------------------------------------------------- unsupported overrides


class OverridingAdam(torch.optim.Adam):
    """An optimizer class that customises state_dict."""

    def state_dict(self) -> dict[str, Any]:
        """torch's dict plus a marker in every group."""
        sd = super().state_dict()
        for g in sd["param_groups"]:
            g["custom"] = "yes"
        return sd


@pytest.fixture
def adapters() -> Iterator[list[type]]:
    """Classes registered by the test; unregistered at teardown whatever happens."""
    registered: list[type] = []
    yield registered
    for cls in registered:
        adapters_mod._adapters.pop(cls, None)


def test_subclass_overriding_state_dict_is_refused_then_adapted(model: Two, adapters: list[type]) -> None:
    opt = OverridingAdam([{"params": [model.a.weight, model.a.bias]}, {"params": [model.b.weight], "lr": 0.5}])
    _stepped(model, opt)
    with pytest.raises(sc.UnsupportedStateDictError, match="OverridingAdam"):
        sc.sparse_state_dict(model, opt)
    sc.register_state_dict_adapter(OverridingAdam, OverridingAdam.state_dict)
    adapters.append(OverridingAdam)
    for fmt in ("packed", "flat"):
        sd = sc.sparse_state_dict(model, opt, format=fmt)
        settings = _settings(model, sd, fmt)
        assert all(s["custom"] == "yes" for s in settings.values())
        assert settings["b.weight"]["lr"] == 0.5
        assert len(v1_state_keys(sd)) == 9


def test_subclass_of_adapted_class_uses_base_adapter(model: Two, adapters: list[type]) -> None:
    class Deeper(OverridingAdam):
        pass

    opt = Deeper(model.parameters())
    sc.register_state_dict_adapter(OverridingAdam, OverridingAdam.state_dict)
    adapters.append(OverridingAdam)
    settings = flat_settings(sc.sparse_state_dict(model, opt, format="flat"))
    assert {s["custom"] for s in settings.values()} == {"yes"}


def test_patched_instance_state_dict_is_refused_then_adapted(model: Two, adapters: list[type]) -> None:
    class PlainAdam(torch.optim.Adam):  # a private class, so the registration affects nothing else
        pass

    opt = PlainAdam(model.parameters())
    _stepped(model, opt)

    def patched() -> dict[str, Any]:
        sd = torch.optim.Optimizer.state_dict(opt)
        sd["param_groups"][0]["patched"] = True
        return sd

    opt.state_dict = patched  # type: ignore[method-assign]
    with pytest.raises(sc.UnsupportedStateDictError, match="patched"):
        sc.sparse_state_dict(model, opt)
    sc.register_state_dict_adapter(PlainAdam, lambda o: o.state_dict())
    adapters.append(PlainAdam)
    settings = flat_settings(sc.sparse_state_dict(model, opt, format="flat"))
    assert {s["patched"] for s in settings.values()} == {True}


def test_unregistering_an_adapter_refuses_again(model: Two, adapters: list[type]) -> None:
    opt = OverridingAdam(model.parameters())
    handle = sc.register_state_dict_adapter(OverridingAdam, OverridingAdam.state_dict)
    adapters.append(OverridingAdam)
    sc.sparse_state_dict(model, opt)
    handle.remove()
    handle.remove()  # idempotent
    with pytest.raises(sc.UnsupportedStateDictError):
        sc.sparse_state_dict(model, opt)
    with sc.register_state_dict_adapter(OverridingAdam, OverridingAdam.state_dict):
        sc.sparse_state_dict(model, opt)
    with pytest.raises(sc.UnsupportedStateDictError):
        sc.sparse_state_dict(model, opt)


def test_removing_an_old_handle_keeps_a_newer_registration(model: Two, adapters: list[type]) -> None:
    opt = OverridingAdam(model.parameters())
    old = sc.register_state_dict_adapter(OverridingAdam, OverridingAdam.state_dict)
    adapters.append(OverridingAdam)
    sc.register_state_dict_adapter(OverridingAdam, lambda o: OverridingAdam.state_dict(o))
    old.remove()
    sc.sparse_state_dict(model, opt)  # the newer adapter is still registered


def test_not_an_optimizer_is_refused(model: Two) -> None:
    with pytest.raises(sc.UnsupportedStateDictError, match="'x'"):
        sc.sparse_state_dict(model, {"x": object()})


# ----------------------------------------------------------------------------- ownership


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_param_not_owned_by_model_names_leaf_group_and_shape(model: Two, fmt: str) -> None:
    stray = nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.SGD([{"params": [model.a.weight]}, {"params": [model.b.weight, stray]}], lr=0.1)
    mo = sc.MultiOptimizer(model, {"dense": torch.optim.SGD([model.a.bias], lr=0.1), "extra": opt})
    with pytest.raises(sc.CheckpointMismatchError) as info:
        sc.sparse_state_dict(model, mo, format=fmt)
    msg = str(info.value)
    assert "'extra'" in msg and "group 1" in msg and "(3, 5)" in msg, msg


# ----------------------------------------------------------------------------- never-stepped leaf


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_leaf_without_state_emits_settings_only_and_runs_nothing(model: Two, fmt: str) -> None:
    opt = torch.optim.AdamW(
        [{"params": [model.a.weight, model.a.bias], "lr": 0.02}, {"params": [model.b.weight], "lr": 0.03}]
    )
    model.b(model.a(torch.ones(2, 3))).sum().backward()  # grads exist, but nothing steps
    steps = [0]
    opt.register_step_pre_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
    before = snapshot_optimizer(opt)

    sd = sc.sparse_state_dict(model, opt, format=fmt)

    assert v1_state_keys(sd) == []
    settings = _settings(model, sd, fmt)
    assert {f: s["lr"] for f, s in settings.items()} == {"a.weight": 0.02, "a.bias": 0.02, "b.weight": 0.03}
    assert steps[0] == 0
    assert len(opt.state) == 0
    assert_optimizer_equal(before, opt, identity=True)
