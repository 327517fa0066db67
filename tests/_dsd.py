"""Isolated test helper: torch DSD's optimizer state-dict API in its flattened form.

``torch.distributed.checkpoint.state_dict`` works on a plain (non-wrapped) CPU model without a
process group, so no fixture is needed. Only the interop tests import this module; nothing
private of torch is used here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def dsd_get(model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> dict[str, Any]:
    """DSD ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``."""
    return dict(get_optimizer_state_dict(model, optimizers, options=FLAT))


def dsd_set(
    model: nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], state_dict: dict[str, Any]
) -> None:
    """DSD ``set_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``."""
    set_optimizer_state_dict(model, optimizers, state_dict, options=FLAT)
