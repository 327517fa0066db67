"""sparse_ckpt for torchtitan: `SparseCheckpointManager`, a drop-in for torchtitan's
``CheckpointManager`` (tested with ``torchtitan==0.3.0``).

Swap the config class; the trainer builds and calls the manager as before::

    from sparse_ckpt.integrations.torchtitan import SparseCheckpointManager

    trainer_config.checkpoint = SparseCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

Everything but the optimizer is saved and loaded exactly as by ``CheckpointManager`` (model,
``lr_scheduler``, ``dataloader``, ``train_state``; sync and ``async`` saves, ``keep_latest_k``,
``exclude_from_loading``, model-only and HF safetensors saves and loads). The ``optimizer`` entry is
a `sparse_ckpt.SparseOptimizerState` over the trainer's ``OptimizersContainer`` (leaves
``optim0``, ``optim1``, ... in ``container.optimizers`` order) and loads through
`sparse_ckpt.SparseLoadPlanner`: the optimizer state that exists and every group's settings
are saved, nothing is invented (no synthetic step, also not in the live optimizer while saving),
and parameters that had no state (experts that got no tokens, a never-stepped optimizer) resume
without state.

Checkpoints written by the stock ``CheckpointManager`` are refused unless
``migrate_stock_checkpoints=True``; then they load as saved, and with ``drop_synthetic_state=True``
the state torchtitan's synthetic step invented is dropped (see `Config`). What a migrating
load did is in `SparseCheckpointManager.migration_report` and in the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .._dcp.failures import load_raising_own
from .._dcp.planner import SparseLoadPlanner
from .._dcp.safe_reader import safe_reader_for
from .._dcp.stateful import SparseOptimizerState, SparseStateDict
from .._format.keys import PLANNER_GUARD_KEY
from .._fqn import Model, build_fqn_map
from .._leaves import named_leaves
from ..errors import CheckpointMismatchError
from ._overrides import arguments_of, with_signature_of
from ._stock_migration import (
    DroppedState,
    KeptState,
    MigrationReport,
    drop_synthetic_state,
    flat_fqns,
    state_keys_by_fqn,
    step_one_fqns,
)

try:
    from torchtitan.components.checkpoint import MODEL, OPTIMIZER, CheckpointManager
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "sparse_ckpt.integrations.torchtitan needs torchtitan (tested with 0.3.0): "
        "pip install torchtitan==0.3.0, or pip install --no-deps -r .ci/requirements-torchtitan.txt"
    ) from exc

__all__ = ["DroppedState", "KeptState", "MigrationReport", "SparseCheckpointManager"]

log = logging.getLogger(__name__)

_STOCK_HINT = (
    "set SparseCheckpointManager.Config(migrate_stock_checkpoints=True) to load it once as saved (add "
    "drop_synthetic_state=True to drop the state torchtitan's synthetic step invented), or "
    "exclude_from_loading=['optimizer'] to start the optimizer fresh"
)


class SparseCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with the optimizer saved and loaded by sparse_ckpt.

    Built like the stock manager: ``SparseCheckpointManager.Config(...).build(dataloader=...,
    model_parts=..., optimizers=..., lr_schedulers=..., states=..., sd_adapter=...,
    base_folder=...)`` (what ``torchtitan.Trainer`` does with ``config.checkpoint``). The
    optimizer argument and the model parts are checked when the manager is built.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """``CheckpointManager.Config`` (every field the same) plus the opt-in migration of stock checkpoints."""

        migrate_stock_checkpoints: bool = False
        """Load checkpoints whose optimizer part torchtitan's stock ``CheckpointManager`` wrote (its flat
        FQN layout): settings and state as saved, parameters without saved state stay without state.
        Off: such a checkpoint is refused with an error naming this field. Checkpoints this manager
        writes are always sparse."""

        drop_synthetic_state: bool = False
        """With ``migrate_stock_checkpoints``: drop the saved state of every parameter whose ``step`` is 1
        and whose other state tensors are all zeros -- what torchtitan's synthetic step writes for a
        never-stepped optimizer. A real first step on a zero gradient looks the same, so this is
        opt-in; every dropped parameter is in ``migration_report`` and the log. (Adam with
        ``weight_decay`` folds the weights into the synthetic gradient: its moments are not zero and
        are kept; ``migration_report.possibly_synthetic`` and the log list every parameter kept with
        ``step == 1``, and ``migration_report.exact`` is then false.)"""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.drop_synthetic_state and not self.migrate_stock_checkpoints:
                raise ValueError("drop_synthetic_state=True needs migrate_stock_checkpoints=True")

    @with_signature_of(CheckpointManager.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        call = arguments_of(super().__init__, *args, **kwargs)
        config: SparseCheckpointManager.Config = call["config"]
        state = None
        if config.enable:
            _check_async_mode(config.async_mode)
            state = _TitanOptimizerState(
                call["model_parts"],
                call["optimizers"],
                migrate=config.migrate_stock_checkpoints,
                drop_synthetic=config.drop_synthetic_state,
            )
        self.migration_report: MigrationReport | None = None
        """What the last load of a stock checkpoint did on this rank (``None``: no such load)."""
        super().__init__(*args, **kwargs)
        if self.enable:
            self.states[OPTIMIZER] = state

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """As ``CheckpointManager.dcp_load``, with `sparse_ckpt.SparseLoadPlanner` for DCP checkpoints, read
        through `sparse_ckpt.SafeFileSystemReader` where DCP would pick its ``FileSystemReader``.

        A sparse_ckpt error raised while DCP plans the load (on every rank) is raised as itself,
        not inside DCP's ``CheckpointException``.
        """
        if from_hf:  # model only, from safetensors: the stock path
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        state = self.states.get(OPTIMIZER)
        if isinstance(state, _TitanOptimizerState):
            state.checkpoint_id = str(checkpoint_id)
            state.report = None
        load_raising_own(
            state_dict,
            checkpoint_id=checkpoint_id,
            storage_reader=safe_reader_for(checkpoint_id),
            planner=_TitanLoadPlanner(),
        )
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
        if isinstance(state, _TitanOptimizerState) and state.report is not None:
            self.migration_report = state.report
            for line in state.report.summary():
                log.warning("sparse_ckpt migration: %s", line)


def _check_async_mode(mode: str) -> None:
    """Refuse ``async_with_pinned_mem`` where it cannot work, at build time (the stock manager
    builds and then fails its first save with ``AssertionError: Non-blocking copy requires that
    the current accelerator is available``)."""
    if mode == "async_with_pinned_mem" and not _accelerator_available():
        raise ValueError(
            "checkpoint async_mode='async_with_pinned_mem' stages through pinned memory and needs an accelerator, "
            "and this process has none (torch.accelerator.is_available() is False); use async_mode='async' "
            "(a background thread) or 'disabled'"
        )


def _accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()  # pragma: no cover - torch without torch.accelerator


class _TitanOptimizerState(SparseOptimizerState):
    """The ``optimizer`` entry of the manager's states: a `SparseOptimizerState` over the
    container that also reads stock checkpoints when migration is on (see `_TitanLoadPlanner`)."""

    def __init__(self, model_parts: Model, optimizers: Any, *, migrate: bool, drop_synthetic: bool) -> None:
        super().__init__(model_parts, optimizers)  # pipeline stages that share an FQN fail here
        self.migrate = migrate
        self.drop_synthetic = drop_synthetic
        self.stock_source = False
        """Set by the planner: the checkpoint being loaded has a stock (flat, guard-less) optimizer part."""
        self.checkpoint_id = ""
        self.report: MigrationReport | None = None

    def check_source(self, metadata: Metadata, where: str) -> None:
        """Note whether the optimizer part of the checkpoint described by ``metadata`` was written by
        the stock manager; refuse it when migration is off."""
        keys = metadata.state_dict_metadata
        self.stock_source = False
        if f"{where}.{PLANNER_GUARD_KEY}" in keys:
            return
        prefix = f"{where}."
        if not any(k.startswith(prefix) for k in keys):
            raise CheckpointMismatchError(
                f"the checkpoint has no {where!r} entries (a model-only checkpoint: last_save_model_only=True or a "
                f"seed checkpoint); resume from it with exclude_from_loading=[{where!r}], or start a new run from it "
                "with initial_load_path and initial_load_model_only=True"
            )
        if not self.migrate:
            raise CheckpointMismatchError(
                f"the checkpoint's {where!r} entry was not written by sparse_ckpt (no "
                f"'{where}.{PLANNER_GUARD_KEY}' item): torchtitan's stock CheckpointManager wrote it; {_STOCK_HINT}"
            )
        self.stock_source = True

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore as `SparseOptimizerState` does; a stock checkpoint is migrated first."""
        report = self._migrate(state_dict) if self.stock_source else None
        super().load_state_dict(state_dict)
        self.report = report

    def _migrate(self, data: Any) -> MigrationReport:
        fqns = flat_fqns(data)
        by_fqn = state_keys_by_fqn(data, fqns)
        dropped = drop_synthetic_state(data, by_fqn) if self.drop_synthetic else []
        gone = set(dropped)
        kept = step_one_fqns(data, {fqn: keys for fqn, keys in by_fqn.items() if fqn not in gone})
        fmap = data.fmap if isinstance(data, SparseStateDict) and data.fmap is not None else build_fqn_map(self.model)
        with_state = {fmap.resolve(fqn) for fqn in by_fqn} - {fmap.resolve(fqn) for fqn in dropped}
        leaf_of: dict[str, str] = {}
        stateless: dict[str, tuple[str, ...]] = {}
        for leaf, opt in named_leaves(self.optimizer):
            missing = []
            for group in opt.param_groups:
                for p in group["params"]:
                    fqn = fmap.fqn_of.get(id(p))
                    if fqn is not None:
                        leaf_of[fqn] = leaf
                        if fqn not in with_state:
                            missing.append(fqn)
            stateless[leaf] = tuple(missing)
        entries = tuple(DroppedState(leaf_of.get(fmap.resolve(fqn), "?"), fqn, tuple(by_fqn[fqn])) for fqn in dropped)
        maybe = tuple(KeptState(leaf_of.get(fmap.resolve(fqn), "?"), fqn, tuple(by_fqn[fqn])) for fqn in kept)
        return MigrationReport(self.checkpoint_id, entries, stateless, maybe)


class _TitanLoadPlanner(SparseLoadPlanner):
    """`SparseLoadPlanner` that first tells the manager's optimizer entry where its checkpoint came from."""

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        target = state_dict.get(OPTIMIZER)
        if (
            metadata is not None
            and isinstance(target, SparseStateDict)
            and isinstance(target.owner, _TitanOptimizerState)
        ):
            target.owner.check_source(metadata, OPTIMIZER)
        super().set_up_planner(state_dict, metadata, is_coordinator)
