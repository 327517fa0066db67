"""torch.distributed.checkpoint (DCP) integration.

:class:`SparseOptimizerState` is a DCP ``Stateful``: ``dcp.save``/``dcp.async_save`` call its
``state_dict()`` (the sparse dict of :func:`sparse_ckpt.sparse_state_dict`), ``dcp.load`` calls
``state_dict()`` for the load target and ``load_state_dict()`` with what it read.

A fresh optimizer's own dict is the wrong load target for a sparse checkpoint: it has no state
keys (so DCP would read no state), and its packed group table carries the digest of *its*
settings, which the checkpoint lacks. :class:`SparseLoadPlanner` fixes the target before DCP
plans the reads: it rebuilds every optimizer sub-dict from the checkpoint's metadata.

How the planner finds the optimizer sub-dicts: ``state_dict()`` returns a :class:`SparseStateDict`,
a ``dict`` subclass that carries its :class:`SparseOptimizerState` (hence the model). The planner
walks the (nested) load target for these dicts, so they may sit at any depth. DCP itself calls
``state_dict()``/``load_state_dict()`` only on *top-level* ``Stateful`` values; to nest, put
``state.state_dict()`` in your dict and call ``state.load_state_dict(...)`` on it after
``dcp.load`` (a ``SparseOptimizerState`` object below the top level is refused with a clear error
instead of being pickled). A ``SparseStateDict`` pickles and copies as a plain ``dict`` (never
dragging the model along), so ``dcp.async_save`` staging works on it.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as dtensor_empty

from ._dcp_paths import metadata_path, set_path
from ._gc import gc_paused
from ._torch_compat import called_by_dcp_load, dcp_storage_reader, saved_by_dcp_with_all_ranks
from .buffers import DEFAULT_STATE_LAYOUT, BufferReader, StateLayout, check_state_layout
from .capture import check_leaves
from .errors import CheckpointFormatError, CheckpointMismatchError
from .fqn import FqnMap, Model, build_fqn_map, validate_model
from .item_keys import Keying
from .keys import (
    BUFFERS_PREFIX,
    GROUPS_PREFIX,
    PACKED_PREFIX,
    PLANNER_GUARD_KEY,
    SCALARS_PREFIX,
    STATE_PREFIX,
    STEP_KEY,
    is_foreign_guard,
    is_table_key,
    last_part,
    owner_fqn,
    split_buffers_key,
    split_group_key,
    table_kind,
    tag_has_rank,
)
from .load import load_owned
from .nested import NESTED_KEYS
from .origin import ORIGIN_KEY, origin_here, refuse_rank0_only_save
from .save import FORMATS, Format, build_state_dict

__all__ = ["SparseLoadPlanner", "SparseOptimizerState", "SparseStateDict"]

_PLANNER_HINT = "pass planner=sparse_ckpt.SparseLoadPlanner() to dcp.load"
_NOT_READ = (PLANNER_GUARD_KEY, ORIGIN_KEY)
"""Entries of an optimizer dict the planner never reads back: the planner guard, and an origin record
(only pickles carry one; a DCP checkpoint is each rank's own, so one that reached the disk is not read)."""


class _PlannerGuard(torch.Tensor):
    """A one-element tensor that refuses to be a load target (see :data:`PLANNER_GUARD_KEY`).

    Saved, it is an ordinary ``uint8`` tensor item (DCP writes a plain copy, so the checkpoint
    holds no custom class). As a load target it raises while ``DefaultLoadPlanner`` plans the
    reads -- before any byte reaches the optimizer's live tensors -- with a message naming
    :class:`SparseLoadPlanner`, which drops it from the target instead.
    """

    @staticmethod
    def make() -> _PlannerGuard:
        return torch.Tensor._make_subclass(_PlannerGuard, torch.ones(1, dtype=torch.uint8))  # type: ignore[return-value]

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


class SparseStateDict(dict):
    """The dict :meth:`SparseOptimizerState.state_dict` returns: a plain ``dict`` tagged with its owner.

    DCP flattens it like any dict. :class:`SparseLoadPlanner` recognises it in a load target and
    sets ``planned``. Pickling and (deep) copies produce a plain ``dict`` of the same items; in a
    process group of several ranks plus the origin record :data:`~sparse_ckpt.origin.ORIGIN_KEY`,
    so that a load on another rank refuses it (:mod:`sparse_ckpt.origin`).
    """

    __slots__ = ("fmap", "lost", "origin", "owner", "planned", "present", "reader", "unresolved")

    def __init__(self, items: Mapping[str, Any], owner: SparseOptimizerState) -> None:
        super().__init__(items)
        self.owner = owner
        self.origin = origin_here()
        """``(rank, world size)`` that made it, in a group of several ranks (see :mod:`sparse_ckpt.origin`)."""
        self.planned = False
        self.unresolved: list[str] = []
        """Checkpoint state keys the planner skipped whose FQN it could not attribute to anyone."""
        self.fmap: FqnMap | None = None
        """The FQN map the planner built for this load target; the load of the same dict (the same
        ``dcp.load``) reuses it instead of walking the model again."""
        self.reader: BufferReader | None = None
        """Reads the checkpoint's buffer items (``state_layout="buffers"``) during the same
        ``dcp.load``, after the layout tables are read (set by the planner)."""
        self.present: set[str] | None = None
        """Every optimizer key of the checkpoint, read or not (set by the planner)."""
        self.lost: list[str] = []
        """Items the planner found missing from the checkpoint's metadata (an element of a list
        with elements after it): the load refuses them."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        items = self.copy()
        if self.origin is not None:  # one rank's state: a load on another rank must refuse it
            items[ORIGIN_KEY] = {"rank": self.origin[0], "world_size": self.origin[1]}
        return (dict, (), None, None, iter(items.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)

    def copy(self) -> dict[str, Any]:  # type: ignore[override]
        """A plain ``dict`` with the same items (the planner guard as a plain tensor)."""
        out = dict(self)
        guard = out.get(PLANNER_GUARD_KEY)
        if isinstance(guard, _PlannerGuard):
            out[PLANNER_GUARD_KEY] = guard.plain()
        return out


class SparseOptimizerState:
    """A DCP ``Stateful`` holding a model and its optimizer(s), saved sparsely and exactly.

    ``model`` is an ``nn.Module`` or a list of pipeline-parallel parts. ``optimizer`` is a
    ``torch.optim.Optimizer``, a :class:`sparse_ckpt.MultiOptimizer`, a ``Mapping[str, Optimizer]`` or a
    trainer's optimizer container (see :func:`sparse_ckpt.leaves.named_leaves`); both are checked
    here. ``format`` is ``"packed"`` (default) or ``"flat"`` (torch DSD's flat layout). ``strict`` is
    passed to :func:`sparse_ckpt.load_sparse_state_dict`.
    ``state_layout`` (packed format): ``"buffers"`` writes each rank's parameter-shaped state of a
    leaf as a few 1-D items plus a layout table, ``"per_tensor"`` one item per state tensor (see
    :mod:`sparse_ckpt.buffers`); both load into any world size, mesh or layout. Load it with
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

    def state_dict(self) -> SparseStateDict:
        """The sparse optimizer dict (see :func:`sparse_ckpt.sparse_state_dict`), tagged for the planner.

        It also holds the planner guard (:data:`sparse_ckpt.keys.PLANNER_GUARD_KEY`): a tiny
        tensor item that makes ``dcp.load`` without :class:`SparseLoadPlanner` fail while planning,
        before DCP reads anything into the optimizer's live state tensors. In the packed format it
        holds the foreign-loader guards too (:func:`sparse_ckpt.keys.foreign_guard_keys`), which make
        a loader that does not know the format (torch DSD's flat or nested layout, also with
        ``allow_partial_load=True``) fail while planning instead of silently skipping the settings.

        Saved by ``dcp.save``/``dcp.async_save`` over the default process group, the ranks
        exchange their tables' digests (one small ``all_gather_object``) so that table keys are
        stable from save to save (see *Table keys* in :mod:`sparse_ckpt.keys`); called any
        other way, it does not communicate.
        """
        refuse_rank0_only_save(self.optimizer)
        sd: dict[str, Any] = {PLANNER_GUARD_KEY: _PlannerGuard.make()}  # first: DCP plans keys in order
        caller = sys._getframe(1)
        if not called_by_dcp_load(caller):
            # A load target needs no content: SparseLoadPlanner rebuilds it from the checkpoint's
            # metadata (and without that planner the guard refuses the load), so dcp.load does not
            # pay for a capture of the optimizer it is about to overwrite.
            keying = Keying.with_ranks() if saved_by_dcp_with_all_ranks(caller) else Keying.here()
            with gc_paused():
                sd.update(
                    build_state_dict(self.model, self.optimizer, self.format, keying, self.state_layout, guards=True)
                )
        return SparseStateDict(sd, self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore from what DCP read (see :func:`sparse_ckpt.load_sparse_state_dict`).

        The planner guard entry is ignored. Transactional: on any error the optimizer is as it was.
        """
        data = dict(state_dict)
        data.pop(PLANNER_GUARD_KEY, None)
        fmap = None
        reader = None
        present = None
        if isinstance(state_dict, SparseStateDict):
            if state_dict.lost:
                raise CheckpointMismatchError(
                    f"optimizer item {state_dict.lost[0]!r} is missing from the checkpoint, and its list has items "
                    "after it: the checkpoint lost it from its metadata (a partial copy or a damaged checkpoint); "
                    "refusing to load it incomplete"
                )
            present = state_dict.present
            if state_dict.unresolved:
                data.update(dict.fromkeys(state_dict.unresolved))
            if state_dict.owner is self:
                fmap = state_dict.fmap
            reader = state_dict.reader
        load_owned(
            self.model,
            self.optimizer,
            data,
            strict=self.strict,
            unowned_are_other_ranks=multi_rank(),
            fmap=fmap,
            reader=reader,
            present=present,
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


def multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class SparseLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that makes optimizer load targets match the checkpoint.

    For every :class:`SparseStateDict` in the load target it replaces the dict's content by the
    checkpoint's optimizer entries under the same path: all packed group and scalar tables
    (every rank's), flat ``param_groups`` entries and ``state`` tensors of the parameters the *local* model owns
    (other ranks' experts are not read), and any other entry under the path. State tensors shaped
    like their parameter are allocated like it (a DTensor parameter: same mesh and placements;
    a plain one: same device), with the checkpoint's dtype; other tensors (``step``, ...) are plain
    CPU tensors; bytes items get a placeholder that DCP replaces. The optimizer itself is not
    touched until ``load_state_dict``, which validates before mutating. Everything else in the
    target is planned exactly as by ``DefaultLoadPlanner``.

    A checkpoint in torch DSD's *nested* layout (``{"state": {fqn: {...}}, "param_groups": [...]}``,
    what ``get_optimizer_state_dict`` returns by default and Accelerate's FSDP2 ``save_state``
    writes) is read the same way -- every group, the local parameters' state -- and loaded by FQN
    (see :mod:`sparse_ckpt.nested`), so existing checkpoints migrate without DSD's synthetic step.
    """

    def __init__(
        self, *, flatten_sharded_tensors: bool = True, allow_partial_load: bool = False, _all_weights_only: bool = False
    ) -> None:
        """``allow_partial_load``: as ``DefaultLoadPlanner``'s, for the entries that are not optimizer dicts.

        ``_all_weights_only`` (the VeOmni integration's stock-checkpoint migration): read *every*
        bytes item with ``weights_only=True``, not only the optimizer's.
        """
        self._all_weights_only = _all_weights_only
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=flatten_sharded_tensors,
            allow_partial_load=allow_partial_load,
        )

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        """Rebuild the optimizer sub-dicts from ``metadata``, then set up as ``DefaultLoadPlanner``."""
        targets = list(_find_targets(state_dict, ()))
        self._optimizer_keys: set[str] = set()
        if targets and metadata is not None:
            paths = {key: metadata_path(metadata, key) for key in metadata.state_dict_metadata}
            storage_reader = dcp_storage_reader(sys._getframe(1))
            for path, target in targets:
                self._optimizer_keys.update(_rebuild_target(path, target, metadata, paths, storage_reader))
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Read every non-tensor optimizer item with ``torch.load(weights_only=True)``; others as DCP does.

        ``DefaultLoadPlanner.load_bytes`` unpickles every bytes item with ``weights_only=False``,
        so a tampered optimizer item could run code before the library ever sees it. Packed group
        and scalar tables must be plain ``bytes``; flat ``param_groups`` values and non-tensor state values
        may be anything the restricted unpickler accepts. Refusals are
        :class:`CheckpointFormatError` naming the key.
        """
        key = read_item.dest_index.fqn
        table = is_table_key(key)
        if self._all_weights_only or table or key in getattr(self, "_optimizer_keys", ()):
            value = weights_only_item(key, value, table=table or BUFFERS_PREFIX in key)
        super().load_bytes(read_item, value)


def weights_only_item(key: str, value: io.BytesIO, table: bool) -> io.BytesIO:
    """Unpickle a DCP bytes item with ``weights_only=True``; return a fresh stream of it for DCP."""
    out = io.BytesIO()
    torch.save(weights_only_object(key, value, table), out)
    out.seek(0)
    return out


def weights_only_object(key: str, value: io.BytesIO, table: bool) -> Any:
    """The object of a DCP bytes item, unpickled with ``weights_only=True`` (``table``: it must be ``bytes``)."""
    prefix = next((p for p in (SCALARS_PREFIX, BUFFERS_PREFIX) if p in key), PACKED_PREFIX)
    what = table_kind(prefix) if table else "optimizer item"
    try:
        obj = torch.load(value, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal of the restricted unpickler
        raise CheckpointFormatError(f"{what} {key!r} is not a plain data item ({exc})") from None
    if table and not isinstance(obj, bytes):
        raise CheckpointFormatError(f"{what} {key!r} holds a {type(obj).__name__}, expected bytes")
    return obj


def _find_targets(node: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], SparseStateDict]]:
    """Every :class:`SparseStateDict` below ``node`` with its DCP object path."""
    if isinstance(node, SparseStateDict):
        yield path, node
    elif isinstance(node, SparseOptimizerState):
        raise TypeError(
            f"a SparseOptimizerState sits at {'.'.join(map(str, path))!r} below the top level of the load target; "
            "DCP calls state_dict()/load_state_dict() only on top-level values, so put it at the top level, or "
            "nest state.state_dict() and call state.load_state_dict() on it after dcp.load"
        )
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from _find_targets(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _find_targets(value, (*path, i))


def _rebuild_target(
    path: tuple[str | int, ...],
    target: SparseStateDict,
    metadata: Metadata,
    paths: Mapping[str, tuple[str | int, ...]],
    storage_reader: Any = None,
) -> list[str]:
    """Replace ``target``'s content by the checkpoint's entries under ``path``; returns their
    flattened DCP keys (the items this optimizer dict reads).

    Buffers layout: this rank's own layout tables are read (all of a leaf's when it has none of
    its own); buffers are left to ``target.reader`` (which reads them one at a time after the
    layouts, through ``storage_reader``). Without a storage reader, this rank's own buffers (all
    of a leaf's when it has no layout of its own) are read with the rest."""
    depth = len(path)
    entries: list[tuple[tuple[str | int, ...], Any, str]] = []
    for key, md in metadata.state_dict_metadata.items():
        p = paths[key]
        if len(p) > depth and p[:depth] == path and isinstance(p[depth], str) and p[depth] not in _NOT_READ:
            entries.append((p[depth:], md, key))
    where = ".".join(map(str, path))
    if not entries:
        raise CheckpointMismatchError(
            f"the checkpoint has no optimizer entries under {where!r} (saved under another key, or no optimizer)"
        )
    fmap = target.fmap = build_fqn_map(target.owner.model)
    flat_fqns = {split[0] for rel, _md, _key in entries if (split := split_group_key(str(rel[0]))) is not None}
    new: dict[str, Any] = {}
    keys: list[str] = []
    unresolved: list[str] = []
    buffered = {str(rel[0]): key for rel, _md, key in entries if len(rel) == 1 and str(rel[0]).startswith(BUFFERS_PREFIX)}
    read_now = _buffers_to_read(buffered, storage_reader is not None)
    target.reader = None if storage_reader is None or not buffered else BufferReader(
        buffered, _item_reader(storage_reader, metadata)
    )
    for rel, md, key in entries:
        inner = str(rel[0])
        value: Any
        if len(rel) > 2 and inner in NESTED_KEYS:  # DSD's nested layout: ('state', fqn, key...) / ('param_groups', i, key)
            if inner == NESTED_KEYS[0]:
                fqn = str(rel[1])
                if fqn not in fmap.canonical:
                    continue  # another rank's parameter (the load checks the dict's own groups)
                value = _allocate(md, _param(fmap, fqn), str(rel[-1]))
            else:
                value = _allocate(md, None, "")
        elif inner in buffered:
            if inner not in read_now:
                continue
            value = _allocate(md, None, "")
        elif inner.startswith((PACKED_PREFIX, SCALARS_PREFIX)):  # every rank's tables
            value = _allocate(md, None, "")
        elif is_foreign_guard(inner, md):
            continue  # for loaders that do not know the format; nothing to read
        elif inner.startswith(GROUPS_PREFIX):
            fqn = split_group_key(inner)[0]  # type: ignore[index] - not a table: a flat group key
            if fqn and fqn not in fmap.canonical:
                continue  # another rank's parameter
            value = _allocate(md, None, "")
        elif inner.startswith(STATE_PREFIX):
            # Which local parameter's buffer to allocate like: a guess by the target's FQNs (the
            # tables are not read yet); the load resolves every key by the checkpoint's own FQNs.
            fqn = owner_fqn(inner[len(STATE_PREFIX) :], fmap.canonical)
            if fqn is None:
                if owner_fqn(inner[len(STATE_PREFIX) :], flat_fqns) is None:
                    unresolved.append(inner)
                continue  # another rank's parameter (or nobody's: unresolved, checked on load)
            key_leaf = last_part(inner) if len(rel) == 1 else str(rel[-1])
            value = _allocate(md, _param(fmap, fqn), key_leaf)
        else:
            value = _allocate(md, None, "")
        set_path(new, rel, value)
        keys.append(key)
    target.lost = _drop_holes(new, {rel for rel, _md, _key in entries})
    target.present = {str(rel[0]) for rel, _md, _key in entries}
    target.clear()
    target.update(new)
    target.planned = True
    target.unresolved = unresolved
    return keys


def _drop_holes(new: dict[str, Any], planned: Collection[tuple[str | int, ...]]) -> list[str]:
    """The items missing inside lists of ``new`` (an index ``set_path`` filled with ``None`` because the
    checkpoint's metadata has items after it but not it), as dotted keys; each entry holding one is
    taken out of ``new`` (DCP would refuse its plan: the load refuses it by name instead)."""
    lost: list[str] = []

    def walk(path: tuple[str | int, ...], node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk((*path, k), v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if v is None and (*path, i) not in planned:
                    lost.append(".".join(map(str, (*path, i))))
                else:
                    walk((*path, i), v)

    for top, value in list(new.items()):
        if isinstance(value, (list, dict)):
            before = len(lost)
            walk((top,), value)
            if len(lost) > before:
                del new[top]
    return lost


def _buffers_to_read(buffered: Mapping[str, str], have_reader: bool) -> set[str]:
    """Which buffers-layout items the DCP load itself reads (see :func:`_rebuild_target`)."""
    here = Keying.here()  # this rank of the default process group, or (1, 0) in a single process
    by_leaf: dict[str, list[tuple[str, str, bool]]] = {}
    for inner in buffered:
        leaf, kind, _bucket, ranks = split_buffers_key(inner[len(BUFFERS_PREFIX) :])
        by_leaf.setdefault(leaf, []).append((inner, kind, tag_has_rank(ranks, here.world, here.rank)))
    out: set[str] = set()
    for found in by_leaf.values():
        own = any(mine and kind == "layout" for _inner, kind, mine in found)
        for inner, kind, mine in found:
            if (kind == "layout" or not have_reader) and (mine or not own):
                out.add(inner)
    return out


class _ItemPlanner(LoadPlanner):
    """Reads a few whole items of a checkpoint, one at a time, handing each to ``consume`` (the
    buffer reads of ``state_layout="buffers"``): a tensor item is read into a new CPU tensor that
    only ``consume`` keeps; a bytes item is unpickled with ``weights_only=True``. Only the read
    callbacks are used (``read_data`` is called directly, outside DCP's planning)."""

    def __init__(self, metadata: Metadata, consume: Any) -> None:
        self.metadata = metadata
        self._consume = consume

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        raise NotImplementedError  # pragma: no cover - never planned through DCP

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError  # pragma: no cover

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError  # pragma: no cover

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError  # pragma: no cover

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[read_item.dest_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        if len(md.chunks) != 1 or tuple(read_item.lengths) != tuple(md.size):
            raise CheckpointFormatError(f"buffer item {read_item.dest_index.fqn!r} is not one whole tensor chunk")
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self._consume(read_item.dest_index.fqn, tensor)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        self._consume(key, weights_only_object(key, value, table=True))


def _item_reader(storage_reader: Any, metadata: Metadata) -> Any:
    """``read(dcp_keys, consume)`` through the load's own storage reader (rank-local, no collective)."""

    def read(dcp_keys: list[str], consume: Any) -> None:
        targets: dict[str, Any] = {}
        for key in dcp_keys:
            md = metadata.state_dict_metadata[key]
            is_tensor = isinstance(md, TensorStorageMetadata)
            targets[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta") if is_tensor else b""
        plan = create_default_local_load_plan(targets, metadata)
        storage = getattr(metadata, "storage_data", None)
        if isinstance(storage, Mapping):  # a storage reader looks each item up there: refuse a lost entry first
            for item in plan.items:
                if item.storage_index not in storage:
                    raise CheckpointMismatchError(
                        f"checkpoint item {item.storage_index.fqn!r} has no storage entry in the checkpoint's "
                        ".metadata (a damaged or partial copy): its data cannot be found"
                    )
        storage_reader.read_data(plan, _ItemPlanner(metadata, consume)).wait()

    return read


def _param(fmap: FqnMap, fqn: str) -> torch.Tensor:
    return fmap.param_of[fmap.canonical[fqn]]


def _allocate(md: Any, like: torch.Tensor | None, key_leaf: str) -> Any:
    """A load buffer for one checkpoint item (``None`` for bytes items: DCP replaces it)."""
    if isinstance(md, BytesStorageMetadata) or not isinstance(md, TensorStorageMetadata):
        return None
    size = tuple(md.size)
    dtype = md.properties.dtype
    if like is not None and key_leaf != STEP_KEY and size == tuple(like.shape):
        if isinstance(like, DTensor):
            return dtensor_empty(size, dtype=dtype, device_mesh=like.device_mesh, placements=like.placements)
        return torch.empty(size, dtype=dtype, device=like.device)
    return torch.empty(size, dtype=dtype)
