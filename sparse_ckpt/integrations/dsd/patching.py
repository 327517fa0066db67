"""``install()``: route torch DSD and DCP's load planning through `sparse_ckpt.integrations.dsd`.

What it patches (all undone by `uninstall`, which puts torch's exact objects back):

- ``torch.distributed.checkpoint.state_dict.{get_optimizer_state_dict, set_optimizer_state_dict,
  get_state_dict, set_state_dict}``, so every later ``from ... import`` gets this module's;
- every name already bound to one of torch's four functions in a loaded module's globals (a
  trainer that did ``from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict``
  before ``install()``), found by identity in ``sys.modules``;
- ``DefaultLoadPlanner.set_up_planner``: the dicts this module hands out (and only those) are
  rebuilt from the checkpoint's metadata before planning (`.target`), for ``planner=None``,
  ``DefaultLoadPlanner()`` and every subclass that calls ``super().set_up_planner``; so is a
  recognised shallow copy of one handed out for an optimizer without state (a trainer that merges
  the returned dicts into a new one, as NeMo Automodel does); any other unmarked optimizer dict that
  asks for none of its checkpoint's state is refused (a silent loss otherwise).

A module imported after ``install()`` binds the replacements, so the import order does not matter.
"""

from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import fields
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as _dsd
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..._dcp.damage import guard_reads
from ..._dcp.planner import SparseLoadPlanner, optimizer_bytes, reads_weights_only
from ..._torch_internals import (
    DSD_CHECKED,
    DSD_OPTIONS,
    DSD_SIGNATURES,
    caller_frame,
    clear_dcp_flatten_flag,
    dcp_storage_reader,
)
from .. import safe_load
from .._rebind import bindings
from . import functions
from .target import align_key_records, rebuild_copies, rebuild_marked

__all__ = ["install", "installed", "uninstall"]

_lock = threading.Lock()
_patched: list[tuple[Any, str, Any, Any]] = []
"""``(owner, name, torch's object, ours)`` for everything `install` replaced, in order."""
_PLANNER_PARAMS = ("self", "state_dict", "metadata", "is_coordinator")


def install() -> None:
    """Route torch DSD's optimizer functions and DCP's default load planning through this module.

    Call it once per process, any time before the trainer saves or loads (after its imports is
    fine). Idempotent. Raises ``RuntimeError`` (and patches nothing) on a torch whose DSD or
    ``DefaultLoadPlanner.set_up_planner`` does not have the signatures this module replaces.
    """
    with _lock:
        if _patched:
            return
        _check_torch()
        ours = {name: getattr(functions, name) for name in DSD_SIGNATURES}
        for name, fn in ours.items():
            _patched.append((_dsd, name, functions.torch_dsd[name], fn))
        replacements = {id(functions.torch_dsd[name]): (functions.torch_dsd[name], fn) for name, fn in ours.items()}
        own = [m for n, m in sys.modules.items() if n == __package__ or n.startswith(f"{__package__}.")]
        _patched.extend(bindings(replacements, skip=[_dsd, *own]))
        _patched.append((DefaultLoadPlanner, "set_up_planner", vars(DefaultLoadPlanner)["set_up_planner"], _set_up_planner))
        for owner, name, _theirs, mine in _patched:
            setattr(owner, name, mine)
        if safe_load.requested():  # SPARSE_CKPT_SAFE_LOAD=1: every DCP load of the process read safely too
            safe_load.install()


def uninstall() -> None:
    """Undo `install`: torch's own objects are back wherever it replaced them (a name that
    something else rebound since is left alone; a module imported while installed keeps the
    functions of this package it bound, which still work called directly). No-op when not installed."""
    with _lock:
        for owner, name, theirs, mine in reversed(_patched):
            if getattr(owner, name, None) is mine or vars(owner).get(name) is mine:
                setattr(owner, name, theirs)
        _patched.clear()


def installed() -> bool:
    """Whether `install` is in effect."""
    return bool(_patched)


def _set_up_planner(self: DefaultLoadPlanner, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
    """``DefaultLoadPlanner.set_up_planner`` that first rebuilds the marked optimizer dicts and the
    recognised copies, refuses other optimizer dicts that ask for none of the checkpoint's state, and
    has copies that hold a key record ask for the checkpoint's record instead. DCP's flatten flag left
    set by an interrupted load is cleared first (`clear_dcp_flatten_flag`)."""
    clear_dcp_flatten_flag()
    frame = caller_frame(1)
    ours = isinstance(self, SparseLoadPlanner)
    # the library's planner unpickles its optimizer items with weights_only=True: the copies' too, and
    # any other planner the items of every dict rebuilt here (`_read_weights_only`)
    keys: set[str] = getattr(self, "_optimizer_keys", set()) if ours else set()
    # a damaged file: CheckpointFormatError naming item and file (items read weights-only are CRC-checked as read)
    guard_reads(dcp_storage_reader(frame), metadata, lambda key: reads_weights_only(key, keys))
    # the copies are rebuilt as the marked dicts are: the library's planner rebuilds those itself (not
    # the copies), whatever its allow_partial_load (which is for the entries that are not optimizer dicts)
    partial = getattr(self, "allow_partial_load", False) and not ours
    if not ours:
        rebuild_marked(state_dict, metadata, frame, allow_partial_load=partial, keys=keys)
    rebuild_copies(state_dict, metadata, frame, allow_partial_load=partial, keys=keys)
    align_key_records(state_dict, metadata)  # copies holding a key record: the checkpoint's, if any
    if not ours:
        _read_weights_only(self, keys)
    return _TORCH_SET_UP_PLANNER(self, state_dict, metadata, is_coordinator)


def _read_weights_only(planner: DefaultLoadPlanner, keys: set[str]) -> None:
    """Have ``planner`` (a DCP planner other than the library's) read the bytes items of the optimizer
    dicts rebuilt for it (``keys``) and every table weights-only, as `SparseLoadPlanner` does
    (`optimizer_bytes`): an item that pickles code is refused by name before it runs. Its class's
    ``load_bytes`` (DCP's or a subclass's) then gets the item saved again from the object read. An
    attribute of this planner object only, replaced at its next ``set_up_planner``."""
    plain = type(planner).load_bytes

    def load_bytes(read_item: Any, value: Any) -> None:
        plain(planner, read_item, optimizer_bytes(read_item.dest_index.fqn, value, keys))

    load_bytes.__doc__ = plain.__doc__
    vars(planner)["load_bytes"] = load_bytes


_TORCH_SET_UP_PLANNER = vars(DefaultLoadPlanner)["set_up_planner"]
_set_up_planner.__wrapped__ = _TORCH_SET_UP_PLANNER  # type: ignore[attr-defined]
_set_up_planner.__doc__ = _TORCH_SET_UP_PLANNER.__doc__ or _set_up_planner.__doc__


def _check_torch() -> None:
    problems = []
    for name, expected in DSD_SIGNATURES.items():
        fn = functions.torch_dsd[name]
        got = tuple(inspect.signature(fn).parameters)
        if got != expected:
            problems.append(f"{name}{got} (expected {expected})")
    have = {f.name for f in fields(_dsd.StateDictOptions)}
    missing = [o for o in DSD_OPTIONS if o not in have]
    if missing:
        problems.append(f"StateDictOptions lacks {missing}")
    got = tuple(inspect.signature(_TORCH_SET_UP_PLANNER).parameters)
    if got != _PLANNER_PARAMS:
        problems.append(f"DefaultLoadPlanner.set_up_planner{got} (expected {_PLANNER_PARAMS})")
    if problems:
        raise RuntimeError(
            f"sparse_ckpt.integrations.dsd was written for torch {DSD_CHECKED}'s DSD; this torch "
            f"({torch.__version__}) differs: {'; '.join(problems)}. Nothing was installed"
        )
