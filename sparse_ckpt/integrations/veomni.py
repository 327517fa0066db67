"""sparse_ckpt inside VeOmni: its own checkpointer saves and restores the optimizer sparsely and exactly.

::

    import sparse_ckpt.integrations.veomni as sc_veomni

    sc_veomni.install()  # once, before VeOmni's trainer builds its checkpointer
    checkpointer = veomni.checkpoint.build_checkpointer("dcp", "fsdp2")  # "ddp" too
    checkpointer.save(path, {"model": model, "optimizer": optimizer, "extra_state": {...}}, global_steps=step)
    checkpointer.load(path, {"model": model, "optimizer": optimizer, "extra_state": {}})

After `install`, ``build_checkpointer("dcp", ...)`` returns `SparseDistributedCheckpointer`
classes: VeOmni's ``DistributedCheckpointer`` with the same ``save``/``load``/``wait_for_pending_save``
signatures and behaviour (``extra_state`` files, ``global_steps`` sub-directories, ``save_async``
with the same pending-save future VeOmni's other code waits on, ``trainable_only`` for the model,
``stage_dir``, ``save_to_lowest_rank``), except that the optimizer part is a
`sparse_ckpt.SparseOptimizerState` saved with DCP and loaded with
`sparse_ckpt.SparseLoadPlanner`: every leaf's param-group settings (a scheduler-moved lr of
a leaf that never stepped included) and exactly the state that exists, nothing invented on load.
The model part is VeOmni's own ``ModelState``, untouched, so HF export of the weights is unchanged.

``optimizer`` is what VeOmni's ``build_optimizer`` returns: a torch optimizer (one leaf named
``"optim"``) or VeOmni's ``MultiOptimizer`` (leaves named by its ``key_names``).

Checkpoints written by stock VeOmni (torch DSD's layout) are refused by ``load`` with an error
naming the opt-in migration: `load_stock_checkpoint` (returns a `StockMigrationReport`),
or ``install(migrate_stock=True)`` so the trainer's own ``load`` migrates them. A migration loads
what the stock checkpoint has, keeps the current settings of parameters it has no settings for
and gives no state to parameters it has no state for, and reports both per leaf in a
`StockCheckpointWarning` (never silently).

Not supported: VeOmni's ExtraParallel (expert-parallel) FSDP2 layout (a model with
``_fqn2spec_info`` under ``dp_mode="fsdp2"``): VeOmni re-adds the expert dimension to every
expert state tensor when it saves; the sparse checkpointer refuses such a model on ``save`` and
``load`` with `sparse_ckpt.UnsupportedStateDictError` before anything is written or read.

VeOmni is imported only inside these functions; importing this module does not need it.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

from .._dcp.planner import SparseLoadPlanner
from .._dcp.safe_reader import safe_reader_like
from .._dcp.stateful import SparseOptimizerState
from .._format.tags import Keying
from .._fqn import build_fqn_map
from ..errors import CheckpointMismatchError, StockCheckpointWarning, UnsupportedStateDictError
from ._captured import Captured as _Captured
from ._overrides import arguments_of, replace_argument, with_signature_of
from ._stock_migration import LeafGaps
from ._stock_migration import MigrationReport as StockMigrationReport
from ._veomni_stock import OPTIMIZER_KEY, _stock_refusal, _StockTarget, optimizer_layout

__all__ = [
    "InstallHandle",
    "LeafGaps",
    "StockCheckpointWarning",
    "StockMigrationReport",
    "install",
    "installed",
    "load_stock_checkpoint",
    "sparse_checkpointer_class",
    "uninstall",
]

_lock = threading.Lock()

# --------------------------------------------------------------------------- install / uninstall


class InstallHandle:
    """Returned by `install`; ``remove()`` (or leaving the ``with`` block) calls `uninstall`."""

    def remove(self) -> None:
        """Undo `install` (no error if it is already undone)."""
        uninstall()

    def __enter__(self) -> InstallHandle:  # noqa: PYI034 - py3.9 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install(*, migrate_stock: bool = False) -> InstallHandle:
    """Make VeOmni's ``build_checkpointer("dcp", "fsdp2"|"ddp")`` return `SparseDistributedCheckpointer`.

    Idempotent (installing again only updates ``migrate_stock``). Call it before VeOmni's trainer
    builds its checkpointer (its ``CheckpointerCallback`` calls ``build_checkpointer`` once, when
    the trainer is constructed). ``migrate_stock=True`` lets ``load`` migrate a checkpoint written
    by stock VeOmni (see `load_stock_checkpoint`) instead of refusing it.
    Returns a handle whose ``remove()`` undoes it (see `uninstall`).
    """
    registry = _registry()
    with _lock:
        current = registry["dcp"]
        previous = getattr(current, "_sparse_ckpt_previous", current)
        registry["dcp"] = _factory(previous, migrate_stock)
    return InstallHandle()


def uninstall() -> None:
    """Give ``build_checkpointer("dcp", ...)`` back the factory it had before `install`.

    Checkpointer classes already built keep working (they are the trainer's until it is rebuilt).
    No error when not installed.
    """
    registry = _registry()
    with _lock:
        current = registry["dcp"]
        previous = getattr(current, "_sparse_ckpt_previous", None)
        if previous is not None:
            registry["dcp"] = previous


def installed() -> bool:
    """Whether ``build_checkpointer("dcp", ...)`` currently returns the sparse checkpointer."""
    return hasattr(_registry()["dcp"], "_sparse_ckpt_previous")


def _registry() -> Any:
    """VeOmni's checkpointer registry (what ``build_checkpointer`` looks ``"dcp"`` up in)."""
    try:
        from veomni.checkpoint import CHECKPOINTER_REGISTRY
    except ModuleNotFoundError as exc:
        if exc.name != "veomni":
            raise
        raise ModuleNotFoundError(
            "sparse_ckpt.integrations.veomni needs VeOmni (tested with veomni==0.1.12: "
            "pip install --no-deps -r .ci/requirements-veomni.txt in a checkout)",
            name="veomni",
        ) from None
    return CHECKPOINTER_REGISTRY


def _factory(previous: Any, migrate_stock: bool) -> Any:
    def dcp_checkpointer(dist_backend: str) -> type:
        base = previous(dist_backend)  # VeOmni's own check of dist_backend ("ddp" or "fsdp2")
        return sparse_checkpointer_class(base, migrate_stock=migrate_stock)

    dcp_checkpointer._sparse_ckpt_previous = previous  # type: ignore[attr-defined]
    return dcp_checkpointer


# --------------------------------------------------------------------------- the checkpointer


def sparse_checkpointer_class(base: type | None = None, *, migrate_stock: bool = False) -> type:
    """The `SparseDistributedCheckpointer` class (what ``build_checkpointer`` returns after `install`).

    ``base`` must be VeOmni's ``DistributedCheckpointer`` (the default); another class (a
    checkpointer someone else registered for ``"dcp"``) is refused with a ``TypeError``.
    """
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer

    if base is None:
        base = DistributedCheckpointer
    if base is not DistributedCheckpointer:
        raise TypeError(
            f"sparse_ckpt.integrations.veomni wraps VeOmni's DistributedCheckpointer, but the 'dcp' checkpointer "
            f"registered before install() returned {base!r}; uninstall that override first"
        )
    return _checkpointer_class(migrate_stock)


@functools.cache
def _checkpointer_class(migrate_stock: bool) -> type:
    """The class (built once, on first use: it subclasses VeOmni's); the migrating one subclasses the other."""
    if migrate_stock:
        base = _checkpointer_class(False)
        return type(
            base.__name__, (base,), {"__module__": __name__, "__doc__": base.__doc__, "migrate_stock_checkpoints": True}
        )
    return _build_class()


def __getattr__(name: str) -> Any:
    """``SparseDistributedCheckpointer``: the class (imports VeOmni on first access)."""
    if name == "SparseDistributedCheckpointer":
        return _checkpointer_class(False)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _build_class() -> type:
    from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer, OptimizerState

    class SparseDistributedCheckpointer(DistributedCheckpointer):
        """VeOmni's ``DistributedCheckpointer`` whose optimizer part is sparse_ckpt's (see the module docstring).

        ``migrate_stock_checkpoints``: whether ``load`` migrates a stock VeOmni checkpoint (the class
        ``install(migrate_stock=True)`` returns, a subclass of this one) instead of refusing it.
        """

        migrate_stock_checkpoints = False

        @classmethod
        @with_signature_of(DistributedCheckpointer.save)
        def save(cls, *args: Any, **kwargs: Any) -> None:
            """VeOmni's ``save`` (its signature); the optimizer is captured before VeOmni writes anything
            (``extra_state/``, the ``global_step_N`` directory), so a save that will be refused writes
            nothing, then saved sparsely (see `execute_save`)."""
            call = arguments_of(super().save, *args, **kwargs)
            state = call["state"]
            if "model" in state and OPTIMIZER_KEY in state:
                sparse = _sparse_optimizer_state(state["model"], state[OPTIMIZER_KEY], call.get("parallel_state"))
                # the table keys dcp.save would choose: VeOmni's sync save runs over all ranks of the
                # default group, its async save over a group of its own (no coordinated keys)
                keying = Keying.here() if call.get("save_async") else Keying.with_ranks()
                captured = _Captured(sparse._captured(keying))
                args, kwargs = replace_argument(super().save, args, kwargs, "state", {**state, OPTIMIZER_KEY: captured})
            super().save(*args, **kwargs)

        @classmethod
        def execute_save(
            cls, save_state: dict[str, Any], storage_writer: Any, save_async: bool, save_to_lowest_rank: bool = False
        ) -> None:
            """VeOmni's ``execute_save`` with its optimizer wrapper replaced by a ``SparseOptimizerState``.

            Runs on ``DistributedCheckpointer`` itself, so an async save's future is the one VeOmni's
            own code waits on (``DistributedCheckpointer.wait_for_pending_save()``).
            """
            wrapped = save_state.get(OPTIMIZER_KEY)
            if wrapped is not None:
                if not isinstance(wrapped, OptimizerState):
                    raise TypeError(
                        f"VeOmni's save passed a {type(wrapped).__name__} as its optimizer state, not its "
                        "OptimizerState: this VeOmni version is not one sparse_ckpt.integrations.veomni supports"
                    )
                sparse: Any = wrapped.optimizer  # captured by save(), or a direct call of execute_save:
                if not isinstance(sparse, _Captured):
                    sparse = _sparse_optimizer_state(wrapped.model, wrapped.optimizer, wrapped.parallel_state)
                save_state = {**save_state, OPTIMIZER_KEY: sparse}
            DistributedCheckpointer.execute_save(
                save_state=save_state,
                storage_writer=storage_writer,
                save_async=save_async,
                save_to_lowest_rank=save_to_lowest_rank,
            )

        @classmethod
        def wait_for_pending_save(cls) -> None:
            """VeOmni's: block until a pending async save is done (the future lives on ``DistributedCheckpointer``)."""
            DistributedCheckpointer.wait_for_pending_save()

        @classmethod
        @with_signature_of(DistributedCheckpointer.load)
        def load(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
            """VeOmni's ``load`` (its signature), the optimizer restored exactly with ``SparseLoadPlanner``.

            A checkpoint written by stock VeOmni is refused unless this class migrates them
            (``install(migrate_stock=True)``); see `load_stock_checkpoint`.
            """
            call = arguments_of(super().load, *args, **kwargs)
            _load(cls, call, migrate=cls.migrate_stock_checkpoints, require_stock=False)
            return call["state"]

    SparseDistributedCheckpointer.__qualname__ = "SparseDistributedCheckpointer"
    SparseDistributedCheckpointer.__module__ = __name__
    return SparseDistributedCheckpointer


_LOAD_PARAMETERS = ("path", "state", "process_group", "storage_reader", "trainable_only", "parallel_state")
"""The parameters of VeOmni's ``DistributedCheckpointer.load`` that `_load` implements."""


def _load(cls: Any, call: dict[str, Any], *, migrate: bool, require_stock: bool) -> StockMigrationReport | None:
    """The load of `SparseDistributedCheckpointer` ``cls`` with the arguments ``call`` of VeOmni's
    ``load`` (see `arguments_of`): ``migrate`` a stock checkpoint (else refuse it), ``require_stock``
    (refuse anything else); returns the migration report, if one was made."""
    from torch.distributed import checkpoint as dcp
    from veomni.checkpoint.dcp_checkpointer import ModelState

    unknown = sorted(set(call) - set(_LOAD_PARAMETERS))
    if unknown:
        raise TypeError(
            f"this VeOmni's DistributedCheckpointer.load takes {unknown}, which sparse_ckpt.integrations.veomni "
            "does not implement: this VeOmni version is not one it supports (tested with veomni==0.1.12)"
        )
    path, state, process_group, storage_reader, trainable_only, parallel_state = (call[p] for p in _LOAD_PARAMETERS)
    if state is None:
        raise ValueError("State dict must be provided to load a distributed checkpoint.")
    if "model" not in state:
        raise ValueError("Model must be provided to load a distributed checkpoint.")
    model = state["model"]
    # the checkpointer's own reader (torch's FileSystemReader) as a SafeFileSystemReader; a caller's as it is
    reader = storage_reader if storage_reader is not None else safe_reader_like(cls._create_storage_reader(path))
    load_state: dict[str, Any] = {
        "model": ModelState(model, trainable_only=trainable_only, parallel_state=parallel_state)
    }
    stock: _StockTarget | None = None
    if OPTIMIZER_KEY in state:
        sparse = _sparse_optimizer_state(model, state[OPTIMIZER_KEY], parallel_state)
        metadata = reader.read_metadata()
        layout = optimizer_layout(metadata)
        if layout == "stock":
            if not migrate:
                raise CheckpointMismatchError(_stock_refusal(path, metadata))
            stock = _StockTarget(metadata, build_fqn_map(model))
            load_state[OPTIMIZER_KEY] = stock.target
        elif layout == "none":
            raise CheckpointMismatchError(
                f"{path} has no optimizer (it was saved without state[{OPTIMIZER_KEY!r}]): leave "
                f"{OPTIMIZER_KEY!r} out of the state to load the model and extra_state only"
            )
        elif require_stock:
            raise CheckpointMismatchError(
                f"{path} holds no optimizer saved by stock VeOmni ({layout} layout under {OPTIMIZER_KEY!r}): "
                "load it with the checkpointer's load()"
            )
        else:
            load_state[OPTIMIZER_KEY] = sparse
    elif require_stock:
        raise ValueError("load_stock_checkpoint needs state['optimizer']: it migrates the optimizer")
    planner = SparseLoadPlanner(allow_partial_load=trainable_only, _all_weights_only=stock is not None)
    dcp.load(state_dict=load_state, storage_reader=reader, process_group=process_group, planner=planner)
    report = None
    if stock is not None:
        report = stock.apply(path, model, state[OPTIMIZER_KEY])
    cls._load_extra_state(checkpoint_dir=path, state=state)
    if report is not None:
        warnings.warn(str(report), StockCheckpointWarning, stacklevel=3)  # the caller of load()
    return report


def _sparse_optimizer_state(model: Any, optimizer: Any, parallel_state: Any) -> SparseOptimizerState:
    """The ``SparseOptimizerState`` for VeOmni's model and optimizer, after refusing what it cannot save."""
    spec = getattr(model, "_fqn2spec_info", None)
    if spec is not None:
        if parallel_state is None:
            from veomni.distributed.parallel_state import get_parallel_state

            parallel_state = get_parallel_state()
        if getattr(parallel_state, "dp_mode", None) == "fsdp2":
            names = sorted(spec)
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise UnsupportedStateDictError(
                f"sparse_ckpt.integrations.veomni does not support VeOmni's ExtraParallel (expert-parallel) FSDP2 "
                f"layout: the model has _fqn2spec_info ({len(names)} ExtraParallel FQNs: {shown}) and dp_mode is "
                "'fsdp2'. VeOmni re-adds the expert dimension to expert state tensors when it saves "
                "(restore_extra_parallel_dim); the sparse checkpointer does not, so expert-parallel ranks would "
                "write different experts under one key. Save this run with VeOmni's stock checkpointer "
                "(sparse_ckpt.integrations.veomni.uninstall() before the trainer is built)"
            )
    return SparseOptimizerState(model, optimizer)


def load_stock_checkpoint(path: str, state: dict[str, Any], **options: Any) -> StockMigrationReport:
    """Load a checkpoint written by stock VeOmni's ``DistributedCheckpointer`` (the opt-in migration).

    ``state`` is what VeOmni's ``load`` takes (``model``, ``optimizer``, optionally ``extra_state``),
    ``options`` its keyword arguments (``process_group``, ``storage_reader``, ``trainable_only``,
    ``parallel_state``). ``state`` is filled the same way: the model and ``extra_state`` exactly as
    stock VeOmni loads them; the optimizer from what the checkpoint has (DSD's flat layout of a
    ``MultiOptimizer`` or the nested
    one of a single optimizer), matched by FQN. Parameters with no saved settings keep their
    group's current settings (stock VeOmni saves no settings for a sub-optimizer without state:
    a scheduler-moved lr of a leaf that never stepped is lost; restore the scheduler and step it
    to recompute it), parameters with no saved state get none (nothing is invented). Returns the
    per-leaf report, also issued as a `StockCheckpointWarning`. Save again (with the
    installed checkpointer) to get a sparse_ckpt checkpoint. Refuses a checkpoint that is not a
    stock one.
    """
    cls = _checkpointer_class(False)
    report = _load(cls, arguments_of(cls.load, path, state, **options), migrate=True, require_stock=True)
    assert report is not None  # require_stock: a stock checkpoint was migrated, or load_checkpoint raised
    return report
