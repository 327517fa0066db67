"""Errors of ``load_sparse_state_dict`` and its transactional guarantee.

Every error a load can raise -- checkpoint/target mismatches (:class:`CheckpointMismatchError`),
corrupt tables (:class:`CheckpointFormatError`), errors raised by user hooks or by an optimizer's own
``load_state_dict``/``__setstate__`` on a *later* leaf -- leaves every optimizer's ``state`` and
``param_groups`` exactly as they were (same objects, equal values), for a fresh target and for one
with state, and training continues bit for bit as if the load had never been attempted. Also the
``strict=False`` rules for missing and extra FQNs and how messages list what is missing.
``UnsupportedStateDictError`` and ``ReentrantSerializationError`` belong to capture (save) and
cannot arise on load: loading takes no serialization guard and calls the target's own
``load_state_dict`` when the class overrides it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import (
    IdentitySnapshot,
    LayerNet,
    TwoLayerNet,
    assert_optimizer_equal,
    deep_equal,
    find_table_key,
    layer_params,
    snapshot_optimizer,
    table_bytes,
)
from table_bytes import encode
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._format.keys import PACKED_PREFIX
from sparse_ckpt._save.save import packed_table_key

# --------------------------------------------------------------------------- builders


_Net = LayerNet
_layer = layer_params


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


def _target(
    layout: str = "ab", cls_b: type = torch.optim.SGD, n: int = 4, layers_b: tuple[int, ...] = (2, 3)
) -> tuple[_Net, Any]:
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
    return (
        model,
        opt,
        _source(),
        sc.CheckpointMismatchError,
        r"leaf 'a' group 0.*'layers\.0\.weight'.*'layers\.1\.weight'.*'lr'",
    )


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
    src = {
        "a": torch.optim.SGD(_layer(src_model, 0, 1), lr=0.1),
        "extra": torch.optim.SGD(src_model.extra.parameters(), lr=0.2),
    }
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


# ---------------------------------------------------------------------- one Adam target with state, every error class


Net = TwoLayerNet


def _train(model: Net, opt: Any, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=gen)).pow(2).sum().backward()
        opt.step()


def _groups(model: Net, lr_b: float = 0.003) -> list[dict]:
    return [
        {"params": [model.a.weight, model.a.bias, model.unused]},
        {"params": [model.b.weight, model.b.bias], "lr": lr_b},
    ]


def source(fmt: str = "packed") -> dict[str, Any]:
    """A saved sparse state dict of a stepped Adam (``unused`` has no state)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(_groups(model), lr=0.01)
    _train(model, opt, 2, seed=1)
    return sc.sparse_state_dict(model, opt, format=fmt)


def target(lr_b: float = 0.02) -> tuple[Net, torch.optim.Adam]:
    """A different model/optimizer that has its own state (stepped once, other settings)."""
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.Adam(_groups(model, lr_b), lr=0.05, betas=(0.8, 0.9))
    _train(model, opt, 1, seed=3)
    return model, opt


def _retable(sd: dict[str, Any], table: bytes, leaf: str = "optim") -> dict[str, Any]:
    """Replace the table with ``table`` under a key whose digest matches it (a forged table)."""
    out = {k: v for k, v in sd.items() if not (isinstance(k, str) and k.startswith(PACKED_PREFIX))}
    out[packed_table_key(leaf, table)] = table
    return out


# --------------------------------------------------------------------------- deep compare


# "Unchanged" is exact: key order included, NaN never equal, dicts required to be dicts (so is
# IdentitySnapshot with nan_equal="none").
SAME = {"nan_equal": "none", "mapping": dict}


def test_snapshot_detects_changes() -> None:
    """The deep compare is not a tautology."""
    sd = source()
    for mutate in (
        lambda m, o: o.param_groups[1].__setitem__("lr", 1.0),
        lambda m, o: next(iter(o.state.values()))["exp_avg"].mul_(2),
        lambda m, o: sc.load_sparse_state_dict(m, o, sd),
    ):
        model, opt = target()
        snap = IdentitySnapshot(model, [opt], nan_equal="none")
        mutate(model, opt)
        with pytest.raises(AssertionError):
            snap.assert_unchanged(model)


# --------------------------------------------------------------------------- scenarios


@dataclass
class Case:
    """A failing load: the model, the optimizer argument, the leaves to watch, the bad dict."""

    model: Net
    optimizer: Any
    leaves: list[torch.optim.Optimizer]
    state_dict: dict[str, Any]
    strict: bool = True


def _single(sd: dict[str, Any], **kw: Any) -> Case:
    model, opt = target()
    return Case(model, opt, [opt], sd, **kw)


def sc_missing_fqn() -> Case:
    sd = {k: v for k, v in source("flat").items() if not k.startswith("param_groups.b.bias.")}
    return _single(sd)


def sc_extra_fqn() -> Case:
    sd = source("flat")
    sd["param_groups.ghost.w.lr"] = 0.1
    return _single(sd)


def sc_state_for_unknown_fqn() -> Case:
    sd = source()
    sd["state.ghost.w.exp_avg"] = torch.zeros(3, 4)
    return _single(sd)


def sc_group_settings_conflict() -> Case:
    model, _ = target()
    opt = torch.optim.Adam([{"params": list(model.parameters())}], lr=0.05)
    _train(model, opt, 1, seed=3)
    return Case(model, opt, [opt], source())


def sc_tables_conflict() -> Case:
    sd = source()
    other = encode("optim", [({"lr": 9.0}, ["a.weight"])])
    sd[packed_table_key("optim", other)] = other
    return _single(sd)


def sc_leaf_missing_in_target() -> Case:
    torch.manual_seed(0)
    src = Net()
    multi = sc.MultiOptimizer(
        src,
        {
            "experts": torch.optim.Adam([src.a.weight, src.a.bias, src.unused], lr=0.01),
            "dense": torch.optim.Adam([src.b.weight, src.b.bias], lr=0.02),
        },
    )
    _train(src, multi, 1, seed=1)
    sd = sc.sparse_state_dict(src, multi)
    model, _ = target()
    opt = torch.optim.Adam([model.a.weight, model.a.bias, model.unused], lr=0.05)
    _train(model, opt, 1, seed=3)
    return Case(model, {"experts": opt}, [opt], sd)


def sc_empty_group_of_missing_leaf() -> Case:
    sd = source()
    table = encode("ghostleaf", [({"lr": 0.1}, [])])
    sd[packed_table_key("ghostleaf", table)] = table
    return _single(sd)


def sc_state_wrong_shape() -> Case:
    sd = source()
    sd["state.a.weight.exp_avg"] = torch.zeros(2, 2)
    return _single(sd)


def sc_state_wrong_dtype() -> Case:
    sd = source()
    sd["state.a.weight.exp_avg"] = torch.zeros(3, 4, dtype=torch.complex64)
    return _single(sd)


def sc_digest_mismatch() -> Case:
    sd = source()
    key = find_table_key(sd)
    table = bytearray(sd[key])
    table[-1] ^= 0x01
    sd[key] = bytes(table)
    return _single(sd)


def sc_truncated_table() -> Case:
    sd = source()
    return _single(_retable(sd, table_bytes(sd, find_table_key(sd))[:-3]))


def sc_wrong_version() -> Case:
    sd = source()
    table = bytearray(table_bytes(sd, find_table_key(sd)))
    table[4:6] = (99).to_bytes(2, "little")
    return _single(_retable(sd, bytes(table)))


def sc_not_bytes_under_packed_key() -> Case:
    sd = source()
    key = find_table_key(sd)
    sd[key] = torch.frombuffer(bytearray(sd[key]), dtype=torch.uint8)
    return _single(sd)


def sc_non_string_key() -> Case:
    sd = source()
    sd[3] = torch.zeros(1)
    return _single(sd)


def sc_packed_key_without_digest() -> Case:
    sd = source()
    sd["param_groups.__packed__.optim"] = sd.pop(find_table_key(sd))
    return _single(sd)


def sc_duplicate_fqn_in_table() -> Case:
    """One FQN in two groups with different settings (torch allows a parameter in two groups)."""
    sd = source()
    table = encode("optim", [({"lr": 0.01}, ["a.weight", "a.bias"]), ({"lr": 0.003}, ["b.weight", "a.weight"])])
    return _single(_retable(sd, table))


def sc_nested_state_collision() -> Case:
    sd = source()
    sd["state.a.weight.exp_avg.inner"] = torch.zeros(1)
    return _single(sd)


def sc_flat_value_unsupported() -> Case:
    sd = source("flat")
    sd["param_groups.a.weight.lr"] = object()
    return _single(sd)


def sc_format_error_not_strict() -> Case:
    case = sc_truncated_table()
    case.strict = False
    return case


def sc_pre_hook_breaks_group_count() -> Case:
    case = _single(source())
    case.leaves[0].register_load_state_dict_pre_hook(lambda o, sd: {**sd, "param_groups": sd["param_groups"][:1]})
    return case


def _multi_target() -> tuple[Net, sc.MultiOptimizer, torch.optim.Optimizer, torch.optim.Optimizer]:
    model, _ = target()
    experts = torch.optim.Adam([model.a.weight, model.a.bias, model.unused], lr=0.05)
    dense = torch.optim.SGD([model.b.weight, model.b.bias], lr=0.5, momentum=0.9)
    multi = sc.MultiOptimizer(model, {"experts": experts, "dense": dense})
    _train(model, multi, 1, seed=3)
    return model, multi, experts, dense


def _multi_source() -> dict[str, Any]:
    torch.manual_seed(0)
    src = Net()
    multi = sc.MultiOptimizer(
        src,
        {
            "experts": torch.optim.Adam([src.a.weight, src.a.bias, src.unused], lr=0.01),
            "dense": torch.optim.SGD([src.b.weight, src.b.bias], lr=0.1, momentum=0.5),
        },
    )
    _train(src, multi, 2, seed=1)
    return sc.sparse_state_dict(src, multi)


def sc_second_leaf_post_hook_raises() -> Case:
    model, multi, experts, dense = _multi_target()
    applied: list[str] = []
    experts.register_load_state_dict_post_hook(lambda o: applied.append("experts"))

    def boom(_o: Any) -> None:
        raise _Boom("dense post-hook")

    dense.register_load_state_dict_post_hook(boom)
    return Case(model, multi, [experts, dense], _multi_source())


def sc_second_leaf_pre_hook_raises() -> Case:
    model, multi, experts, dense = _multi_target()

    def boom(_o: Any, _sd: dict) -> None:
        raise _Boom("dense pre-hook")

    dense.register_load_state_dict_pre_hook(boom)
    return Case(model, multi, [experts, dense], _multi_source())


class StubbornSGD(torch.optim.SGD):
    """An optimizer whose own ``load_state_dict`` fails (sparse_ckpt calls it instead of its own path)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Fail like a broken override would."""
        raise _Boom("custom load_state_dict")


def sc_second_leaf_custom_load_raises() -> Case:
    model, _ = target()
    experts = torch.optim.Adam([model.a.weight, model.a.bias, model.unused], lr=0.05)
    dense = StubbornSGD([model.b.weight, model.b.bias], lr=0.5, momentum=0.9)
    multi = sc.MultiOptimizer(model, {"experts": experts, "dense": dense})
    _train(model, multi, 1, seed=3)
    return Case(model, multi, [experts, dense], _multi_source())


CASES: list[tuple[Callable[[], Case], type[BaseException], list[str]]] = [
    (sc_missing_fqn, sc.CheckpointMismatchError, ["b.bias"]),
    (sc_extra_fqn, sc.CheckpointMismatchError, ["ghost.w"]),
    (sc_state_for_unknown_fqn, sc.CheckpointMismatchError, ["state.ghost.w.exp_avg"]),
    (sc_group_settings_conflict, sc.CheckpointMismatchError, ["group 0", "'lr'", "b.weight"]),
    (sc_tables_conflict, sc.CheckpointMismatchError, ["a.weight"]),
    (sc_leaf_missing_in_target, sc.CheckpointMismatchError, ["dense", "b.weight"]),
    (sc_empty_group_of_missing_leaf, sc.CheckpointMismatchError, ["ghostleaf"]),
    (sc_state_wrong_shape, sc.CheckpointMismatchError, ["a.weight", "exp_avg", "(2, 2)"]),
    (sc_state_wrong_dtype, sc.CheckpointMismatchError, ["a.weight", "exp_avg", "complex64"]),
    (sc_digest_mismatch, sc.CheckpointFormatError, ["'optim'", "digest"]),
    (sc_truncated_table, sc.CheckpointFormatError, ["'optim'", "truncated"]),
    (sc_wrong_version, sc.CheckpointFormatError, ["'optim'", "version 99"]),
    (sc_not_bytes_under_packed_key, sc.CheckpointFormatError, ["param_groups.__packed__.optim.", "Tensor"]),
    (sc_non_string_key, sc.CheckpointFormatError, ["3"]),
    (sc_packed_key_without_digest, sc.CheckpointFormatError, ["param_groups.__packed__.optim"]),
    (sc_duplicate_fqn_in_table, sc.CheckpointMismatchError, ["'optim'", "a.weight", "group 1"]),
    (sc_nested_state_collision, sc.CheckpointFormatError, ["a.weight", "exp_avg"]),
    (sc_flat_value_unsupported, sc.CheckpointFormatError, ["a.weight", "'lr'", "object"]),
    (sc_format_error_not_strict, sc.CheckpointFormatError, ["'optim'"]),
    (sc_pre_hook_breaks_group_count, sc.CheckpointMismatchError, ["'optim'", "groups"]),
    (sc_second_leaf_post_hook_raises, _Boom, ["dense post-hook"]),
    (sc_second_leaf_pre_hook_raises, _Boom, ["dense pre-hook"]),
    (sc_second_leaf_custom_load_raises, _Boom, ["custom load_state_dict"]),
]


@pytest.mark.parametrize(("scenario", "error", "names"), CASES, ids=[s[0].__name__[3:] for s in CASES])
def test_failed_load_changes_nothing(
    scenario: Callable[[], Case], error: type[BaseException], names: list[str]
) -> None:
    """The load raises ``error`` naming what is wrong; the target is as before and trains identically."""
    case = scenario()
    twin_model, twin_leaves = copy.deepcopy((case.model, case.leaves))
    snap = IdentitySnapshot(case.model, case.leaves, nan_equal="none")
    with pytest.raises(error) as info:
        sc.load_sparse_state_dict(case.model, case.optimizer, case.state_dict, strict=case.strict)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    snap.assert_unchanged(case.model)  # parameters, grads, state, groups: values and objects
    # the live job is not corrupted: the next step equals that of an untouched twin, bit for bit
    for model, leaves in ((case.model, case.leaves), (twin_model, twin_leaves)):
        for opt in leaves:
            opt.zero_grad()
        model(torch.ones(2, 4)).pow(2).sum().backward()
        for opt in leaves:
            opt.step()
    for p, q in zip(case.model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    for opt, twin in zip(case.leaves, twin_leaves):
        assert deep_equal(opt.state_dict(), twin.state_dict(), **SAME)


def test_valid_load_after_failed_load() -> None:
    """After a rejected checkpoint the same target still loads a good one exactly."""
    model, opt = target()
    with pytest.raises(sc.CheckpointFormatError):
        sc.load_sparse_state_dict(model, opt, sc_truncated_table().state_dict)
    sd = source()
    sc.load_sparse_state_dict(model, opt, sd)
    assert deep_equal(sc.sparse_state_dict(model, opt), sd, **SAME)
