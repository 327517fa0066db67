"""The DCP ``Stateful``: `SparseOptimizerState`, the dict it returns, and the planner guard.

`SparseOptimizerState` is a DCP ``Stateful``: ``dcp.save``/``dcp.async_save`` call its
``state_dict()`` (the sparse dict of `sparse_ckpt.sparse_state_dict`), ``dcp.load`` calls
``state_dict()`` for the load target and ``load_state_dict()`` with what it read. The load target
is rebuilt from the checkpoint by `sparse_ckpt._dcp.planner.SparseLoadPlanner`.

How the planner finds the optimizer sub-dicts: ``state_dict()`` returns a `SparseStateDict`,
a ``dict`` subclass that carries its `SparseOptimizerState` (hence the model). The planner
walks the (nested) load target for these dicts, so they may sit at any depth. DCP itself calls
``state_dict()``/``load_state_dict()`` only on *top-level* ``Stateful`` values; to nest, put
``state.state_dict()`` in your dict and call ``state.load_state_dict(...)`` on it after
``dcp.load`` (a ``SparseOptimizerState`` object below the top level is refused with a clear error
instead of being pickled). A ``SparseStateDict`` pickles and copies as a plain ``dict`` (never
dragging the model along), so ``dcp.async_save`` staging works on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._dist import agree_on_refusal, multi_rank
from .._format.keys import PLANNER_GUARD_KEY
from .._format.tags import Keying
from .._fqn import FqnMap, Model, validate_model
from .._gc import gc_paused
from .._host_memory import HostPool
from .._layouts import DEFAULT_STATE_LAYOUT, StateLayout, check_state_layout
from .._layouts.bucketed_load import BucketReader
from .._load.load import load_owned
from .._save.capture import check_leaves
from .._save.fill_plan import FillPlans
from .._save.save import FORMATS, Format, build_state_dict
from .._torch_internals import (
    called_by_dcp_load,
    caller_frame,
    loaded_by_dcp_with_all_ranks,
    make_subclass,
    saved_by_dcp_async,
    saved_by_dcp_with_all_ranks,
)
from ..errors import CheckpointMismatchError
from .origin import OriginDict, origin_here, refuse_rank0_only_save

__all__ = ["SparseOptimizerState", "SparseStateDict", "planned_load"]

_PLANNER_HINT = "pass planner=sparse_ckpt.SparseLoadPlanner() to dcp.load"


class _PlannerGuard(torch.Tensor):
    """A one-element tensor that refuses to be a load target (see `PLANNER_GUARD_KEY`).

    Saved, it is an ordinary ``uint8`` tensor item (DCP writes a plain copy, so the checkpoint
    holds no custom class). As a load target it raises while ``DefaultLoadPlanner`` plans the
    reads -- before any byte reaches the optimizer's live tensors -- with a message naming
    `SparseLoadPlanner`, which drops it from the target instead.
    """

    @staticmethod
    def make() -> _PlannerGuard:
        return make_subclass(_PlannerGuard, torch.ones(1, dtype=torch.uint8))  # type: ignore[return-value]

    def plain(self) -> torch.Tensor:
        """The value as a plain tensor."""
        return torch.ones(1, dtype=torch.uint8)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:  # DCP save: what to write
        return self.plain()

    def __create_chunk_list__(self) -> Any:  # DCP load planning: refuse
        raise CheckpointMismatchError(
            "a sparse_ckpt optimizer state (SparseOptimizerState or MultiOptimizer) can only be loaded with "
            "its planner, which builds the load target from the checkpoint; " + _PLANNER_HINT
        )

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickle and deepcopy: a plain tensor
        return self.plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Any) -> torch.Tensor:
        return self.plain()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Any torch operation on the guard (async staging copies it) yields plain tensors.
        return super().__torch_function__(func, (torch.Tensor,), args, kwargs or {})


class SparseStateDict(OriginDict):
    """The dict `SparseOptimizerState.state_dict` returns: a plain ``dict`` tagged with its owner.

    DCP flattens it like any dict. `SparseLoadPlanner` recognises it in a load target and
    sets ``planned``. Pickled or copied, it is the plain dict of an
    `sparse_ckpt._dcp.origin.OriginDict` (its origin record included), the planner guard a plain tensor.
    """

    __slots__ = ("fmap", "lost", "owner", "planned", "present", "reader", "snapshots", "unresolved")

    def __init__(
        self,
        items: Mapping[str, Any],
        owner: SparseOptimizerState,
        snapshots: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None,
    ) -> None:
        super().__init__(items, origin_here())
        self.owner = owner
        self.snapshots = snapshots
        """For a capture made for ``dcp.async_save``: ``(value, its copy)`` for the items the capture
        already copied (its buckets, which are their own copies, and its large CPU state tensors), which a
        deep copy takes instead of copying them again (`__deepcopy__`); ``None`` for any other dict."""
        self.planned = False
        self.unresolved: list[str] = []
        """Checkpoint state keys the planner skipped whose FQN it could not attribute to anyone."""
        self.fmap: FqnMap | None = None
        """The FQN map the planner built for this load target; the load of the same dict (the same
        ``dcp.load``) reuses it instead of walking the model again."""
        self.reader: BucketReader | None = None
        """Reads the checkpoint's buffer items (``state_layout="buffers"``) during the same
        ``dcp.load``, after the layout tables are read (set by the planner)."""
        self.present: set[str] | None = None
        """Every optimizer key of the checkpoint, read or not (set by the planner)."""
        self.lost: list[str] = []
        """Items the planner found missing from the checkpoint's metadata (an element of a list
        with elements after it): the load refuses them."""

    def copy(self) -> dict[str, Any]:  # type: ignore[override]
        """A plain ``dict`` with the same items (the planner guard as a plain tensor)."""
        out = dict(self)
        guard = out.get(PLANNER_GUARD_KEY)
        if isinstance(guard, _PlannerGuard):
            out[PLANNER_GUARD_KEY] = guard.plain()
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        """A plain ``dict`` of copies of the items (`copy`), as ``dcp.async_save``'s stager makes
        before it returns. For a capture made for ``dcp.async_save`` (``snapshots``), the copies the
        capture already made are taken, not made a second time: the buckets it filled with copies of
        the state (no live tensor aliases them, and nothing else holds them) and each CPU state tensor
        of at least 64 KiB, copied into a buffer of the owner's pool, reused from save to save
        (`sparse_ckpt._host_memory.HostPool.snapshot`, on the capture's second thread while it filled
        the buckets: `sparse_ckpt._save.worker`). Either way the copy holds the values as of the save,
        whatever the optimizer does next."""
        if self.snapshots is not None:
            for original, copy in self.snapshots:
                memo.setdefault(id(original), copy)
        return super().__deepcopy__(memo)


def planned_load(state_dict: Mapping[str, Any], data: dict[str, Any], model: Model) -> dict[str, Any]:
    """What the load of ``state_dict`` into ``model``'s optimizer takes from the planner that rebuilt
    it (nothing when it is not a `SparseStateDict`): refuses a dict the planner found an item of
    missing (``lost``), adds the checkpoint keys it could not attribute (``unresolved``) to
    ``data`` (the items to load, made from ``state_dict``), and returns `load_owned`'s ``fmap``
    (the planner's, when built for this model), ``reader`` and ``present``. Shared by
    `SparseOptimizerState.load_state_dict` and ``integrations.dsd``'s ``set_optimizer_state_dict``."""
    if not isinstance(state_dict, SparseStateDict):
        return {}
    if state_dict.lost:
        raise CheckpointMismatchError(
            f"optimizer item {state_dict.lost[0]!r} is missing from the checkpoint, and its list has items "
            "after it: the checkpoint lost it from its metadata (a partial copy or a damaged checkpoint); "
            "refusing to load it incomplete"
        )
    if state_dict.unresolved:
        data.update(dict.fromkeys(state_dict.unresolved))
    fmap = state_dict.fmap if state_dict.owner.model is model else None
    return {"fmap": fmap, "reader": state_dict.reader, "present": state_dict.present}


class SparseOptimizerState:
    """A DCP ``Stateful`` holding a model and its optimizer(s), saved sparsely and exactly.

    ``model`` is an ``nn.Module`` or a list of pipeline-parallel parts. ``optimizer`` is a
    ``torch.optim.Optimizer``, a `sparse_ckpt.MultiOptimizer`, a ``Mapping[str, Optimizer]`` or a
    trainer's optimizer container (docs/semantics.md, *What you pass*); both are checked
    here. ``format`` is ``"packed"`` (default) or ``"flat"`` (torch DSD's flat layout). ``strict`` is
    passed to `sparse_ckpt.load_sparse_state_dict`.
    ``state_layout`` (packed format): ``"auto"`` (default) writes each rank's small
    parameter-shaped state chunks of a leaf as a few 1-D items plus a layout table and every
    tensor whose chunks reach `sparse_ckpt._layouts.AUTO_OWN_ITEM_BYTES` (4 MiB; 1 MiB inside
    ``dcp.async_save``) as an item of its own,
    ``"buffers"`` buffers them all, ``"per_tensor"`` writes one item per state tensor (see
    docs/dcp.md, *State layout*); all load into any world size, mesh or layout. Load it with
    ``dcp.load(..., planner=sparse_ckpt.SparseLoadPlanner())``.

    In a process group of more than one rank, saved FQNs that the local model does not own are
    taken to be other ranks' (expert parallelism) and are not "extra" in strict mode; in a single
    process they are. The model's own parameters must always be in the checkpoint (strict mode).
    """

    def __init__(
        self,
        model: Model,
        optimizer: Any,
        *,
        format: Format = "packed",
        strict: bool = True,
        state_layout: StateLayout = DEFAULT_STATE_LAYOUT,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        self.state_layout: StateLayout = check_state_layout(state_layout, format)
        validate_model(model)
        check_leaves(optimizer)  # validate the optimizer argument now, not inside dcp.save
        self.model = model
        self.optimizer = optimizer
        self.format: Format = format
        self.strict = strict
        self.fill_plans = FillPlans()
        """The previous ``dcp.async_save`` capture's bucket fills (`sparse_ckpt._save.fill_plan`)."""
        self.host_pool = HostPool()
        """The host buffers ``dcp.async_save`` captures of this state copy into, reused from save
        to save (`sparse_ckpt._host_memory.HostPool`); released with this object."""

    def state_dict(self) -> SparseStateDict:
        """The sparse optimizer dict (see `sparse_ckpt.sparse_state_dict`), tagged for the planner.

        It also holds the planner guard (docs/formats.md, *Every key*): a tiny
        tensor item that makes ``dcp.load`` without `SparseLoadPlanner` fail while planning,
        before DCP reads anything into the optimizer's live state tensors. In the packed format it
        holds the foreign-loader guards too (docs/dcp.md, *Loaders that do not know the format*), which make
        a loader that does not know the format (torch DSD's flat or nested layout, also with
        ``allow_partial_load=True``) fail while planning instead of silently skipping the settings.

        Saved by ``dcp.save``/``dcp.async_save`` over the default process group, the ranks
        exchange their tables' digests (one small ``all_gather_object``) so that table keys are
        stable from save to save (docs/formats.md, *Table keys*); called any
        other way, it does not communicate.
        """
        return self._state_dict_for(caller_frame(1))

    def _state_dict_for(self, caller: Any) -> SparseStateDict:
        """`state_dict` as called from the frame ``caller``: a ``Stateful`` whose own
        ``state_dict()`` delegates here (`sparse_ckpt.MultiOptimizer`) passes *its* caller,
        so that a load target built for ``dcp.load`` is not captured like a save."""
        if called_by_dcp_load(caller):
            # A load target needs no content: SparseLoadPlanner rebuilds it from the checkpoint's
            # metadata (and without that planner the guard refuses the load), so dcp.load does not
            # pay for a capture of the optimizer it is about to overwrite.
            return self._captured(None)
        keying = Keying.with_ranks() if saved_by_dcp_with_all_ranks(caller) else Keying.here()
        return self._captured(keying, staged=saved_by_dcp_async(caller))

    def _captured(self, keying: Keying | None, *, staged: bool = False) -> SparseStateDict:
        """The dict to save, its table keys chosen by ``keying`` (``None``: a load target, the
        planner guard only; ``staged``: for ``dcp.async_save``, see `build_state_dict`). An
        integration whose trainer writes files of its own before calling ``dcp.save`` captures
        with this first, so a save that will be refused writes nothing."""
        refuse_rank0_only_save(self.optimizer)
        sd: dict[str, Any] = {PLANNER_GUARD_KEY: _PlannerGuard.make()}  # first: DCP plans keys in order
        snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []
        if staged:
            self.host_pool.begin()
        if keying is not None:
            with gc_paused():
                sd.update(
                    build_state_dict(
                        self.model,
                        self.optimizer,
                        self.format,
                        keying,
                        self.state_layout,
                        guards=True,
                        staged=staged,
                        snapshots=snapshots if staged else None,
                        pool=self.host_pool if staged else None,
                        plans=self.fill_plans if staged else None,
                    )
                )
        return SparseStateDict(sd, self, tuple(snapshots) if staged else None)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore from what DCP read (see `sparse_ckpt.load_sparse_state_dict`).

        The planner guard entry is ignored. Transactional: on any error the optimizer is as it was.
        Called by ``dcp.load`` over the default process group of several ranks, the ranks agree on a
        refusal before anything is mutated (one small ``all_gather_object``): a refusal on one rank
        raises on every rank, naming the refusing rank(s).
        """
        agree = "dcp.load of the optimizer" if loaded_by_dcp_with_all_ranks(caller_frame(1)) else None
        data = dict(state_dict)
        data.pop(PLANNER_GUARD_KEY, None)
        try:
            planned = planned_load(state_dict, data, self.model)
        except Exception as exc:
            if agree is not None:
                agree_on_refusal(exc, agree)
            raise
        load_owned(
            self.model,
            self.optimizer,
            data,
            strict=self.strict,
            unowned_are_other_ranks=multi_rank(),
            agree=agree,
            **planned,
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a SparseOptimizerState cannot be pickled or copied; DCP calls state_dict() only on top-level "
            "values of the dict given to dcp.save/dcp.load, so put it at the top level, or nest "
            "state.state_dict() instead"
        )

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__reduce_ex__(2)

    def __repr__(self) -> str:
        return (
            f"SparseOptimizerState(format={self.format!r}, strict={self.strict}, state_layout={self.state_layout!r}, "
            f"optimizer={self.optimizer!r})"
        )
