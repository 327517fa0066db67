"""torchtune (tested with 0.6.1): sparse, exact optimizer checkpoints for its FSDP2 recipes.

Stock torchtune 0.6.1 resumes an FSDP2 recipe (``full_finetune_distributed`` and the others that use
``CheckpointClient``) in two ways, and neither resumes an optimizer in which some parameters have
no state (an expert that got no tokens, a frozen tower):

- sync (the default ``FullModelTorchTuneCheckpointer``, or any ``checkpointer`` of the config): the
  recipe state ``recipe_state.pt`` holds ``training.get_full_optimizer_state_dict`` (torch DSD's
  nested full dict, by FQN); the recipe's ``_setup_optimizer`` reads it with
  ``training.load_from_full_optimizer_state_dict``, which runs DSD's private synthetic step
  ``_init_optim_state`` on the fresh optimizer (state for *every* parameter) and then looks every
  parameter up in the checkpoint: ``KeyError: 'layers.0.experts.4.weight'``;
- async (``enable_async_checkpointing: True``): ``CheckpointClient._save_checkpoint_async`` puts the
  raw ``optimizer.state_dict()`` (parameter ids) into DCP, and ``load_distributed_checkpoint`` runs
  the synthetic step before it builds its load target: ``Missing key in checkpoint state_dict:
  optimizer.state.11.step`` (the recipe logs that and trains on from the base checkpoint).

`install` replaces those four seams (their homes, and every module that bound them before):

- ``torchtune.training.get_full_optimizer_state_dict``: the same nested full dict, built by
  `sparse_ckpt.integrations.dsd` (no synthetic step: the live optimizer is not touched, only the
  state that exists), plus one entry ``"sparse_ckpt"`` next to ``state`` and ``param_groups`` saying
  who wrote it (torchtune's own loader ignores it);
- ``torchtune.training.load_from_full_optimizer_state_dict``: loads that dict with the library's
  loader (by FQN, every group's settings, the state that is there and no other, transactional);
- ``CheckpointClient._save_checkpoint_async``: the optimizer entry is a `sparse_ckpt.SparseOptimizerState`;
- ``CheckpointClient.load_distributed_checkpoint``: loads it with `sparse_ckpt.SparseLoadPlanner`,
  no synthetic step.

Checkpoints stock torchtune wrote load too, with a `MigrationReport` (`last_migration_report`,
and a warning in the log): the state as saved (``drop_synthetic_state=True``: minus the state a
synthetic step invented), every parameter kept with ``step == 1`` named as possibly synthetic, and
the parameters left without state. What the integration cannot serve exactly goes to torchtune's
own code unchanged: the async path of optimizers in backward (``optimizer_in_bwd``: torchtune's
wrapper is no optimizer; their sync path goes through the two functions, one optimizer per
parameter, untested), FSDP1 models, optimizers the library cannot capture (see
`sparse_ckpt.integrations.dsd.functions.served`). The recipe catches any exception of
``load_distributed_checkpoint`` and trains on from the base weights with a warning: a refused async
resume shows in its log, not as a crash.

It does not conflict with `sparse_ckpt.integrations.dsd.install`: both can be active, in any order
(the functions here call the library's DSD functions directly, and the load uses
`sparse_ckpt.SparseLoadPlanner`, which the DSD hook leaves to itself). ``torchtune`` is imported by
`install`, never by importing this module.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from .._dcp.failures import load_raising_own
from .._dcp.planner import SparseLoadPlanner
from .._dcp.safe_reader import SafeFileSystemReader
from .._dcp.stateful import SparseOptimizerState, SparseStateDict
from ._rebind import bindings
from ._stock_migration import MigrationReport
from ._torchtune_stock import TuneOptimizerState, migrate_full, split_marker, sync_marker
from .dsd import functions as dsd

__all__ = [
    "MigrationReport",
    "get_full_optimizer_state_dict",
    "install",
    "installed",
    "last_migration_report",
    "load_from_full_optimizer_state_dict",
    "uninstall",
]

log = logging.getLogger(__name__)

_TRAINING = ("torchtune.training", "torchtune.training._distributed")
"""The homes of the two sync functions (the recipes call ``training.<name>``)."""
_CLIENT = "torchtune.training.checkpointing._checkpoint_client"

_lock = threading.Lock()
_saved: list[tuple[Any, str, Any, Any]] = []
"""``(owner, name, torchtune's object, ours)`` for everything `install` replaced, in order."""
_tunes: dict[str, Callable[..., Any]] = {}
"""torchtune's own objects (for the cases handed back to it)."""
_options: dict[str, Any] = {"drop_synthetic_state": False}
_last: dict[str, MigrationReport | None] = {"report": None}


def install(*, drop_synthetic_state: bool = False) -> None:
    """Make torchtune's FSDP2 recipe checkpoints (sync and async) sparse and exact; see the module doc.

    Call it once per process, before the recipe saves or loads; before or after torchtune's imports
    (it imports ``torchtune.training`` itself). Idempotent: a second call only updates
    ``drop_synthetic_state`` (when loading a stock torchtune checkpoint, drop the saved state of
    every parameter whose ``step`` is 1 and whose other state tensors are all zero, as a synthetic
    step writes; a real first step on a zero gradient looks the same, so it is opt-in).
    Raises ``ImportError`` without torchtune (and its dependency torchao).
    """
    with _lock:
        _options["drop_synthetic_state"] = bool(drop_synthetic_state)
        if _saved:
            return
        homes = [importlib.import_module(name) for name in _TRAINING]
        client = importlib.import_module(_CLIENT).CheckpointClient
        ours = {
            "get_full_optimizer_state_dict": get_full_optimizer_state_dict,
            "load_from_full_optimizer_state_dict": load_from_full_optimizer_state_dict,
        }
        theirs = {name: getattr(homes[1], name) for name in ours}
        patched = [(home, name, getattr(home, name), fn) for home in homes for name, fn in ours.items()]
        originals = {id(theirs[name]): (theirs[name], fn) for name, fn in ours.items()}
        patched.extend(bindings(originals, skip=homes))
        for name, fn in (
            ("_save_checkpoint_async", _save_checkpoint_async),
            ("load_distributed_checkpoint", load_distributed_checkpoint),
        ):
            original = vars(client)[name]
            theirs[name] = original
            patched.append((client, name, original, _method(fn, original)))
        _tunes.update(theirs)
        for owner, name, _theirs, mine in patched:
            setattr(owner, name, mine)
        _saved.extend(patched)


def uninstall() -> None:
    """Undo `install`: torchtune's own objects are back (a name rebound by something else since is
    left alone). No-op when not installed."""
    with _lock:
        for owner, name, theirs, mine in reversed(_saved):
            if vars(owner).get(name) is mine:
                setattr(owner, name, theirs)
        _saved.clear()
        _tunes.clear()
        _options["drop_synthetic_state"] = False
        _last["report"] = None


def installed() -> bool:
    """Whether `install` is in effect."""
    return bool(_saved)


def last_migration_report() -> MigrationReport | None:
    """What the last load of a checkpoint stock torchtune wrote did on this rank (kept, dropped,
    possibly synthetic, left without state); ``None`` when the last load read a sparse_ckpt one."""
    return _last["report"]


# --------------------------------------------------------------------------- sync: recipe_state.pt


def get_full_optimizer_state_dict(
    model: Any, opt: Any, is_rank_zero: bool, device: torch.device | None = None
) -> dict[str, Any]:
    """torchtune's ``training.get_full_optimizer_state_dict``, sparse and exact.

    DSD's nested full dict (``state`` by FQN, ``param_groups`` with FQN lists) gathered to rank 0 on
    the CPU, as torchtune's, but built without DSD's synthetic step: only the state that exists,
    every group's settings, the live optimizer untouched; plus the ``"sparse_ckpt"`` marker entry.
    Non-zero ranks get ``{}`` (as torchtune's). A collective: every rank calls it.
    """
    if not _served(model, opt):
        return _tune("get_full_optimizer_state_dict")(model, opt, is_rank_zero, device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    full = dsd.get_optimizer_state_dict(model, opt, options=options)
    if not is_rank_zero:
        return {}
    return {"state": dict(full["state"]), "param_groups": list(full["param_groups"]), **sync_marker()}


def load_from_full_optimizer_state_dict(model: Any, opt: Any, full_sd: dict[str, Any], device: torch.device) -> None:
    """torchtune's ``training.load_from_full_optimizer_state_dict``, exact: each rank cuts its shards
    from the full dict it was given (as torchtune's own branch does; every rank reads
    ``recipe_state.pt``), no synthetic step, parameters without saved state stay without state.

    A dict without the ``"sparse_ckpt"`` marker was written by stock torchtune: it loads as saved,
    with a `MigrationReport` (see `last_migration_report`). A collective: every rank calls it.
    """
    if not _served(model, opt):
        return _tune("load_from_full_optimizer_state_dict")(model, opt, full_sd, device)
    osd, ours = split_marker(full_sd)
    report = None
    if not ours:
        osd, report = migrate_full(model, opt, osd, "recipe_state (stock torchtune)", _options["drop_synthetic_state"])
    dsd.set_optimizer_state_dict(model, opt, osd, options=StateDictOptions(full_state_dict=True))
    _record(report)
    return None


# --------------------------------------------------------------------------- async: DistributedCheckpointer


def _save_checkpoint_async(
    original: Callable[..., Any], self: Any, model: Any, optimizer: Any, training_progress: Any, epoch: int
) -> None:
    """``CheckpointClient._save_checkpoint_async`` with a `SparseOptimizerState` as the optimizer entry
    (the rest as torchtune's: the training progress, ``model.state_dict()``, ``save_async=True``)."""
    if not _served(model, optimizer):
        return original(self, model, optimizer, training_progress, epoch)
    training = importlib.import_module("torchtune.training")
    ckpt_dict: dict[str, Any] = {}
    ckpt_dict.update(training_progress.state_dict())
    ckpt_dict[training.MODEL_KEY] = model.state_dict()
    ckpt_dict[training.OPT_KEY] = SparseOptimizerState(model, optimizer)
    self._get_dcp_checkpointer().save_checkpoint(ckpt_dict, epoch=epoch, save_async=True)
    return None


def load_distributed_checkpoint(original: Callable[..., Any], self: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    """``CheckpointClient.load_distributed_checkpoint`` without the synthetic step: the latest
    ``dist_epoch_N`` of the output directory (as torchtune's ``DistributedCheckpointer``) read with
    `sparse_ckpt.SparseLoadPlanner` into the model's state dict and the optimizer. A checkpoint stock
    torchtune wrote (parameter ids) is read as saved, with a `MigrationReport`."""
    if not _served(model, optimizer):
        return original(self, model, optimizer)
    training = importlib.import_module("torchtune.training")
    checkpointer = self._get_dcp_checkpointer()
    path = checkpointer._get_latest_intermediate_checkpoint()
    if path is None:
        raise ValueError(
            f"no intermediate distributed checkpoint (dist_epoch_N with a .metadata file) in {checkpointer._output_dir}"
        )
    state = TuneOptimizerState(
        model, optimizer, checkpoint_id=str(path), drop_synthetic=_options["drop_synthetic_state"]
    )
    checkpoint_dict: dict[str, Any] = {
        training.MODEL_KEY: model.state_dict(),
        training.OPT_KEY: state,
        training.SEED_KEY: 0,
        training.EPOCHS_KEY: 0,
        training.TOTAL_EPOCHS_KEY: 0,
        training.MAX_STEPS_KEY: 0,
    }
    load_raising_own(
        checkpoint_dict,
        storage_reader=SafeFileSystemReader(path),
        process_group=checkpointer._process_group,
        planner=_TuneLoadPlanner(),
    )
    dsd.torch_dsd["set_model_state_dict"](model, checkpoint_dict[training.MODEL_KEY])
    _record(state.report)
    return checkpoint_dict


class _TuneLoadPlanner(SparseLoadPlanner):
    """`SparseLoadPlanner` that first lets the optimizer entry see the checkpoint: a stock one
    (parameter ids) gets a load target built from the metadata instead (see `TuneOptimizerState`)."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        for key, value in list(state_dict.items()):
            if (
                metadata is not None
                and isinstance(value, SparseStateDict)
                and isinstance(value.owner, TuneOptimizerState)
            ):
                stock = value.owner.stock_target(metadata, key)
                if stock is not None:
                    state_dict[key] = stock
        super().set_up_planner(state_dict, metadata, is_coordinator)


# --------------------------------------------------------------------------- internals


def _method(fn: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a method that receives torchtune's ``original`` first."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(original, self, *args, **kwargs)

    method.__name__ = original.__name__
    method.__qualname__ = original.__qualname__
    method.__doc__ = original.__doc__
    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


def _tune(name: str) -> Callable[..., Any]:
    """torchtune's own function ``name`` (from before `install`)."""
    fn = _tunes.get(name)
    if fn is None:
        fn = getattr(importlib.import_module("torchtune.training._distributed"), name)
    return fn


def _served(model: Any, optimizer: Any) -> bool:
    """A plain optimizer (not torchtune's ``OptimizerInBackwardWrapper``) the library serves exactly."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return False
    return dsd.served(model, (optimizer,), None, StateDictOptions())


def _record(report: MigrationReport | None) -> None:
    _last["report"] = report
    if report is not None:
        for line in report.summary():
            log.warning("sparse_ckpt migration: %s", line)
