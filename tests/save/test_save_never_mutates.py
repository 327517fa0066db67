"""Reliability of save: ``sparse_state_dict`` never mutates the optimizer or the model.

For every supported torch optimizer, in three histories (never stepped, partially stepped:
some parameters never got a gradient, stepped), in both formats, and when a state_dict hook
raises midway, the optimizer's ``state``, ``param_groups``, ``defaults``, every parameter and
every ``.grad`` are equal (``torch.equal``, same dtype) *and* the same objects afterwards, and no
tensor was modified in place (its version counter did not move).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import IdentitySnapshot, TwoLayerNet, deep_equal

import sparse_ckpt as sc

FORMATS = ("packed", "flat")


OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "SGD": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9),
    "Adam": lambda g: torch.optim.Adam(g, lr=0.01),
    "AdamW": lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1),
    "Adagrad": lambda g: torch.optim.Adagrad(g, lr=0.01),
    "RMSprop": lambda g: torch.optim.RMSprop(g, lr=0.01, momentum=0.5, centered=True),
    "Adamax": lambda g: torch.optim.Adamax(g, lr=0.01),
    "NAdam": lambda g: torch.optim.NAdam(g, lr=0.01),
    "RAdam": lambda g: torch.optim.RAdam(g, lr=0.01),
    "Adadelta": lambda g: torch.optim.Adadelta(g, lr=1.0),
    "ASGD": lambda g: torch.optim.ASGD(g, lr=0.01),
    "Rprop": lambda g: torch.optim.Rprop(g, lr=0.01),
}
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZERS["Adafactor"] = lambda g: torch.optim.Adafactor(g, lr=0.01)

HISTORIES = ("never", "partial", "stepped")


Net = TwoLayerNet
"""Two layers plus a parameter that never receives a gradient in the 'partial' history."""


def make(name: str, history: str) -> tuple[Net, torch.optim.Optimizer]:
    """A model and optimizer (two groups with different lr) with the given history."""
    torch.manual_seed(0)
    model = Net()
    groups = [
        {"params": [model.a.weight, model.a.bias, model.unused]},
        {"params": [model.b.weight, model.b.bias], "lr": 0.003},
    ]
    opt = OPTIMIZERS[name](groups)
    steps = {"never": 0, "partial": 1, "stepped": 2}[history]
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4)).pow(2).sum().backward()
        if history == "stepped":
            model.unused.grad = torch.randn(5)
        opt.step()
    # leave live gradients in place: a save must not touch them
    model(torch.randn(6, 4)).sum().backward()
    return model, opt


# --------------------------------------------------------------------------- deep snapshots (helpers.IdentitySnapshot)


# "Unchanged" is exact: key order included, dicts required to be dicts; a NaN Python float equals
# NaN (a tensor holding NaN follows ``torch.equal``, so never equals itself); the same for
# IdentitySnapshot (its default nan_equal="floats").
SAME = {"nan_equal": "floats", "mapping": dict}


# --------------------------------------------------------------------------- tests


def test_snapshot_detects_mutation() -> None:
    """The comparison used below is not a tautology: each kind of mutation is caught."""
    mutations: list[Callable[[Net, torch.optim.Optimizer], None]] = [
        lambda m, o: o.param_groups[0].__setitem__("lr", 0.5),
        lambda m, o: next(iter(o.state.values()))["exp_avg"].add_(0),
        lambda m, o: next(iter(o.state.values())).__setitem__("extra", 1),
        lambda m, o: o.state[m.unused],  # defaultdict access creates an entry
        lambda m, o: setattr(m.a.weight, "grad", None),
        lambda m, o: m.a.bias.grad.zero_(),
        lambda m, o: m.b.weight.data.mul_(2),
        lambda m, o: m.b.weight.detach().add_(0),  # same values, but modified in place
        lambda m, o: o.param_groups.reverse(),
    ]
    for mutate in mutations:
        model, opt = make("Adam", "partial")
        snap = IdentitySnapshot(model, [opt])
        mutate(model, opt)
        with pytest.raises(AssertionError):
            snap.assert_unchanged(model)


@pytest.mark.parametrize("history", HISTORIES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_save_never_mutates(name: str, history: str) -> None:
    """Packed and flat saves leave optimizer, parameters and gradients untouched."""
    model, opt = make(name, history)
    reference = copy.deepcopy(opt.state_dict())
    snap = IdentitySnapshot(model, [opt])
    n_state = len(opt.state)
    outs = {fmt: sc.sparse_state_dict(model, opt, format=fmt) for fmt in FORMATS}
    snap.assert_unchanged(model)
    assert len(opt.state) == n_state
    if not opt.state:  # never stepped (Adagrad creates its state in the constructor)
        assert history == "never"
        assert not any(k.startswith("state.") for out in outs.values() for k in out)
    # the saved values are the live values, not altered copies
    for fmt, out in outs.items():
        assert any(k.startswith("param_groups.") for k in out), fmt
        for key, value in out.items():
            if isinstance(value, torch.Tensor) and key.endswith(".exp_avg"):
                assert torch.isfinite(value).all()
    assert deep_equal(opt.state_dict(), reference, **SAME)


class HookError(RuntimeError):
    """Raised by the test hooks."""


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("where", ["first_pre", "second_pre", "first_post", "second_post"])
def test_raising_hook_leaves_optimizer_unchanged(where: str, fmt: str) -> None:
    """A hook raising midway propagates and changes nothing; the guard is released."""
    model, opt = make("AdamW", "partial")
    calls: list[str] = []
    armed = [True]

    def pre(name: str) -> Callable[[Any], None]:
        def hook(_opt: Any) -> None:
            calls.append(name)
            if armed[0] and where == name:
                raise HookError(name)

        return hook

    def post(name: str) -> Callable[[Any, dict], None]:
        def hook(_opt: Any, sd: dict) -> None:
            calls.append(name)
            if armed[0] and where == name:
                raise HookError(name)

        return hook

    opt.register_state_dict_pre_hook(pre("first_pre"))
    opt.register_state_dict_pre_hook(pre("second_pre"))
    opt.register_state_dict_post_hook(post("first_post"))
    opt.register_state_dict_post_hook(post("second_post"))
    snap = IdentitySnapshot(model, [opt])
    with pytest.raises(HookError, match=where):
        sc.sparse_state_dict(model, opt, format=fmt)
    order = ["first_pre", "second_pre", "first_post", "second_post"]
    assert calls == order[: order.index(where) + 1]
    snap.assert_unchanged(model)
    armed[0] = False  # the guard was released: the next save works and still changes nothing
    out = sc.sparse_state_dict(model, opt, format=fmt)
    assert any(k.startswith("state.") for k in out)
    snap.assert_unchanged(model)


def _mutate_groups(sd: dict) -> None:
    sd["param_groups"][0]["lr"] = 123.0
    del sd["param_groups"][1]["betas"]
    sd["param_groups"][0]["params"].reverse()
    sd["param_groups"].reverse()


def _mutate_state_top(sd: dict) -> None:
    sd["state"].pop(next(iter(sd["state"])))
    sd["state"]["bogus"] = {"x": 1}


def _mutate_state_entries(sd: dict) -> None:
    for entry in sd["state"].values():
        entry["exp_avg"] = torch.zeros(1)
        del entry["step"]
        entry["new"] = 7


@pytest.mark.parametrize("raises", [True, False], ids=["then_raises", "returns"])
@pytest.mark.parametrize("mutate", [_mutate_groups, _mutate_state_top, _mutate_state_entries], ids=lambda f: f.__name__)
def test_post_hook_mutating_serialized_dict(mutate: Callable[[dict], None], raises: bool) -> None:
    """A post-hook editing the serialized dict (then raising or not) never reaches the live optimizer.

    ``torch.optim.Optimizer.state_dict`` hands hooks the live per-parameter state dicts, so such a
    hook would corrupt a torch optimizer; sparse_ckpt hands them copies.
    """
    model, opt = make("AdamW", "stepped")

    def hook(_opt: Any, sd: dict) -> None:
        mutate(sd)
        if raises:
            raise HookError("after mutating")

    opt.register_state_dict_post_hook(hook)
    snap = IdentitySnapshot(model, [opt])
    for fmt in FORMATS:
        if raises:
            with pytest.raises(HookError):
                sc.sparse_state_dict(model, opt, format=fmt)
        else:
            try:
                sc.sparse_state_dict(model, opt, format=fmt)
            except sc.SparseCheckpointError:
                pass  # the mutated dict may be rejected (e.g. a state key that is not a parameter id)
        snap.assert_unchanged(model)


@pytest.mark.parametrize("fmt", FORMATS)
def test_multi_optimizer_second_leaf_hook_raises(fmt: str) -> None:
    """A failure in a later leaf leaves every leaf (including the already captured one) unchanged."""
    torch.manual_seed(0)
    model = Net()
    experts = torch.optim.Adam([model.a.weight, model.a.bias, model.unused], lr=0.01)
    dense = torch.optim.SGD([model.b.weight, model.b.bias], lr=0.1, momentum=0.9)
    multi = sc.MultiOptimizer(model, {"experts": experts, "dense": dense})
    model(torch.randn(3, 4)).sum().backward()
    multi.step()
    model(torch.randn(3, 4)).sum().backward()
    seen: list[str] = []
    experts.register_state_dict_post_hook(lambda o, sd: seen.append("experts"))

    def boom(_opt: Any, sd: dict) -> None:
        sd["param_groups"][0]["momentum"] = 0.0
        raise HookError("dense")

    dense.register_state_dict_post_hook(boom)
    snap = IdentitySnapshot(model, [experts, dense])
    with pytest.raises(HookError):
        sc.sparse_state_dict(model, multi, format=fmt)
    assert seen == ["experts"]
    snap.assert_unchanged(model)
