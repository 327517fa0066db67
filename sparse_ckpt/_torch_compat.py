"""The few private torch attributes sparse_ckpt must touch, isolated in one place.

torch exposes ``register_*_hook`` but no public way to enumerate an optimizer's registered
state-dict hooks; reproducing ``Optimizer.state_dict``/``load_state_dict`` faithfully needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def state_dict_pre_hooks(opt: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The optimizer's ``state_dict`` pre-hooks, in call order."""
    return list(getattr(opt, "_optimizer_state_dict_pre_hooks", {}).values())


def state_dict_post_hooks(opt: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The optimizer's ``state_dict`` post-hooks, in call order."""
    return list(getattr(opt, "_optimizer_state_dict_post_hooks", {}).values())


def load_state_dict_pre_hooks(opt: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The optimizer's ``load_state_dict`` pre-hooks, in call order."""
    return list(getattr(opt, "_optimizer_load_state_dict_pre_hooks", {}).values())


def load_state_dict_post_hooks(opt: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The optimizer's ``load_state_dict`` post-hooks, in call order."""
    return list(getattr(opt, "_optimizer_load_state_dict_post_hooks", {}).values())
