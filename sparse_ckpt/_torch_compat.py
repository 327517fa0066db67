"""The few private torch attributes sparse_ckpt must touch, isolated in one place.

torch exposes ``register_*_hook`` but no public way to enumerate an optimizer's registered
state-dict hooks; reproducing ``Optimizer.state_dict``/``load_state_dict`` faithfully needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _backend


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


def tensor_version(value: Any) -> int | None:
    """A tensor's version counter (bumped by every in-place change), ``None`` for other values."""
    return value._version if isinstance(value, torch.Tensor) else None


_BASE_NAMED_MODULES = torch.nn.Module.named_modules
_BASE_NAMED_PARAMETERS = torch.nn.Module.named_parameters


def map_parameters(
    model: torch.nn.Module, stripped: frozenset[str], module_wrapper: type | None, cached: tuple | None
) -> tuple[tuple | None, dict[int, str], dict[str, str], dict[str, torch.Tensor]] | None:
    """The core's ``map_parameters``: the FQN map from one iterative walk over
    ``Module._modules``/``Module._parameters`` (or a replay of ``cached``), in
    ``model.named_parameters(remove_duplicate=False)`` order. ``named_modules`` is a recursive
    generator whose cost per module grows with depth, which at 100 000+ modules dominated
    ``sparse_state_dict``. Returns ``None`` when the model or a submodule overrides
    ``named_parameters``/``named_modules``; the caller then uses the public API.
    """
    return _backend.core.map_parameters(
        model, stripped, module_wrapper, _BASE_NAMED_MODULES, _BASE_NAMED_PARAMETERS, cached
    )


def _dcp_load_code() -> Any:
    """The code object of ``torch.distributed.checkpoint.load`` (unwrapped), or ``None``."""
    try:
        import inspect

        from torch.distributed.checkpoint import state_dict_loader
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    fn = inspect.unwrap(getattr(state_dict_loader, "load", None) or (lambda: None))
    return getattr(fn, "__code__", None)


_DCP_LOAD_CODE = _dcp_load_code()


def called_by_dcp_load(frame: Any) -> bool:
    """``True`` when ``frame`` is ``torch.distributed.checkpoint.load`` itself: a ``Stateful``'s
    ``state_dict()`` called from there builds a *load target* (which DCP then plans and fills),
    not a dict to save. ``False`` whenever that cannot be told (another torch layout): the caller
    then does what it does for a save, which is always correct, only slower."""
    return _DCP_LOAD_CODE is not None and frame is not None and frame.f_code is _DCP_LOAD_CODE
