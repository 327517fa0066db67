"""Errors of ``load_sparse_state_dict`` and its transactional guarantee.

Every error -- checkpoint/target mismatches, corrupt tables, errors raised by user hooks or by an
optimizer's own ``load_state_dict``/``__setstate__`` on a *later* leaf -- leaves every optimizer's
``state`` and ``param_groups`` exactly as they were, for a fresh target and for one with state.
Also the ``strict=False`` rules for missing and extra FQNs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_optimizer_equal, find_table_key, snapshot_optimizer, table_bytes
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt.save import packed_table_key

# --------------------------------------------------------------------------- builders


class _Net(nn.Module):
    """``n`` linear layers, FQNs ``layers.{i}.weight|bias``, deterministic init."""

    def __init__(self, n: int = 4, dim: int = 3, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))


def _layer(model: _Net, *idx: int) -> list[nn.Parameter]:
    return [p for i in idx for p in model.layers[i].parameters()]


def _grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _leaf_a(model: _Net, one_group: bool = False) -> torch.optim.Optimizer:
    if one_group:
        return torch.optim.AdamW(_layer(model, 0, 1), lr=0.01)
    return torch.optim.AdamW([{"params": _layer(model, 0)}, {"params": _layer(model, 1), "lr": 0.02}], lr=0.01)


def _leaf_b(model: _Net, cls: type = torch.optim.SGD, layers: tuple[int, ...] = (2, 3)) -> torch.optim.Optimizer:
    return cls(_layer(model, *layers), lr=0.1, momentum=0.9)


def _source(fmt: str = "packed") -> dict[str, Any]:
    model = _Net()
    opt = sc.MultiOptimizer(model, {"a": _leaf_a(model), "b": _leaf_b(model)})
    for s in range(2):
        _grads(_layer(model, 0, 2), seed=s)
        opt.step()
    opt["a"].param_groups[1]["lr"] = 0.0025
    return sc.sparse_state_dict(model, opt, format=fmt)


def _prime(model: _Net, opt: Any) -> None:
    """Give every parameter of the target state (a target that already trained)."""
    _grads(list(model.parameters()), seed=42)
    opt.step()
    for p in model.parameters():
        p.grad = None


# --------------------------------------------------------------------------- failing leaves


class _Boom(RuntimeError):
    """Raised by user code in these tests."""


class _LoadThenFail(torch.optim.SGD):
    """Overrides ``load_state_dict``: loads (mutating the optimizer), then fails."""

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Load the torch way, then raise."""
        super().load_state_dict(state_dict)
        raise _Boom("own load_state_dict failed after loading")


class _SetstateFails(torch.optim.SGD):
    """``__setstate__`` installs the new state, then fails (as AdamW does on a malformed ``step``)."""

    armed = False

    def __setstate__(self, state: dict) -> None:
        """Install, then raise when armed."""
        super().__setstate__(state)
        if self.armed:
            raise _Boom("__setstate__ failed after installing")


def _target(layout: str = "ab", cls_b: type = torch.optim.SGD, n: int = 4, layers_b: tuple[int, ...] = (2, 3)) -> tuple[_Net, Any]:
    model = _Net(n=n, seed=7)
    a = _leaf_a(model, one_group=layout == "a1")
    return model, sc.MultiOptimizer(model, {"a": a, "b": _leaf_b(model, cls_b, layers_b)})


# Each scenario: (build target, edit checkpoint) -> (model, opt, sd, exception class, message regex)
Scenario = Callable[[], tuple[_Net, Any, dict[str, Any], type, str]]


def _missing() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target(n=5, layers_b=(2, 3, 4))
    return model, opt, _source(), sc.CheckpointMismatchError, r"'layers\.4\.weight', 'layers\.4\.bias'"


def _extra() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target(layers_b=(2,))
    return model, opt, _source(), sc.CheckpointMismatchError, r"'layers\.3\.weight', 'layers\.3\.bias'"


def _conflict() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target(layout="a1")
    return model, opt, _source(), sc.CheckpointMismatchError, r"leaf 'a' group 0.*'layers\.0\.weight'.*'layers\.1\.weight'.*'lr'"


def _group_size_by_pre_hook() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target()

    def hook(o: torch.optim.Optimizer, d: dict) -> None:
        d["param_groups"][0]["params"].pop()

    opt["b"].register_load_state_dict_pre_hook(hook)
    return model, opt, _source(), sc.CheckpointMismatchError, r"leaf 'b' group 0: loaded group has 3 parameters"


def _group_count_by_pre_hook() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target()

    def hook(o: torch.optim.Optimizer, d: dict) -> dict:
        return {"state": d["state"], "param_groups": [*d["param_groups"], {"params": []}]}

    opt["b"].register_load_state_dict_pre_hook(hook)
    return model, opt, _source(), sc.CheckpointMismatchError, r"leaf 'b'.*2 parameter groups.*1"


def _bad_shape() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target()
    sd = _source()
    sd["state.layers.2.weight.momentum_buffer"] = torch.zeros(3, 2)
    return model, opt, sd, sc.CheckpointMismatchError, r"'momentum_buffer'.*'layers\.2\.weight'.*\(3, 2\)"


def _corrupt_table() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target()
    sd = _source()
    key = find_table_key(sd, "b")
    broken = table_bytes(sd, key)[:-3]  # truncated, but under a key whose digest matches
    del sd[key]
    sd[packed_table_key("b", broken)] = broken
    return model, opt, sd, sc.CheckpointFormatError, r"leaf 'b'.*truncated"


def _digest_mismatch() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target()
    sd = _source()
    key = find_table_key(sd, "a")
    table = bytearray(sd[key])
    table[-1] ^= 0x01  # last byte of the last FQN
    sd[key] = bytes(table)
    return model, opt, sd, sc.CheckpointFormatError, r"leaf 'a'.*digest"


def _user_pre_hook_raises() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target()

    def hook(o: torch.optim.Optimizer, d: dict) -> None:
        d["param_groups"][0]["lr"] = 123.0  # edits its (shallow) copy first
        raise _Boom("pre-hook failed")

    opt["b"].register_load_state_dict_pre_hook(hook)
    return model, opt, _source(), _Boom, "pre-hook failed"


def _user_post_hook_raises() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target()

    def hook(o: torch.optim.Optimizer) -> None:
        raise _Boom("post-hook failed")

    opt["b"].register_load_state_dict_post_hook(hook)
    return model, opt, _source(), _Boom, "post-hook failed"


def _second_leaf_own_load_fails() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target(cls_b=_LoadThenFail)
    return model, opt, _source(), _Boom, "own load_state_dict failed"


def _second_leaf_setstate_fails() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target(cls_b=_SetstateFails)
    opt["b"].armed = True
    # the class refusing the state is a mismatch naming the leaf and the saved keys; the cause is chained
    return model, opt, _source(), sc.CheckpointMismatchError, r"leaf 'b'.*__setstate__ failed.*momentum_buffer"


def _param_not_in_model() -> tuple[_Net, Any, dict[str, Any], type, str]:
    model, opt = _target()
    opt["b"].add_param_group({"params": [nn.Parameter(torch.zeros(2, 5))]})
    return model, opt, _source(), sc.CheckpointMismatchError, r"leaf 'b' group 1.*\(2, 5\).*not owned"


SCENARIOS: dict[str, Scenario] = {
    "missing": _missing,
    "extra": _extra,
    "conflicting_settings": _conflict,
    "group_size_after_pre_hook": _group_size_by_pre_hook,
    "group_count_after_pre_hook": _group_count_by_pre_hook,
    "state_shape": _bad_shape,
    "corrupt_table": _corrupt_table,
    "digest_mismatch": _digest_mismatch,
    "user_pre_hook": _user_pre_hook_raises,
    "user_post_hook": _user_post_hook_raises,
    "second_leaf_own_load": _second_leaf_own_load_fails,
    "second_leaf_setstate": _second_leaf_setstate_fails,
    "param_not_in_model": _param_not_in_model,
}


@pytest.mark.parametrize("primed", [False, True], ids=["fresh", "with_state"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_error_leaves_every_optimizer_unchanged(name: str, primed: bool) -> None:
    model, opt, sd, exc, pattern = SCENARIOS[name]()
    if primed:
        armed = getattr(opt["b"], "armed", False)
        opt["b"].armed = False
        _prime(model, opt)
        opt["b"].armed = armed
    before = snapshot_optimizer(opt)
    state_objs = [leaf.state for _, leaf in opt.leaves()]
    with pytest.raises(exc, match=pattern):
        sc.load_sparse_state_dict(model, opt, sd)
    assert_optimizer_equal(opt, before, identity=True, nan_equal="none", mapping=dict)
    assert [leaf.state for _, leaf in opt.leaves()] == state_objs
    assert all(p.grad is None for p in model.parameters())
    # the same target then loads a good checkpoint (nothing half-applied or locked)
    if name not in ("missing", "extra", "conflicting_settings", "param_not_in_model"):
        fresh_model, fresh = _target()
        sc.load_sparse_state_dict(fresh_model, fresh, _source())
        assert fresh["a"].param_groups[1]["lr"] == 0.0025


def test_failure_in_second_leaf_rolls_back_first_leaf_that_was_already_installed() -> None:
    """The first leaf *was* installed (its new state observed mid-load), then rolled back."""
    model, opt = _target(cls_b=_LoadThenFail)
    _prime(model, opt)
    before = snapshot_optimizer(opt)
    seen: list[float] = []
    orig = opt["b"].load_state_dict

    def spy(state_dict: dict) -> None:
        seen.append(opt["a"].param_groups[1]["lr"])  # leaf a is already loaded here
        orig(state_dict)

    opt["b"].load_state_dict = spy  # type: ignore[method-assign]
    with pytest.raises(_Boom):
        sc.load_sparse_state_dict(model, opt, _source())
    assert seen == [0.0025]
    assert_optimizer_equal(opt, before, identity=True, nan_equal="none", mapping=dict)


def test_post_hooks_do_not_run_when_a_later_leaf_fails() -> None:
    model, opt = _target()
    ran: list[str] = []
    opt["a"].register_load_state_dict_post_hook(lambda o: ran.append("a"))
    opt["b"].register_load_state_dict_pre_hook(lambda o, d: (_ for _ in ()).throw(_Boom("b pre")))
    with pytest.raises(_Boom):
        sc.load_sparse_state_dict(model, opt, _source())
    assert ran == []


# --------------------------------------------------------------------------- messages


def _many(n: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.ParameterList(nn.Parameter(torch.zeros(2)) for _ in range(n))
    return model, torch.optim.SGD(list(model), lr=0.1)


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_missing_message_lists_first_ten_and_a_count(fmt: str) -> None:
    model, opt = _many(15)
    src = torch.optim.SGD(list(model)[:2], lr=0.1)
    sd = sc.sparse_state_dict(model, src, format=fmt)
    with pytest.raises(sc.CheckpointMismatchError) as info:
        sc.load_sparse_state_dict(model, opt, sd)
    msg = str(info.value)
    assert "13 optimizer parameter(s)" in msg
    assert ", ".join(repr(str(i)) for i in range(2, 12)) + " (+3 more)" in msg
    assert "'12'" not in msg


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_extra_message_lists_first_ten_and_a_count(fmt: str) -> None:
    model, src = _many(14)
    sd = sc.sparse_state_dict(model, src, format=fmt)
    opt = torch.optim.SGD(list(model)[:1], lr=0.1)
    with pytest.raises(sc.CheckpointMismatchError) as info:
        sc.load_sparse_state_dict(model, opt, sd)
    msg = str(info.value)
    assert "13 saved parameter(s)" in msg and "(+3 more)" in msg and "'1'" in msg and "'13'" not in msg


# --------------------------------------------------------------------------- strict=False


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_non_strict_keeps_settings_of_unsaved_groups_and_ignores_extras(fmt: str) -> None:
    src_model = _Net(n=6)
    src = torch.optim.AdamW(
        [{"params": _layer(src_model, 0), "lr": 0.0025}, {"params": _layer(src_model, 1, 5), "lr": 0.03}], lr=0.01
    )
    _grads(_layer(src_model, 0, 1, 5), seed=1)
    src.step()
    sd = sc.sparse_state_dict(src_model, src, format=fmt)

    model = _Net(n=6)
    # group 0: saved; group 1: partly saved (layer 1 yes, layer 2 no); group 2: nothing saved
    opt = torch.optim.AdamW(
        [{"params": _layer(model, 0)}, {"params": _layer(model, 1, 2)}, {"params": _layer(model, 3), "lr": 0.7}], lr=0.5
    )
    with pytest.raises(sc.CheckpointMismatchError, match=r"layers\.2\.weight"):
        sc.load_sparse_state_dict(model, opt, sd)
    sc.load_sparse_state_dict(model, opt, sd, strict=False)
    assert [g["lr"] for g in opt.param_groups] == [0.0025, 0.03, 0.7]
    assert set(opt.state) == set(_layer(model, 0, 1))  # layer 5's saved state is ignored, layer 2/3 get none
    for p, q in zip(_layer(model, 0, 1), _layer(src_model, 0, 1)):
        assert torch.equal(opt.state[p]["exp_avg"], src.state[q]["exp_avg"])


def test_non_strict_ignores_unknown_keys_strict_names_them() -> None:
    model, opt = _target()
    sd = _source()
    sd["state.nowhere.weight.exp_avg"] = torch.zeros(3)
    sd["something_else"] = 1
    with pytest.raises(sc.CheckpointMismatchError) as info:
        sc.load_sparse_state_dict(model, opt, sd)
    assert "'state.nowhere.weight.exp_avg'" in str(info.value) and "'something_else'" in str(info.value)
    sc.load_sparse_state_dict(model, opt, sd, strict=False)
    assert opt["a"].param_groups[1]["lr"] == 0.0025


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_table_of_a_leaf_the_target_lacks_is_named(fmt: str) -> None:
    """Source leaves {a, extra}; the target model has no ``extra`` parameters at all."""

    class Bigger(_Net):
        def __init__(self) -> None:
            super().__init__(n=2)
            self.extra = nn.Linear(2, 2)

    src_model = Bigger()
    src = {"a": torch.optim.SGD(_layer(src_model, 0, 1), lr=0.1), "extra": torch.optim.SGD(src_model.extra.parameters(), lr=0.2)}
    sd = sc.sparse_state_dict(src_model, src, format=fmt)
    model = _Net(n=2)
    opt = {"a": torch.optim.SGD(_layer(model, 0, 1), lr=0.5)}
    pattern = r"'extra\.weight', 'extra\.bias'"
    if fmt == "packed":
        pattern = r"leaf 'extra'.*" + pattern
    with pytest.raises(sc.CheckpointMismatchError, match=pattern):
        sc.load_sparse_state_dict(model, opt, sd)
    sc.load_sparse_state_dict(model, opt, sd, strict=False)
    assert opt["a"].param_groups[0]["lr"] == 0.1


def test_packed_empty_group_of_a_missing_leaf_is_an_error() -> None:
    model = _Net(n=2)
    src = {"a": torch.optim.SGD(_layer(model, 0, 1), lr=0.1), "gone": torch.optim.SGD([{"params": []}], lr=0.2)}
    sd = sc.sparse_state_dict(model, src)
    opt = {"a": torch.optim.SGD(_layer(model, 0, 1), lr=0.5)}
    with pytest.raises(sc.CheckpointMismatchError, match="leaf 'gone'"):
        sc.load_sparse_state_dict(model, opt, sd)
