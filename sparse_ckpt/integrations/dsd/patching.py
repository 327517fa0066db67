"""``install()``: route torch DSD and DCP's load planning through `sparse_ckpt.integrations.dsd`.

What it patches (all undone by `uninstall`, which puts torch's exact code and objects back):

- torch's own function objects ``torch.distributed.checkpoint.state_dict.{get_optimizer_state_dict,
  set_optimizer_state_dict, get_state_dict, set_state_dict}``: each keeps its identity, signature,
  defaults and doc, and its ``__code__`` becomes a trampoline that calls this package's function of
  the same name (`sparse_ckpt.integrations._rebind.route_code`). So every call goes through
  sparse_ckpt however the caller bound the function, before or after ``install()``, in this process
  (each process calls ``install()`` itself: a rank, a Ray worker, a spawned child): a module global, a
  function local, a closure, a ``functools.partial``, a default argument, code that cloudpickle,
  pickle or multiprocessing unpickled (they hold torch's object, or look it up by module and name).
  torch's original code runs in the clones of `functions.torch_dsd` (what this package falls back to);
  a clone made elsewhere from torch's code object before ``install()`` keeps running torch's code;
- ``DefaultLoadPlanner.set_up_planner``: the dicts this module hands out (and only those) are
  rebuilt from the checkpoint's metadata before planning (`.target`), for ``planner=None``,
  ``DefaultLoadPlanner()`` and every subclass that calls ``super().set_up_planner``; so is a
  recognised shallow copy of one handed out for an optimizer without state (a trainer that merges
  the returned dicts into a new one, as NeMo Automodel does); any other unmarked optimizer dict that
  asks for none of its checkpoint's state is refused (a silent loss otherwise).

All or nothing: `install` and `uninstall` change the five objects together, and an interrupt at any
point of either (``KeyboardInterrupt``) undoes what it had begun. `installed` reads the objects
themselves (every one patched), never a flag, so it cannot say ``True`` while stock DSD runs, and a
later `install` completes whatever is missing. Where torch's functions cannot be routed (not plain
functions without a closure, or other signatures), `install` raises and patches nothing.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
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
from .._rebind import all_or_nothing, original_code, route_code, routed, unroutable
from . import functions
from .target import align_key_records, rebuild_load_target

__all__ = ["install", "installed", "uninstall"]

_lock = threading.Lock()
_TORCH: dict[str, Any] = {name: getattr(_dsd, name) for name in functions.ROUTED}
"""torch's own function objects, the ones `install` routes (their identity never changes)."""
_PLANNER_PARAMS = ("self", "state_dict", "metadata", "is_coordinator")


def install() -> None:
    """Route every call of torch DSD's four optimizer-facing functions, however bound, and DCP's
    default load planning through this module.

    Call it once per process (in every process that checkpoints: each rank, each Ray Train worker),
    any time before the trainer saves or loads: before or after its imports, at module level or inside
    the training function. Idempotent; completes an earlier `install` that an interrupt cut short.
    Raises ``RuntimeError`` (and patches nothing) on a torch whose DSD functions cannot be routed or
    whose DSD or ``DefaultLoadPlanner.set_up_planner`` do not have the signatures this module replaces.
    """
    # one line: no line event between acquire and release (see sparse_ckpt._gc)
    with _lock: _install_locked()  # fmt: skip
    if safe_load.requested():  # SPARSE_CKPT_SAFE_LOAD=1: every DCP load of the process read safely too
        safe_load.install()


def _install_locked() -> None:
    if installed():
        return
    _check_torch()
    codes = {name: route_code(fn, functions.__name__, name) for name, fn in _TORCH.items()}
    all_or_nothing([*(_code_change(fn, codes[name]) for name, fn in _TORCH.items()), _planner_change(_set_up_planner)])


def uninstall() -> None:
    """Undo `install`: torch's functions run their own code again and ``DefaultLoadPlanner`` has its
    own ``set_up_planner`` (a ``set_up_planner`` that something else set since is left alone).
    No-op when nothing is patched; also undoes a partial install."""
    # one line: no line event between acquire and release
    with _lock: _uninstall_locked()  # fmt: skip


def _uninstall_locked() -> None:
    changes = [_code_change(fn, original_code(fn)) for fn in _TORCH.values() if routed(fn)]
    if vars(DefaultLoadPlanner).get("set_up_planner") is _set_up_planner:
        changes.append(_planner_change(_TORCH_SET_UP_PLANNER))
    all_or_nothing(changes)


def installed() -> bool:
    """Whether `install` is in effect: read from the patched objects themselves (all of torch's four
    functions routed and the planner patched)."""
    return (
        all(routed(fn) for fn in _TORCH.values()) and vars(DefaultLoadPlanner).get("set_up_planner") is _set_up_planner
    )


def _code_change(fn: Any, code: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(do, undo)``: set ``fn``'s code to ``code`` / back to what it is now (idempotent)."""
    before = fn.__code__

    def do() -> None:
        fn.__code__ = code

    def undo() -> None:
        fn.__code__ = before

    return do, undo


def _planner_change(new: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(do, undo)``: set ``DefaultLoadPlanner.set_up_planner`` to ``new`` / back to what it is now."""
    before = vars(DefaultLoadPlanner)["set_up_planner"]

    def do() -> None:
        DefaultLoadPlanner.set_up_planner = new  # type: ignore[method-assign]

    def undo() -> None:
        DefaultLoadPlanner.set_up_planner = before  # type: ignore[method-assign]

    return do, undo


def _set_up_planner(
    self: DefaultLoadPlanner, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
) -> None:
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
    rebuild_load_target(state_dict, metadata, frame, marked=not ours, allow_partial_load=partial, keys=keys)
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


def _torchs_set_up_planner() -> Any:
    """torch's own ``DefaultLoadPlanner.set_up_planner``, also when this module is imported again while
    an earlier copy of it is installed (its function says what it wraps)."""
    current = vars(DefaultLoadPlanner)["set_up_planner"]
    return current.__wrapped__ if getattr(current, "_sparse_ckpt_planner", False) else current


_TORCH_SET_UP_PLANNER = _torchs_set_up_planner()
_set_up_planner.__wrapped__ = _TORCH_SET_UP_PLANNER  # type: ignore[attr-defined]
_set_up_planner._sparse_ckpt_planner = True  # type: ignore[attr-defined]
_set_up_planner.__doc__ = _TORCH_SET_UP_PLANNER.__doc__ or _set_up_planner.__doc__


def _check_torch() -> None:
    problems = []
    for name, expected in DSD_SIGNATURES.items():
        fn = functions.torch_dsd[name]
        got = tuple(inspect.signature(fn).parameters)
        if got != expected:
            problems.append(f"{name}{got} (expected {expected})")
        why = unroutable(_TORCH[name])
        if why is not None:
            problems.append(f"{name} {why}, so its callers cannot be routed")
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
