"""A state dict passed where an optimizer is expected (``sparse_state_dict``, ``load_sparse_state_dict``,
``SparseOptimizerState``, ``MultiOptimizer``) is refused saying so -- "you passed a state dict; pass the
optimizer" -- instead of a message about internals; the advice, followed, works."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import sparse_ckpt as sc


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def _state_dicts(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "torch": opt.state_dict(),
        "sparse": sc.sparse_state_dict(model, opt),
        "stateful": sc.SparseOptimizerState(model, opt).state_dict(),  # holds the planner guard
    }


CALLS: dict[str, Callable[[nn.Module, Any, Any], Any]] = {
    "sparse_state_dict": lambda model, opt, good: sc.sparse_state_dict(model, opt),
    "load_sparse_state_dict": lambda model, opt, good: sc.load_sparse_state_dict(model, opt, good),
    "SparseOptimizerState": lambda model, opt, good: sc.SparseOptimizerState(model, opt).state_dict(),
    "MultiOptimizer": lambda model, opt, good: sc.MultiOptimizer(model, opt),
    "MultiOptimizer leaf": lambda model, opt, good: sc.MultiOptimizer(model, {"dense": opt}),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", ["torch", "sparse", "stateful"])
def test_a_state_dict_for_an_optimizer_is_refused_saying_so(call: str, kind: str) -> None:
    model, opt = _trained()
    good = sc.sparse_state_dict(model, opt)
    with pytest.raises(TypeError) as exc:
        CALLS[call](model, _state_dicts(model, opt)[kind], good)
    message = str(exc.value)
    assert ("{name: optimizer}" in message) and ("`{'experts': opt}`" in message) == (call == "MultiOptimizer"), message
    assert "you passed a state dict" in message and "pass the optimizer" in message, message
    assert "_PlannerGuard" not in message and "container of several optimizers" not in message, message
    assert message.startswith("leaf 'dense': ") == (call == "MultiOptimizer leaf"), message
    CALLS[call](model, {"dense": opt} if call == "MultiOptimizer" else opt, good)  # the advice, followed


def test_leaves_named_like_state_dict_keys_are_still_optimizers() -> None:
    model, _opt = _trained()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.2)
    assert sc.sparse_state_dict(model, {"state": first, "param_groups": second})  # two leaves, not a state dict
