"""Interop with torch DSD's flat optimizer state dict (``flatten_optimizer_state_dict=True``).

(a) a DSD-written flat dict of a fully stepped optimizer loads with ``load_sparse_state_dict``
    and gives the same optimizer as DSD's own ``set_optimizer_state_dict``;
(b) our ``format="flat"`` dict loads with DSD's ``set_optimizer_state_dict`` when every parameter
    has state, with the same result as our loader;
(c) what DSD does with our flat dict when some parameters have no state (documented behaviour,
    asserted so that a change in torch shows up here);
(d) what DSD's ``get_optimizer_state_dict`` does to an optimizer that never stepped.

DSD needs no process group for a plain CPU model; ``tests/_dsd.py`` wraps its API.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dsd import dsd_get, dsd_set
from helpers import LayerNet, assert_deep_equal, fqn_view, layer_params
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._format.keys_record import is_record_key


def _Net(seed: int = 0) -> LayerNet:
    return LayerNet(n=3, seed=seed)


_layer = layer_params


def _adamw(model: _Net, lr: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": _layer(model, 0)}, {"params": _layer(model, 1, 2), "lr": lr * 2}], lr=lr)


def _sgd(model: _Net, lr: float = 0.01) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [{"params": _layer(model, 0, 1)}, {"params": _layer(model, 2), "lr": lr * 2}], lr=lr, momentum=0.9
    )


def _train(model: _Net, opts: list[torch.optim.Optimizer], with_grad: list[nn.Parameter], steps: int = 2) -> None:
    for s in range(steps):
        gen = torch.Generator().manual_seed(s)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) if any(p is q for q in with_grad) else None
        for opt in opts:
            opt.step()
    for opt in opts:
        opt.zero_grad(set_to_none=True)
        for g in opt.param_groups:  # a scheduler moved every lr
            g["lr"] = g["lr"] * 0.25


DSD_FILLS_MISSING_FLAT_STATE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 10)
"""Pins torch's own DSD behaviour in (c): from torch 2.10 (pytorch#165071, nested state rebuilt by
recursion) ``set_optimizer_state_dict`` rebuilds a flat state key the dict lacks as ``{}``; before it
raised ``KeyError('state.<fqn>.<key>')``. Checked on 2.7.1 and 2.9.1 (KeyError), 2.13.0 ({})."""


def _dsd_set_before_2_10(model: nn.Module, opt: torch.optim.Optimizer, flat: dict[str, Any]) -> bool:
    """Before torch 2.10 DSD refuses a flat dict without a state key of the target: ``True`` when
    that is what happened here (the test then ends), ``False`` on torch 2.10+."""
    if DSD_FILLS_MISSING_FLAT_STATE:
        return False
    with pytest.raises(KeyError, match=r"state\.layers\.2\."):
        dsd_set(model, opt, flat)
    return True


# The views are compared without key order (DSD puts ``params`` first in the groups it loads,
# torch last), with NaN never equal and dicts required to be dicts.
SAME = {"check_order": False, "nan_equal": "none", "mapping": dict}


def test_dsd_needs_no_process_group_here() -> None:
    assert not (dist.is_available() and dist.is_initialized())
    model = _Net()
    opt = _adamw(model)
    _train(model, [opt], list(model.parameters()))
    assert "param_groups.layers.0.weight.lr" in dsd_get(model, opt)


def _loads_like_dsd_and_source(
    make: Any, flat: dict[str, Any], src_model: nn.Module, src: Any
) -> torch.optim.Optimizer:
    """``flat`` loaded by us and by DSD into fresh copies (other values, lr 0.5): both equal, and
    equal to the source."""
    ours_model, dsd_model = _Net(seed=1), _Net(seed=1)
    ours, theirs = make(ours_model, lr=0.5), make(dsd_model, lr=0.5)
    sc.load_sparse_state_dict(ours_model, ours, flat)
    dsd_set(dsd_model, theirs, flat)
    assert_deep_equal(fqn_view(ours_model, [ours]), fqn_view(dsd_model, [theirs]), "ours vs DSD", **SAME)
    assert_deep_equal(fqn_view(ours_model, [ours]), fqn_view(src_model, [src]), "ours vs source", **SAME)
    return ours


# --------------------------------------------------------------------------- (a) DSD -> ours


@pytest.mark.parametrize("make", [_adamw, _sgd], ids=["adamw", "sgd"])
def test_dsd_flat_dict_loads_like_dsd_set(make: Any) -> None:
    src_model = _Net()
    src = make(src_model)
    _train(src_model, [src], list(src_model.parameters()))
    flat = dsd_get(src_model, src)
    assert any(k.startswith("state.") for k in flat) and not any("__packed__" in k for k in flat)
    ours = _loads_like_dsd_and_source(make, flat, src_model, src)
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in src.param_groups]


def test_dsd_flat_dict_of_two_optimizers_loads_into_a_multioptimizer() -> None:
    src_model = _Net()
    a, b = (
        torch.optim.AdamW(_layer(src_model, 0, 1), lr=0.01),
        torch.optim.SGD(_layer(src_model, 2), lr=0.1, momentum=0.9),
    )
    _train(src_model, [a, b], list(src_model.parameters()))
    flat = dsd_get(src_model, [a, b])
    model, dsd_model = _Net(seed=1), _Net(seed=1)
    ours = sc.MultiOptimizer(
        model,
        {
            "a": torch.optim.AdamW(_layer(model, 0, 1), lr=0.5),
            "b": torch.optim.SGD(_layer(model, 2), lr=0.5, momentum=0.9),
        },
    )
    theirs = [
        torch.optim.AdamW(_layer(dsd_model, 0, 1), lr=0.5),
        torch.optim.SGD(_layer(dsd_model, 2), lr=0.5, momentum=0.9),
    ]
    sc.load_sparse_state_dict(model, ours, flat)
    dsd_set(dsd_model, theirs, flat)
    assert_deep_equal(fqn_view(model, [o for _, o in ours.leaves()]), fqn_view(dsd_model, theirs), **SAME)


# --------------------------------------------------------------------------- (b) ours -> DSD


@pytest.mark.parametrize("make", [_adamw, _sgd], ids=["adamw", "sgd"])
def test_our_flat_dict_loads_with_dsd_when_every_param_has_state(make: Any) -> None:
    src_model = _Net()
    src = make(src_model)
    _train(src_model, [src], list(src_model.parameters()))
    flat = sc.sparse_state_dict(src_model, src, format="flat")
    extra = set(flat) - set(dsd_get(src_model, src))  # DSD's key layout, byte for byte, plus the key record
    assert set(dsd_get(src_model, src)) <= set(flat) and len(extra) == 1 and is_record_key(extra.pop())
    _loads_like_dsd_and_source(make, flat, src_model, src)  # stock DSD reads it, record and all


# --------------------------------------------------------------------------- (c) sparse flat -> DSD


def _sparse_flat(make: Any) -> tuple[_Net, torch.optim.Optimizer, dict[str, Any]]:
    """Layers 0 and 1 stepped, layer 2 never got a gradient (no state)."""
    src_model = _Net()
    src = make(src_model)
    _train(src_model, [src], _layer(src_model, 0, 1))
    flat = sc.sparse_state_dict(src_model, src, format="flat")
    assert not any(k.startswith("state.layers.2.") for k in flat)
    return src_model, src, flat


def test_dsd_on_sparse_flat_dict_adamw_fresh_target_raises_after_inventing_state() -> None:
    """DSD on a sparse dict, AdamW target with no state and no grads.

    ``set_optimizer_state_dict`` first runs its synthetic step (``_init_optim_state``: zero
    grads, lr set to 0), which creates ``step=1`` state for *every* parameter of the target. It
    then rebuilds each parameter's state from the *target's* state keys; for a parameter absent
    from the checkpoint every key becomes ``{}``. ``Optimizer.load_state_dict`` installs that, and
    AdamW's ``__setstate__`` then fails on ``float({})`` with a ``TypeError`` -- leaving the target
    half loaded: the saved lrs, saved state for the stepped parameters and ``{}`` placeholders for
    the others. ``load_sparse_state_dict`` loads the same dict exactly, with no state invented.
    """
    src_model, src, flat = _sparse_flat(_adamw)
    model = _Net(seed=1)
    opt = _adamw(model, lr=0.5)
    if not _dsd_set_before_2_10(model, opt, flat):
        with pytest.raises(TypeError, match="float"):
            dsd_set(model, opt, flat)
        for p in _layer(model, 2):
            assert opt.state[p] == {"step": {}, "exp_avg": {}, "exp_avg_sq": {}}
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in src.param_groups]
        assert all(p.grad is None for p in model.parameters())  # its zero grads were set to None again

    ours_model = _Net(seed=1)
    ours = _adamw(ours_model, lr=0.5)
    sc.load_sparse_state_dict(ours_model, ours, flat)
    assert_deep_equal(fqn_view(ours_model, [ours]), fqn_view(src_model, [src]), **SAME)
    assert all(p not in ours.state for p in _layer(ours_model, 2))


def test_dsd_on_sparse_flat_dict_sgd_loads_empty_dict_buffers_that_break_the_next_step() -> None:
    """Same path with SGD(momentum): SGD's ``__setstate__`` does not look at the state, so the
    load "succeeds", but the stateless parameters get ``momentum_buffer == {}`` and the next
    ``step()`` fails (``'dict' object has no attribute 'mul_'``)."""
    _, _, flat = _sparse_flat(_sgd)
    model = _Net(seed=1)
    opt = _sgd(model, lr=0.5)
    if _dsd_set_before_2_10(model, opt, flat):
        return
    dsd_set(model, opt, flat)
    for p in _layer(model, 2):
        assert opt.state[p] == {"momentum_buffer": {}}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(AttributeError, match="mul_"):
        opt.step()


def test_dsd_on_any_flat_dict_with_stale_grads_drops_all_state() -> None:
    """If any target parameter already has a ``.grad`` (and the target has no state), DSD skips
    its synthetic step; with the target's state empty it rebuilds *every* parameter's state as
    ``{}``, so even the saved state is silently dropped -- no error."""
    src_model, src, flat = _sparse_flat(_adamw)
    model = _Net(seed=1)
    opt = _adamw(model, lr=0.5)
    model.layers[0].weight.grad = torch.zeros(3, 3)
    dsd_set(model, opt, flat)
    assert len(opt.state) == 6 and all(s == {} for s in opt.state.values())

    ours_model = _Net(seed=1)
    ours = _adamw(ours_model, lr=0.5)
    ours_model.layers[0].weight.grad = torch.zeros(3, 3)
    sc.load_sparse_state_dict(ours_model, ours, flat)
    assert_deep_equal(fqn_view(ours_model, [ours]), fqn_view(src_model, [src]), **SAME)


# --------------------------------------------------------------------------- (d) DSD get on a never-stepped optimizer


def test_dsd_get_on_a_never_stepped_optimizer_invents_step_1_state() -> None:
    """DSD's ``get_optimizer_state_dict`` runs the same synthetic step on an optimizer without
    state: the *live* optimizer gains ``step == 1`` state for every parameter, and the saved dict
    holds it. ``sparse_state_dict`` saves only the groups' settings and mutates nothing."""
    model = _Net()
    opt = _adamw(model)
    flat = dsd_get(model, opt)
    assert len(opt.state) == 6 and all(float(s["step"]) == 1.0 for s in opt.state.values())
    assert float(flat["state.layers.2.weight.step"]) == 1.0

    model2 = _Net()
    opt2 = _adamw(model2)
    ours = sc.sparse_state_dict(model2, opt2, format="flat")
    assert len(opt2.state) == 0 and not any(k.startswith("state.") for k in ours)
