"""Apply a torch-format packed dict to an optimizer in O(P).

Observable sequence identical to ``torch.optim.Optimizer.load_state_dict``: shallow copy,
pre-hooks (may replace the dict), validation, deep-copied groups, state cast with torch's
policy, ``__setstate__``, post-hooks. torch's own loop finds each parameter's group by scanning
all groups (O(P x groups)); here a precomputed ``id -> group flags`` map makes it O(P).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch

from .._format.keys import STEP_KEY
from .._immutable import IMMUTABLE_TYPES, is_immutable
from .._torch_internals import load_state_dict_post_hooks, load_state_dict_pre_hooks
from ..errors import CheckpointMismatchError

_BASE_LOAD_STATE_DICT = torch.optim.Optimizer.load_state_dict


def overrides_load_state_dict(optimizer: Any) -> bool:
    """``True`` when the class or instance replaces ``Optimizer.load_state_dict``."""
    return "load_state_dict" in vars(optimizer) or type(optimizer).load_state_dict is not _BASE_LOAD_STATE_DICT


def cast_value(param: torch.Tensor, value: Any, fused_or_capturable: bool, key: Any) -> Any:
    """torch's ``_cast``: deep copy ``value``, moving tensors to the param's device/dtype.

    Floating state follows the param's dtype and device; ``step`` is left alone unless the group
    is fused or capturable (then float32 on the param's device). Unlike torch, strings are kept
    as they are (torch's generic iterable branch turns a ``str`` into a generator's repr).
    """
    if isinstance(value, torch.Tensor):
        return cast_tensor(value, key, fused_or_capturable, param.is_floating_point(), param.dtype, param.device)
    if isinstance(value, dict):
        return {k: cast_value(param, v, fused_or_capturable, k) for k, v in value.items()}
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Iterable):
        return type(value)(cast_value(param, v, fused_or_capturable, None) for v in value)  # type: ignore[call-arg]
    return value


def cast_state(param: torch.Tensor, value: Any, fused_or_capturable: bool) -> Any:
    """:func:`cast_value` of one parameter's state (``key=None``), with a fast path for the usual
    ``{name: tensor}`` dict: the param's dtype/device are read once, not once per tensor."""
    if type(value) is not dict:
        return cast_value(param, value, fused_or_capturable, None)
    floating = param.is_floating_point()
    dtype, device = param.dtype, param.device
    return {
        k: cast_tensor(v, k, fused_or_capturable, floating, dtype, device)
        if isinstance(v, torch.Tensor)
        else cast_value(param, v, fused_or_capturable, k)
        for k, v in value.items()
    }


def cast_tensor(
    value: torch.Tensor, key: Any, fused_or_capturable: bool, floating: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One state tensor under torch's policy, given the param's floating-ness, dtype and device."""
    if key == STEP_KEY:
        return value.to(dtype=torch.float32, device=device) if fused_or_capturable else value
    if floating:
        return value.to(dtype=dtype, device=device)
    return value.to(device=device)


def copy_settings(value: Any) -> Any:
    """``copy.deepcopy`` for param-group values, with fast paths for the common types.

    Immutable scalars and tuples of them are shared, as ``deepcopy`` shares them; containers are
    rebuilt; anything else goes through ``deepcopy``.
    """
    kind = type(value)
    if kind in IMMUTABLE_TYPES:
        return value
    if kind is dict:
        return {k: v if type(v) in IMMUTABLE_TYPES else copy_settings(v) for k, v in value.items()}
    if kind is list:
        return [v if type(v) in IMMUTABLE_TYPES else copy_settings(v) for v in value]
    if kind is tuple:
        return value if is_immutable(value) else tuple(copy_settings(v) for v in value)
    if isinstance(value, tuple(IMMUTABLE_TYPES)):
        return value
    return deepcopy(value)


def copy_group(group: dict[str, Any]) -> dict[str, Any]:
    """A saved group's settings, copied; ``params`` is shared (the caller replaces it)."""
    if type(group) is not dict:
        return copy_settings(group)
    return {k: v if k == "params" or type(v) in IMMUTABLE_TYPES else copy_settings(v) for k, v in group.items()}


@dataclass
class PreparedLoad:
    """A leaf's load, validated and built but not applied yet (see :func:`prepare_packed`)."""

    leaf: str
    optimizer: torch.optim.Optimizer
    state: Any = None
    """The new ``state`` (``None`` when the optimizer's own ``load_state_dict`` is used)."""
    param_groups: list[dict[str, Any]] | None = None
    packed: dict[str, Any] | None = None
    """The packed dict for an optimizer that overrides ``load_state_dict``."""


def prepare_packed(
    leaf: str, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], *, groups_owned: bool = False
) -> PreparedLoad:
    """First half of ``load_state_dict``: pre-hooks, validation, group copies, state cast.

    Mutates nothing (unless a user pre-hook does). For an optimizer that overrides
    ``load_state_dict`` nothing runs here; :func:`commit_prepared` calls its method.
    ``groups_owned=True``: the caller built ``state_dict["param_groups"]`` as new dicts that share
    no mutable value with anything (what torch's deepcopy gives); they are then used as they
    are unless a pre-hook ran (a hook may keep or swap them, so they are copied as torch does).
    """
    if overrides_load_state_dict(optimizer):
        return PreparedLoad(leaf, optimizer, packed=state_dict)
    state_dict = state_dict.copy()
    pre_hooks = load_state_dict_pre_hooks(optimizer)
    for pre_hook in pre_hooks:
        result = pre_hook(optimizer, state_dict)
        if result is not None:
            state_dict = result
    groups = optimizer.param_groups
    raw_groups = state_dict["param_groups"]
    # Each group gets its own copy: settings decoded from a checkpoint are interned, and a
    # tensor lr shared between groups would let a scheduler's in-place update leak across them.
    if groups_owned and not pre_hooks:
        saved_groups = list(raw_groups)
    else:
        saved_groups = [copy_group(g) for g in raw_groups]
    if len(groups) != len(saved_groups):
        raise CheckpointMismatchError(
            f"leaf {leaf!r}: loaded state dict has {len(saved_groups)} parameter groups, the optimizer {len(groups)}"
        )
    id_map: dict[Any, torch.Tensor] = {}
    flags: dict[Any, bool] = {}
    for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise CheckpointMismatchError(
                f"leaf {leaf!r} group {gi}: loaded group has {len(saved['params'])} parameters, "
                f"the optimizer's {len(group['params'])}"
            )
        id_map.update(zip(saved["params"], group["params"]))
    specials = [bool(raw.get("fused", False) or raw.get("capturable", False)) for raw in raw_groups]
    if any(specials):  # otherwise every flag is False, the default below
        for raw, special in zip(raw_groups, specials):  # torch takes the first group listing the id
            for pid in raw["params"]:
                flags.setdefault(pid, special)
    state: defaultdict[Any, Any] = defaultdict(dict)
    for key, value in state_dict["state"].items():
        param = id_map.get(key)
        if param is not None:
            state[param] = cast_state(param, value, flags.get(key, False))
        else:
            state[key] = value
    new_groups = []
    for group, saved in zip(groups, saved_groups):
        saved["params"] = group["params"]
        if "param_names" in group and "param_names" not in saved:
            saved["param_names"] = group["param_names"]
        new_groups.append(saved)
    return PreparedLoad(leaf, optimizer, state=state, param_groups=new_groups)


def commit_prepared(prepared: PreparedLoad) -> None:
    """Second half: install the prepared state and groups (``__setstate__``), no post-hooks yet.

    An optimizer that overrides ``load_state_dict`` has its own method called here (its own
    hooks run inside it).
    """
    if prepared.packed is not None:
        prepared.optimizer.load_state_dict(prepared.packed)
        return
    prepared.optimizer.__setstate__({"state": prepared.state, "param_groups": prepared.param_groups})


def run_post_hooks(prepared: PreparedLoad) -> None:
    """The ``load_state_dict`` post-hooks of a committed leaf, in order."""
    if prepared.packed is not None:
        return
    for post_hook in load_state_dict_post_hooks(prepared.optimizer):
        post_hook(prepared.optimizer)


def snapshot(optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """The objects :func:`commit_prepared` replaces, for :func:`rollback`."""
    return optimizer.state, optimizer.param_groups


def rollback(optimizer: torch.optim.Optimizer, saved: tuple[Any, Any]) -> None:
    """Put back the ``state``/``param_groups`` objects taken by :func:`snapshot`."""
    optimizer.state, optimizer.param_groups = saved
