"""Normalise the ``optimizer`` argument into named leaves.

A plain ``torch.optim.Optimizer`` is one leaf named ``"optim"``; a :class:`MultiOptimizer` or a
``Mapping[str, Optimizer]`` gives its items in order. The optimizer containers of the trainers
users run are recognised by their documented attributes (no trainer package is imported):

* VeOmni's ``MultiOptimizer`` (``optimizers_dict`` and ``key_names``): leaves named by
  ``key_names``, in that order;
* torchtitan's ``OptimizersContainer`` (``optimizers``, a list, and ``model_parts``): leaves
  ``optim0``, ``optim1``, ... in list order -- the order torchtitan builds them in, so the names
  survive a rebuild from the same config;
* a thin wrapper such as Accelerate's ``AcceleratedOptimizer``: an object whose ``optimizer``
  attribute is an optimizer whose ``param_groups`` and ``state`` are the wrapper's own (the same
  objects), so the wrapper keeps nothing the wrapped optimizer does not; it is unwrapped.

These containers subclass ``torch.optim.Optimizer`` and override ``state_dict`` with torch DSD
calls (which invent state for parameters that never stepped), so they are recognised *before*
the plain optimizer case.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._format.keys import OPTIMIZER_PREFIXES, PLANNER_GUARD_KEY

SINGLE_LEAF = "optim"
TITAN_LEAF = "optim{}"
"""Leaf name pattern of torchtitan's ``OptimizersContainer.optimizers[i]``."""

_WRAPPER_DEPTH = 8
"""Most nested thin wrappers unwrapped (a wrapper that wraps itself must not loop)."""


def named_leaves(optimizer: Any) -> list[tuple[str, torch.optim.Optimizer]]:
    """``[(leaf_name, optimizer), ...]`` for any supported optimizer argument (see the module doc)."""
    refuse_state_dict(optimizer)
    container = container_leaves(optimizer)
    if container is not None:
        pairs = container
    elif isinstance(optimizer, torch.optim.Optimizer):
        return [(SINGLE_LEAF, unwrap(optimizer))]
    elif callable(getattr(optimizer, "leaves", None)):  # sparse_ckpt.MultiOptimizer
        pairs = list(optimizer.leaves())
    elif isinstance(optimizer, Mapping):
        pairs = [(name, _leaf_value(name, opt)) for name, opt in optimizer.items()]
    else:
        raise TypeError(
            "expected a torch.optim.Optimizer, a sparse_ckpt.MultiOptimizer, a Mapping[str, Optimizer] or a trainer's "
            f"optimizer container (VeOmni MultiOptimizer, torchtitan OptimizersContainer, Accelerate "
            f"AcceleratedOptimizer), got {type(optimizer).__name__}{held_optimizers_hint(optimizer)}"
        )
    for name, _opt in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"leaf name {name!r} is not a non-empty string")
    return pairs


def container_leaves(obj: Any) -> list[tuple[str, Any]] | None:
    """The named leaves of a recognised trainer container (VeOmni, torchtitan), else ``None``."""
    if isinstance(obj, Mapping) or callable(getattr(obj, "leaves", None)):
        return None
    optimizers_dict = _attr(obj, "optimizers_dict")
    key_names = _attr(obj, "key_names")
    if isinstance(optimizers_dict, Mapping) and isinstance(key_names, Sequence) and not isinstance(key_names, str):
        return _veomni_leaves(type(obj).__name__, optimizers_dict, key_names)
    optimizers = _attr(obj, "optimizers")
    if isinstance(optimizers, (list, tuple)) and _attr(obj, "model_parts") is not None:
        return [(TITAN_LEAF.format(i), _leaf_value(TITAN_LEAF.format(i), opt)) for i, opt in enumerate(optimizers)]
    return None


def _veomni_leaves(cls: str, optimizers: Mapping[Any, Any], key_names: Sequence[Any]) -> list[tuple[str, Any]]:
    names = list(key_names)
    unknown = [n for n in names if n not in optimizers]
    if unknown:
        raise ValueError(f"{cls}.key_names lists {unknown!r}, which optimizers_dict lacks")
    unlisted = [n for n in optimizers if n not in names]
    if unlisted:
        raise ValueError(
            f"{cls}.optimizers_dict has {unlisted!r}, which key_names does not list (its own state_dict would drop "
            "them); add them to key_names or pass a mapping of the optimizers to save"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{cls}.key_names lists a name twice: {names!r}")
    return [(name, _leaf_value(name, optimizers[name])) for name in names]


PASS_THE_OPTIMIZER = (
    "pass the optimizer (`opt`, not `opt.state_dict()`), a sparse_ckpt.MultiOptimizer or a mapping {name: optimizer}"
)


def refuse_state_dict(obj: Any, leaf: str | None = None, advice: str = PASS_THE_OPTIMIZER) -> None:
    """`TypeError` when ``obj``, given where an optimizer is expected, is a state dict: torch's
    ``optimizer.state_dict()`` (``state`` and ``param_groups``) or an optimizer dict of flat keys
    (``state.*``, ``param_groups.*``: `sparse_state_dict`'s, DSD's, a Stateful's ``state_dict()``)."""
    if not isinstance(obj, Mapping) or not obj or any(isinstance(v, torch.optim.Optimizer) for v in obj.values()):
        return
    if "state" in obj and "param_groups" in obj:
        kind = "an optimizer's state_dict() (keys 'state' and 'param_groups')"
    elif all(isinstance(k, str) and (k.startswith(OPTIMIZER_PREFIXES) or k == PLANNER_GUARD_KEY) for k in obj):
        kind = "an optimizer state dict of 'state.*' and 'param_groups.*' keys"
    else:
        return
    where = f"leaf {leaf!r}: " if leaf is not None else ""
    raise TypeError(f"{where}you passed a state dict ({kind}) where an optimizer is expected; {advice}")


def _leaf_value(name: Any, opt: Any) -> Any:
    """A leaf's optimizer, thin wrappers unwrapped; a multi-optimizer container as one leaf is refused."""
    refuse_state_dict(opt, name)
    if container_leaves(opt) is not None or isinstance(opt, Mapping) or callable(getattr(opt, "leaves", None)):
        raise TypeError(
            f"leaf {name!r} is a {type(opt).__name__}, a container of several optimizers; pass the container "
            "itself (or one mapping of all its optimizers), not nested in another mapping"
        )
    return unwrap(opt) if isinstance(opt, torch.optim.Optimizer) else opt


def unwrap(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a thin wrapper (Accelerate's ``AcceleratedOptimizer``) wraps, else ``opt``."""
    for _ in range(_WRAPPER_DEPTH):
        inner = thin_wrapped(opt)
        if inner is None:
            return opt
        opt = inner
    return opt


def thin_wrapped(opt: Any) -> torch.optim.Optimizer | None:
    """``opt.optimizer`` when ``opt`` only forwards to it (the same ``param_groups`` and ``state``)."""
    inner = _attr(opt, "optimizer")
    if inner is None or inner is opt or not isinstance(inner, torch.optim.Optimizer):
        return None
    try:
        same = opt.param_groups is inner.param_groups and opt.state is inner.state
    except Exception:  # noqa: BLE001 - a property that fails: not a thin wrapper
        return None
    return inner if same else None


def held_optimizers_hint(obj: Any) -> str:
    """``"; it holds optimizers at .x ..."``: what to pass instead of an object that holds optimizers."""
    found = []
    for attr, value in _instance_attrs(obj):
        if isinstance(value, torch.optim.Optimizer) and value is not obj:
            found.append(f"`.{attr}` (a {type(value).__name__})")
        elif isinstance(value, Mapping) and value and all(isinstance(v, torch.optim.Optimizer) for v in value.values()):
            found.append(f"`.{attr}` (a mapping of {len(value)} optimizers)")
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.optim.Optimizer) for v in value):
            found.append(f"`.{attr}` (a list of {len(value)} optimizers)")
    if not found:
        return ""
    return (
        f"; it holds optimizer(s) at {', '.join(found)}: pass the optimizer, or a mapping "
        "{name: optimizer} of them, if its state_dict saves nothing of its own (else register an adapter)"
    )


def _instance_attrs(obj: Any) -> list[tuple[str, Any]]:
    try:
        return list(vars(obj).items())
    except TypeError:  # no __dict__
        return []


def _attr(obj: Any, name: str) -> Any:
    """``obj.name`` from the instance (or a property), ``None`` when absent or failing."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a property that raises counts as absent
        return None
