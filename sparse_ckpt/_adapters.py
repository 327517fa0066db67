"""Registry of adapters for optimizer classes that override ``state_dict``.

By default sparse_ckpt refuses an optimizer whose class overrides ``state_dict`` (or whose
instance has a patched ``state_dict``), because it cannot know what that method would save.
``register_state_dict_adapter(cls, adapter)`` tells it: ``adapter(optimizer)`` must return a
torch-format packed dict ``{"state": {id: {...}}, "param_groups": [{..., "params": [ids]}]}``
whose int ids follow torch's assignment over ``optimizer.param_groups`` (the first occurrence of
a parameter, in group order, counting every slot). Often ``adapter = cls.state_dict`` is right.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

StateDictAdapter = Callable[[torch.optim.Optimizer], dict[str, Any]]

_lock = threading.Lock()
_adapters: dict[type, StateDictAdapter] = {}


class AdapterHandle:
    """Returned by `register_state_dict_adapter`; ``remove()`` unregisters (like torch's hook handles).

    Removing is idempotent and removes only this registration: if ``cls`` was registered again
    meanwhile, the newer adapter stays. Usable as a context manager.
    """

    def __init__(self, cls: type, adapter: StateDictAdapter) -> None:
        self.cls = cls
        self.adapter = adapter

    def remove(self) -> None:
        """Unregister this adapter (no error if it is already gone)."""
        with _lock:
            if _adapters.get(self.cls) is self.adapter:
                del _adapters[self.cls]

    def __enter__(self) -> AdapterHandle:  # noqa: PYI034 - py3.9 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_state_dict_adapter(cls: type, adapter: StateDictAdapter) -> AdapterHandle:
    """Allow optimizers of class ``cls`` (and subclasses) that override ``state_dict``.

    Returns a handle whose ``remove()`` unregisters the adapter.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_state_dict_adapter expects a class, got {cls!r}")
    if not callable(adapter):
        raise TypeError(f"adapter for {cls.__name__} is not callable: {adapter!r}")
    with _lock:
        _adapters[cls] = adapter
    return AdapterHandle(cls, adapter)


def adapter_for(cls: type) -> StateDictAdapter | None:
    """The adapter registered for ``cls`` or its nearest registered base class."""
    for base in cls.__mro__:  # lock-free: each read is one atomic dict lookup (nothing an interrupt can leave held)
        found = _adapters.get(base)
        if found is not None:
            return found
    return None
