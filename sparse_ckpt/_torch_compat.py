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



_BASE_NAMED_MODULES = torch.nn.Module.named_modules
_BASE_NAMED_PARAMETERS = torch.nn.Module.named_parameters


def named_parameters_canonical(
    model: torch.nn.Module, stripped: frozenset[str], module_wrapper: type | None
) -> list[tuple[str, str, torch.Tensor]] | None:
    """``(raw name, canonical name, param)`` in ``model.named_parameters(remove_duplicate=False)`` order.

    One iterative walk over ``Module._modules``/``Module._parameters`` (what ``named_modules`` and
    ``named_parameters`` read): ``named_modules`` is a recursive generator whose cost per module
    grows with depth, which at 100 000+ modules dominated ``sparse_state_dict``. A name component
    in ``stripped``, or ``module`` directly under a ``module_wrapper`` instance (DDP), is left out
    of the canonical name. Returns
    ``None`` when the model or a submodule overrides ``named_parameters``/``named_modules``; the
    caller then uses the public API.
    """
    base_modules = _BASE_NAMED_MODULES
    candidates = stripped | {"module"} if module_wrapper is not None else stripped

    def is_wrapper(name: str, owner: torch.nn.Module) -> bool:
        return name in stripped or (module_wrapper is not None and isinstance(owner, module_wrapper))

    if type(model).named_parameters is not _BASE_NAMED_PARAMETERS:
        return None
    out: list[tuple[str, str, torch.Tensor]] = []
    append = out.append
    # (module, raw prefix, canonical prefix); canonical is the raw str object while nothing was stripped
    stack: list[tuple[torch.nn.Module, str, str]] = [(model, "", "")]
    pop, push = stack.pop, stack.append
    while stack:
        mod, raw, canon = pop()
        if type(mod).named_modules is not base_modules:
            return None
        params = mod._parameters
        if params:
            for k, v in params.items():
                if v is None:
                    continue
                raw_k = f"{raw}.{k}" if raw else k
                if k in candidates and is_wrapper(k, mod):
                    append((raw_k, canon, v))
                elif canon is raw:
                    append((raw_k, raw_k, v))
                else:
                    append((raw_k, f"{canon}.{k}" if canon else k, v))
        children = mod._modules
        if children:
            for name, child in reversed(children.items()):
                if child is None:
                    continue
                raw_c = f"{raw}.{name}" if raw else name
                if name in candidates and is_wrapper(name, mod):
                    push((child, raw_c, canon))
                elif canon is raw:
                    push((child, raw_c, raw_c))
                else:
                    push((child, raw_c, f"{canon}.{name}" if canon else name))
    return out
