"""Every DCP load of a process read as a checkpoint from elsewhere: the process-wide opt-in.

DCP's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load`` and its
``DefaultLoadPlanner.load_bytes`` every bytes item with ``torch.load(weights_only=False)``: a checkpoint
can run code as it loads. `install` makes every ``FileSystemReader`` (torch's own, made by
``dcp.load(checkpoint_id=...)`` or by a trainer) read ``.metadata`` with the restricted unpickler of
`sparse_ckpt.SafeFileSystemReader` and refuse storage records outside its directory, and every
``DefaultLoadPlanner`` (subclasses that call its ``load_bytes`` included) read each bytes item, the
model's too, with ``torch.load(weights_only=True)`` (the library's `sparse_ckpt._dcp.items.weights_only_item`).
A refusal is a `sparse_ckpt.CheckpointFormatError` naming the global (DCP wraps one raised inside
``dcp.load`` in its ``CheckpointException``) and nothing of the file ran.

It is switched on by ``SPARSE_CKPT_SAFE_LOAD=1`` (`requested`): ``sparse-ckpt-run --safe-load`` sets it
for every process of the command (where the launcher calls `install` when DCP is imported), and
`sparse_ckpt.integrations.dsd.install` calls `install` when it is set. Or call `install` directly.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from .._dcp.items import WeightsOnlyStream, weights_only_item
from .._dcp.safe_reader import safe_read_metadata, safe_set_up_storage_reader

__all__ = ["ENV", "install", "installed", "requested", "uninstall"]

ENV = "SPARSE_CKPT_SAFE_LOAD"
"""The environment variable that asks for `install` (``1``, ``on``, ``true``, ``yes``)."""

_lock = threading.Lock()
_patched: list[tuple[type, str, Any, Any]] = []


def requested(environ: Any = None) -> bool:
    """Whether ``SPARSE_CKPT_SAFE_LOAD`` (in ``environ``, default the process's) asks for safe loads."""
    env = os.environ if environ is None else environ
    return str(env.get(ENV, "0")).strip().lower() in ("1", "on", "true", "yes")


def _read_metadata(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
    return safe_read_metadata(self, *args, **kwargs)


def _set_up_storage_reader(
    self: FileSystemReader, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
) -> None:
    safe_set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs)


_TORCH_LOAD_BYTES = vars(DefaultLoadPlanner)["load_bytes"]


_HINT = (
    f"refused by {ENV}=1 before anything in it ran (a crafted or damaged checkpoint; if it comes from a source "
    "you trust, allow the global with torch.serialization.add_safe_globals([...]) or load without "
    f"{ENV})"
)


def _load_bytes(self: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    if not isinstance(value, WeightsOnlyStream):  # not read weights-only by a planner of the library already
        value = weights_only_item(read_item.dest_index.fqn, value, table=False, what="bytes item", hint=_HINT)
    _TORCH_LOAD_BYTES(self, read_item, value)


def install() -> None:
    """Read every DCP ``FileSystemReader`` load of this process as a checkpoint from elsewhere (see the
    module doc). Idempotent; `uninstall` undoes it."""
    with _lock:
        if _patched:
            return
        for owner, name, mine in (
            (FileSystemReader, "read_metadata", _read_metadata),
            (FileSystemReader, "set_up_storage_reader", _set_up_storage_reader),
            (DefaultLoadPlanner, "load_bytes", _load_bytes),
        ):
            _patched.append((owner, name, vars(owner)[name], mine))
        for owner, name, _theirs, mine in _patched:
            setattr(owner, name, mine)


def uninstall() -> None:
    """Put torch's own methods back (a method something else replaced since is left alone)."""
    with _lock:
        for owner, name, theirs, mine in reversed(_patched):
            if vars(owner).get(name) is mine:
                setattr(owner, name, theirs)
        _patched.clear()


def installed() -> bool:
    """Whether `install` is in effect."""
    return bool(_patched)
