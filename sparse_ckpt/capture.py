"""Capture one optimizer leaf exactly as ``torch.optim.Optimizer.state_dict`` would (DESIGN §3).

Order: refuse unsupported ``state_dict`` overrides, take the per-optimizer reentrancy guard,
run the pre-hooks, pack (snapshotting ``packed id -> parameter``), run the post-hooks, and
release the guard on every exit path. Nothing here steps, touches ``.grad`` or creates state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import _backend
from ._torch_compat import state_dict_post_hooks, state_dict_pre_hooks
from .adapters import adapter_for
from .errors import CheckpointFormatError, ReentrantSerializationError, UnsupportedStateDictError

_BASE_STATE_DICT = torch.optim.Optimizer.state_dict

_guard_lock = threading.Lock()
_in_capture: set[int] = set()


@contextmanager
def capture_guard(leaf: str, optimizer: Any) -> Iterator[None]:
    """Mark ``optimizer`` as being serialized; a second entry raises, from any thread."""
    key = id(optimizer)
    with _guard_lock:
        if key in _in_capture:
            raise ReentrantSerializationError(
                f"leaf {leaf!r}: optimizer {type(optimizer).__name__} is already being serialized "
                "(a state_dict hook called back into serialization, or another thread is serializing it)"
            )
        _in_capture.add(key)
    try:
        yield
    finally:
        with _guard_lock:
            _in_capture.discard(key)


def _copy_dicts(value: Any) -> Any:
    """Copy the dict structure of a per-parameter state entry (tensors are shared, as in torch)."""
    if isinstance(value, dict):
        return {k: _copy_dicts(v) for k, v in value.items()}
    return value


def check_supported(leaf: str, optimizer: Any) -> Any:
    """Return the registered adapter (or ``None``) for ``optimizer``; refuse unsupported ones."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedStateDictError(
            f"leaf {leaf!r}: {type(optimizer).__name__} is not a torch.optim.Optimizer"
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
        raise UnsupportedStateDictError(
            f"leaf {leaf!r}: {cls.__name__} overrides state_dict; register how to capture it with "
            "sparse_ckpt.register_state_dict_adapter"
        )
    return adapter


def capture_packed(leaf: str, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[Any]]:
    """Run the torch ``state_dict`` sequence; return ``(packed_dict, id_to_param)``.

    ``packed_dict`` equals what ``optimizer.state_dict()`` returns; ``id_to_param`` is the
    ``packed id -> parameter`` snapshot taken before any post-hook ran.
    """
    adapter = check_supported(leaf, optimizer)
    with capture_guard(leaf, optimizer):
        core = _backend.core
        if adapter is not None:
            _groups, _state, id_to_param = core.pack_optimizer(leaf, optimizer.param_groups, {}, torch.Tensor)
            state_dict = adapter(optimizer)
        else:
            for pre_hook in state_dict_pre_hooks(optimizer):
                pre_hook(optimizer)
            groups, state, id_to_param = core.pack_optimizer(
                leaf, optimizer.param_groups, optimizer.state, torch.Tensor
            )
            post_hooks = state_dict_post_hooks(optimizer)
            if post_hooks:  # torch hands hooks the live per-param dicts; edits must not reach the optimizer
                state = {k: _copy_dicts(v) for k, v in state.items()}
            state_dict = {"state": state, "param_groups": groups}
            for post_hook in post_hooks:
                result = post_hook(optimizer, state_dict)
                if result is not None:
                    state_dict = result
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state_dict produced {type(state_dict).__name__} without 'state' and "
            "'param_groups' entries"
        )
    return state_dict, id_to_param
