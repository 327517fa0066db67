"""Hugging Face Accelerate: sparse, exact FSDP2 optimizer checkpoints through ``save_state``/``load_state``.

Stock Accelerate (checked: 1.15.0) saves an FSDP2 optimizer with torch DSD's nested
``get_optimizer_state_dict`` into ``{output_dir}/optimizer_{i}`` and loads it with
``set_optimizer_state_dict``: saving an optimizer that never stepped invents ``step=1`` state in
the live optimizer, and a parameter without state (a frozen tower, an expert that got no tokens)
makes ``load_state`` fail (``Missing key in checkpoint state_dict: optimizer.state.<fqn>.step``).

`install` replaces Accelerate's ``save_fsdp_optimizer`` / ``load_fsdp_optimizer`` (the
functions ``Accelerator.save_state`` / ``load_state`` call, their homes in
``accelerate.utils``, and every module that bound them before, such as ``transformers.trainer``)
with ones that save ``{"optimizer": SparseOptimizerState(model, optimizer)}`` through DCP into the
same ``optimizer_{i}`` directory and load it with
`sparse_ckpt.SparseLoadPlanner` (``Accelerator.save_state`` captures those optimizers
before Accelerate writes the models, so a save sparse_ckpt refuses writes nothing): exact (every
group's settings, only the state that
exists), sparse, nothing invented, the live optimizer untouched by a save. Loading also reads the
directories stock Accelerate wrote before (DSD's nested layout, docs/formats.md),
so existing runs resume; note that such a checkpoint holds whatever DSD wrote, including the
``step=1`` state it invented when it saved an optimizer that had never stepped.

Only FSDP2 with ``SHARDED_STATE_DICT`` and ``use_dcp=True`` (Accelerate's defaults) goes through
sparse_ckpt; FSDP1, ``FULL_STATE_DICT`` and ``use_dcp=False`` stay Accelerate's own. It also
makes ``Accelerator.register_for_checkpointing`` refuse a sparse_ckpt ``Stateful`` when there
is more than one process: Accelerate pickles a registered object's ``state_dict()`` on the main
process only and loads that file on every rank, which would give every rank the main process's
optimizer shards (docs/integrations/hugging-face.md; without `install` that is refused when
saving or loading).

``accelerate`` is imported by `install`, never by importing this module.
"""

from __future__ import annotations

import importlib
import inspect
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from .._dcp.planner import SparseLoadPlanner
from .._dcp.safe_reader import SafeFileSystemReader
from .._dcp.stateful import SparseOptimizerState
from .._format.tags import Keying
from .._multi_optimizer import MultiOptimizer
from .._save.save import FORMATS, Format
from ..errors import CrossRankStateError
from ._captured import Captured
from ._rebind import bindings

__all__ = ["install", "installed", "load_fsdp_optimizer", "save_fsdp_optimizer", "uninstall"]

OPTIMIZER_KEY = "optimizer"
"""The top-level key stock Accelerate saves the optimizer under (kept, so both layouts share it)."""

_TARGETS = ("accelerate.accelerator", "accelerate.utils.fsdp_utils", "accelerate.utils")
"""Modules whose ``save_fsdp_optimizer``/``load_fsdp_optimizer`` are replaced: the one
``Accelerator.save_state``/``load_state`` resolve them in, and their public homes."""
_SAVE_PARAMS = ["fsdp_plugin", "accelerator", "optimizer", "model", "output_dir", "optimizer_index", "use_dcp"]
_LOAD_PARAMS = [
    "fsdp_plugin",
    "accelerator",
    "optimizer",
    "model",
    "input_dir",
    "optimizer_index",
    "adapter_only",
    "use_dcp",
]

_lock = threading.Lock()
_saved: list[tuple[Any, str, Any]] = []
"""``(owner, attribute, what it was before)`` for everything `install` replaced."""
_accelerates: dict[str, Callable[..., Any]] = {}
"""Accelerate's own ``save_fsdp_optimizer``/``load_fsdp_optimizer`` (for the cases it keeps)."""
_options: dict[str, Any] = {"format": "packed", "strict": True}
_pending = threading.local()
"""``captured``: ``id(optimizer) -> its sparse dict``, captured by ``save_state`` before Accelerate wrote
anything, for this thread's ``save_fsdp_optimizer`` calls inside that ``save_state``."""


def install(*, format: Format = "packed", strict: bool = True) -> None:
    """Make ``Accelerator.save_state``/``load_state`` checkpoint FSDP2 optimizers with sparse_ckpt.

    Call it once, before ``save_state``/``load_state`` (any time after importing accelerate).
    Idempotent: a second call only updates ``format`` (``"packed"`` or ``"flat"``) and
    ``strict`` (passed to the load: missing or extra FQNs are an error). `uninstall`
    undoes it. Raises ``ImportError`` without accelerate, and ``RuntimeError`` when the
    installed accelerate's functions do not have the signatures this integration replaces.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    with _lock:
        _options.update(format=format, strict=strict)
        if _saved:
            return
        modules = [importlib.import_module(name) for name in _TARGETS]
        accelerator_mod = modules[0]
        _check_signature(accelerator_mod, "save_fsdp_optimizer", _SAVE_PARAMS)
        _check_signature(accelerator_mod, "load_fsdp_optimizer", _LOAD_PARAMS)
        cls = accelerator_mod.Accelerator
        replacements: list[tuple[Any, str, Any]] = [
            (cls, "register_for_checkpointing", _guarded_register(cls.register_for_checkpointing)),
            (cls, "save_state", _capturing_save_state(cls.save_state)),
        ]
        for module in modules:
            for name, ours in (
                ("save_fsdp_optimizer", save_fsdp_optimizer),
                ("load_fsdp_optimizer", load_fsdp_optimizer),
            ):
                if hasattr(module, name):
                    replacements.append((module, name, ours))
        _accelerates.update(
            save_fsdp_optimizer=accelerator_mod.save_fsdp_optimizer,
            load_fsdp_optimizer=accelerator_mod.load_fsdp_optimizer,
        )
        # Modules that bound accelerate's functions at their import (transformers.trainer does).
        originals = {id(fn): (fn, globals()[name]) for name, fn in _accelerates.items()}
        for owner, name, _theirs, ours in bindings(originals, skip=modules):
            replacements.append((owner, name, ours))
        for owner, name, ours in replacements:
            _saved.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, ours)


def uninstall() -> None:
    """Undo `install` (for tests): Accelerate's own functions are back. No-op when not installed."""
    with _lock:
        for owner, name, before in reversed(_saved):
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        _saved.clear()
        _accelerates.clear()
        _options.update(format="packed", strict=True)


def installed() -> bool:
    """Whether `install` is in effect."""
    return bool(_saved)


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    output_dir: str,
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> None:
    """Accelerate's ``save_fsdp_optimizer``, sparse and exact for FSDP2 sharded DCP checkpoints.

    Writes ``{"optimizer": SparseOptimizerState(model, optimizer)}`` through DCP into
    ``{output_dir}/optimizer_{optimizer_index}`` (stock Accelerate's directory and key); any
    other configuration is handed to Accelerate's own function.
    """
    if not _handled(fsdp_plugin, use_dcp):
        return _original("save_fsdp_optimizer")(
            fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index, use_dcp
        )
    captured = getattr(_pending, "captured", {}).pop(id(optimizer), None)
    state: Any = (
        Captured(captured)
        if captured is not None
        else SparseOptimizerState(model, optimizer, format=_options["format"])
    )
    ckpt_dir = os.path.join(output_dir, _optimizer_dir(optimizer_index))
    os.makedirs(ckpt_dir, exist_ok=True)
    dcp.save({OPTIMIZER_KEY: state}, storage_writer=dcp.FileSystemWriter(ckpt_dir))
    return None


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: Any,
    input_dir: str,
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Accelerate's ``load_fsdp_optimizer``, reading with `sparse_ckpt.SparseLoadPlanner`.

    Reads ``{input_dir}/optimizer_{optimizer_index}`` (or ``input_dir`` itself when it is that
    directory, as Accelerate does) whether sparse_ckpt or stock Accelerate (DSD's nested layout)
    wrote it: every group's settings, the state that was saved, nothing invented. On an error the
    optimizer is as it was. Other configurations go to Accelerate's own function.
    """
    if not _handled(fsdp_plugin, use_dcp):
        return _original("load_fsdp_optimizer")(
            fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index, adapter_only, use_dcp
        )
    name = _optimizer_dir(optimizer_index)
    ckpt_dir = Path(input_dir) if Path(input_dir).name == name else Path(input_dir) / name
    accelerator.wait_for_everyone()
    state = SparseOptimizerState(model, optimizer, strict=_options["strict"])
    dcp.load(
        {OPTIMIZER_KEY: state}, storage_reader=SafeFileSystemReader(os.fspath(ckpt_dir)), planner=SparseLoadPlanner()
    )
    accelerator.wait_for_everyone()
    return None


# --------------------------------------------------------------------------- internals


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _original(name: str) -> Callable[..., Any]:
    """Accelerate's own function ``name`` (from before `install`, or as it is when not installed)."""
    return _accelerates.get(name) or getattr(importlib.import_module("accelerate.utils.fsdp_utils"), name)


def _optimizer_dir(optimizer_index: int) -> str:
    """The directory Accelerate names for optimizer ``optimizer_index`` (``optimizer_{i}``)."""
    return f"{importlib.import_module('accelerate.utils.constants').OPTIMIZER_NAME}_{optimizer_index}"


def _handled(fsdp_plugin: Any, use_dcp: bool) -> bool:
    """FSDP2, sharded state dict, through DCP: the case sparse_ckpt takes over."""
    if not use_dcp or getattr(fsdp_plugin, "fsdp_version", None) != 2:
        return False
    state_dict_type = getattr(fsdp_plugin, "state_dict_type", None)
    return getattr(state_dict_type, "name", state_dict_type) == "SHARDED_STATE_DICT"


def _check_signature(module: Any, name: str, expected: list[str]) -> None:
    fn = getattr(module, name, None)
    params = list(inspect.signature(fn).parameters) if callable(fn) else None
    if params != expected:
        version = getattr(importlib.import_module("accelerate"), "__version__", "?")
        raise RuntimeError(
            f"sparse_ckpt.integrations.accelerate: accelerate {version}'s {module.__name__}.{name} has parameters "
            f"{params}, expected {expected} (the integration is written against accelerate 1.15.0); nothing was "
            "installed"
        )


def _capturing_save_state(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Accelerator.save_state`` that first captures every FSDP2 optimizer `save_fsdp_optimizer`
    will save (Accelerate writes the models before the optimizers: a save refused inside ``dcp.save``
    left the model files behind), with the table keys ``dcp.save`` over all ranks would choose."""

    def save_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        plugin = getattr(getattr(self, "state", None), "fsdp_plugin", None)
        captured: dict[int, Any] = {}
        if (
            plugin is not None
            and getattr(getattr(self, "distributed_type", None), "name", None) == "FSDP"
            and _handled(plugin, True)
        ):
            for opt, model in zip(self._optimizers, self._models):
                state = SparseOptimizerState(model, opt, format=_options["format"])
                captured[id(opt)] = state._captured(Keying.with_ranks())
        _pending.captured = captured
        try:
            return original(self, *args, **kwargs)
        finally:
            _pending.captured = {}

    save_state.__doc__ = original.__doc__
    save_state.__wrapped__ = original  # type: ignore[attr-defined]
    return save_state


def _guarded_register(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Accelerator.register_for_checkpointing`` that refuses sparse_ckpt Statefuls with several processes."""

    def register_for_checkpointing(self: Any, *objects: Any) -> Any:
        if getattr(self, "num_processes", 1) > 1:
            for obj in objects:
                if isinstance(obj, (SparseOptimizerState, MultiOptimizer)):
                    raise CrossRankStateError(
                        f"register_for_checkpointing({type(obj).__name__}) with {self.num_processes} processes: "
                        "Accelerate saves a registered object's state_dict() on the main process only and loads "
                        "that file on every rank, so every rank would get the main process's optimizer state. "
                        "With sparse_ckpt.integrations.accelerate.install() in effect, save_state/load_state "
                        "already checkpoint the prepared optimizer sparsely: do not register it"
                    )
        return original(self, *objects)

    register_for_checkpointing.__doc__ = original.__doc__
    register_for_checkpointing.__wrapped__ = original  # type: ignore[attr-defined]
    return register_for_checkpointing
