"""Capture one optimizer leaf exactly as ``torch.optim.Optimizer.state_dict`` would.

Order: refuse unsupported ``state_dict`` overrides, refuse a capture of an optimizer already
being captured (a hook calling back, or another thread: found on the live stacks, so there is no
guard to release and none an interrupt can leave behind), run the pre-hooks, pack (snapshotting
``packed id -> parameter``), run the post-hooks. Nothing here steps, touches ``.grad`` or creates state.
"""

from __future__ import annotations

from types import FrameType
from typing import Any

import torch

from .. import _backend
from .._adapters import adapter_for
from .._leaves import held_optimizers_hint, named_leaves
from .._torch_internals import (
    caller_frame,
    captured_elsewhere,
    state_dict_post_hooks,
    state_dict_pre_hooks,
    tensor_version,
    tracking_capture,
)
from ..errors import CheckpointFormatError, ReentrantSerializationError, UnsupportedStateDictError

_BASE_STATE_DICT = torch.optim.Optimizer.state_dict


def _refuse_if_capturing(leaf: str, optimizer: Any, frame: FrameType) -> None:
    """Raise :class:`ReentrantSerializationError` when ``optimizer`` is already being captured.

    ``frame`` is the caller's :func:`_capture` frame; another live frame of the same function whose
    ``optimizer`` is this one is a hook that calls back into serialization (this thread) or a
    concurrent call (another thread): see :func:`sparse_ckpt._torch_internals.captured_elsewhere`.
    """
    if captured_elsewhere(frame, "optimizer", optimizer):
        raise ReentrantSerializationError(
            f"leaf {leaf!r}: optimizer {type(optimizer).__name__} is already being serialized "
            "(a state_dict hook called back into serialization, or another thread is serializing it)"
        )


def _copy_dicts(value: Any) -> Any:
    """Copy the dict structure of a per-parameter state entry (tensors are shared, as in torch)."""
    if isinstance(value, dict):
        return {k: _copy_dicts(v) for k, v in value.items()}
    return value


def check_supported(leaf: str, optimizer: Any) -> Any:
    """Return the registered adapter (or ``None``) for ``optimizer``; refuse unsupported ones."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedStateDictError(
            f"leaf {leaf!r}: {type(optimizer).__name__} is not a torch.optim.Optimizer{held_optimizers_hint(optimizer)}"
        )
    cls = type(optimizer)
    adapter = adapter_for(cls)
    if "state_dict" in vars(optimizer) and adapter is None:
        raise UnsupportedStateDictError(
            f"leaf {leaf!r}: the {cls.__name__} instance has a patched state_dict attribute; "
            "sparse_ckpt cannot know what it would save (register an adapter for its class with "
            "sparse_ckpt.register_state_dict_adapter)"
        )
    if getattr(cls, "state_dict", None) is not _BASE_STATE_DICT and adapter is None:
        hint = held_optimizers_hint(optimizer)
        raise UnsupportedStateDictError(
            f"leaf {leaf!r}: {cls.__name__} overrides state_dict"
            + (hint or "; register how to capture it with sparse_ckpt.register_state_dict_adapter")
        )
    return adapter


def check_leaves(optimizer: Any) -> list[tuple[str, torch.optim.Optimizer]]:
    """:func:`sparse_ckpt._leaves.named_leaves`, each leaf checked as a save would check it (so a wrong
    object fails where it is handed over, not later inside ``dcp.save``)."""
    leaves = named_leaves(optimizer)
    for leaf, opt in leaves:
        check_supported(leaf, opt)
    return leaves


def capture_packed(leaf: str, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[Any]]:
    """Run the torch ``state_dict`` sequence; return ``(packed_dict, id_to_param)``.

    ``packed_dict`` equals what ``optimizer.state_dict()`` returns; ``id_to_param`` is the
    ``packed id -> parameter`` snapshot taken before any post-hook ran.
    """
    with tracking_capture():
        _fused, packed = _capture(leaf, optimizer, None)
    assert packed is not None
    return packed


def capture_by_fqn(
    leaf: str, optimizer: torch.optim.Optimizer, fqn_of: dict[int, str]
) -> tuple[list[tuple[dict, list[str]]], dict[str, Any]]:
    """What :func:`capture_packed` captures, keyed by FQN: ``(groups_fqn, state_fqn)``.

    Without ``state_dict`` post-hooks (and adapters) nothing can see or change the packed dict,
    so the core goes from the live groups and state to FQNs in one pass, with no int ids."""
    with tracking_capture():
        fused, packed = _capture(leaf, optimizer, fqn_of)
    if fused is not None:
        return fused
    assert packed is not None
    state_dict, id_to_param = packed
    return _backend.core.remap_to_fqns(leaf, state_dict["param_groups"], state_dict["state"], id_to_param, fqn_of)


def _capture(
    leaf: str, optimizer: torch.optim.Optimizer, fqn_of: dict[int, str] | None
) -> tuple[tuple[list, dict] | None, tuple[dict[str, Any], list[Any]] | None]:
    """The capture sequence: ``(by_fqn, None)`` from the one-pass core path (only with ``fqn_of``
    and no post-hooks or adapter), else ``(None, (packed_dict, id_to_param))``."""
    adapter = check_supported(leaf, optimizer)
    # ``optimizer`` must stay bound to the argument for the whole call: the reentrancy check of
    # other calls reads it from this frame.
    _refuse_if_capturing(leaf, optimizer, caller_frame(0))  # type: ignore[arg-type]
    core = _backend.core
    if adapter is not None:
        _groups, _state, id_to_param = core.pack_optimizer(leaf, optimizer.param_groups, {}, torch.Tensor)
        before = live_fingerprint(optimizer)
        state_dict = adapter(optimizer)
        _refuse_if_changed(leaf, optimizer, before, adapter)
    else:
        for pre_hook in state_dict_pre_hooks(optimizer):
            pre_hook(optimizer)
        if fqn_of is not None and not state_dict_post_hooks(optimizer):
            return core.capture_fqns(leaf, optimizer.param_groups, optimizer.state, fqn_of, torch.Tensor), None
        groups, state, id_to_param = core.pack_optimizer(leaf, optimizer.param_groups, optimizer.state, torch.Tensor)
        post_hooks = state_dict_post_hooks(optimizer)
        if post_hooks:  # torch hands hooks the live per-param dicts; edits must not reach the optimizer
            state = {k: _copy_dicts(v) for k, v in state.items()}
        state_dict = {"state": state, "param_groups": groups}
        for post_hook in post_hooks:
            result = post_hook(optimizer, state_dict)
            if result is not None:
                state_dict = result
    _check_packed(leaf, state_dict)
    return None, (state_dict, id_to_param)


def live_fingerprint(optimizer: torch.optim.Optimizer) -> tuple[list[Any], list[Any]]:
    """What identifies an optimizer's live groups and state: each group's dict, parameters and setting
    values (by identity), each state entry's parameter, dict, keys and values (by identity, tensors
    with their version counter, which every in-place change bumps). Equal fingerprints: unchanged."""
    groups = [
        (id(g), [id(p) for p in g["params"]], [(k, id(v)) for k, v in g.items() if k != "params"])
        for g in optimizer.param_groups
    ]
    state = [
        (id(p), id(s), [(k, id(v), tensor_version(v)) for k, v in s.items()] if isinstance(s, dict) else None)
        for p, s in optimizer.state.items()
    ]
    return groups, state


def _refuse_if_changed(leaf: str, optimizer: Any, before: tuple[list[Any], list[Any]], adapter: Any) -> None:
    """An adapter may only read: raise when the live optimizer's groups or state changed under it
    (e.g. a ``state_dict`` that runs torch DSD's synthetic step and creates state)."""
    after = live_fingerprint(optimizer)
    if after == before:
        return
    what = []
    if after[0] != before[0]:
        what.append("its param groups")
    if len(after[1]) != len(before[1]):
        what.append(f"its state ({len(before[1])} -> {len(after[1])} parameters with state)")
    elif after[1] != before[1]:
        what.append("its state values")
    name = getattr(adapter, "__qualname__", None) or type(adapter).__name__
    raise UnsupportedStateDictError(
        f"leaf {leaf!r}: the state_dict adapter {name} changed the live {type(optimizer).__name__} "
        f"({' and '.join(what)}) while it was being saved; an adapter must only read the optimizer (one that "
        "calls torch DSD's get_optimizer_state_dict runs a synthetic step that creates state)"
    )


def _check_packed(leaf: str, state_dict: Any) -> None:
    """What a post-hook or an adapter produced must be a torch-format dict the core reads: a dict
    with a ``state`` dict and a ``param_groups`` list (or tuple) of dicts whose ``params`` are lists
    (or tuples)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state_dict produced {type(state_dict).__name__} without 'state' and 'param_groups' entries"
        )
    state, groups = state_dict["state"], state_dict["param_groups"]
    if not isinstance(state, dict):
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state_dict produced 'state' as a {type(state).__name__}, not a dict"
        )
    if not isinstance(groups, (list, tuple)):
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state_dict produced 'param_groups' as a {type(groups).__name__}, not a list"
        )
    for gi, group in enumerate(groups):
        if not isinstance(group, dict):
            raise CheckpointFormatError(f"leaf {leaf!r}: group {gi} is a {type(group).__name__}, not a dict")
        params = group.get("params", [])
        if not isinstance(params, (list, tuple)):
            raise CheckpointFormatError(f"leaf {leaf!r}: group {gi} 'params' is a {type(params).__name__}, not a list")
