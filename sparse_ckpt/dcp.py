"""torch.distributed.checkpoint (DCP) integration (DESIGN §6).

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
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as dtensor_empty

from ._core_py import PACKED_MARKER
from .checkpoint_io import metadata_path, set_path
from .errors import CheckpointFormatError, CheckpointMismatchError
from .fqn import FqnMap, build_fqn_map
from .leaves import named_leaves
from .load import load_sparse_state_dict
from .save import FORMATS, Format, sparse_state_dict

__all__ = ["SparseLoadPlanner", "SparseOptimizerState", "SparseStateDict"]

_PLANNER_HINT = "pass planner=sparse_ckpt.SparseLoadPlanner() to dcp.load"
_PACKED_PREFIX = f"param_groups.{PACKED_MARKER}."


class SparseStateDict(dict):
    """The dict :meth:`SparseOptimizerState.state_dict` returns: a plain ``dict`` tagged with its owner.

    DCP flattens it like any dict. :class:`SparseLoadPlanner` recognises it in a load target and
    sets ``planned``. Pickling and (deep) copies produce a plain ``dict`` of the same items.
    """

    __slots__ = ("needs_plan", "owner", "planned", "unresolved")

    def __init__(self, items: Mapping[str, Any], owner: SparseOptimizerState, needs_plan: bool) -> None:
        super().__init__(items)
        self.owner = owner
        self.planned = False
        self.needs_plan = needs_plan
        """The optimizer had a parameter without state when the dict was made."""
        self.unresolved: list[str] = []
        """Checkpoint state keys the planner skipped whose FQN it could not attribute to anyone."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (dict, (), None, None, iter(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__reduce_ex__(2)

    def copy(self) -> dict[str, Any]:  # type: ignore[override]
        """A plain ``dict`` with the same items."""
        return dict(self)


class SparseOptimizerState:
    """A DCP ``Stateful`` holding a model and its optimizer(s), saved sparsely and exactly.

    ``optimizer`` is a ``torch.optim.Optimizer``, a :class:`sparse_ckpt.MultiOptimizer` or a
    ``Mapping[str, Optimizer]``. ``format`` is ``"packed"`` (default) or ``"flat"`` (torch DSD's
    flat layout). ``strict`` is passed to :func:`sparse_ckpt.load_sparse_state_dict`. Load it with
    ``dcp.load(..., planner=sparse_ckpt.SparseLoadPlanner())``.

    In a process group of more than one rank, saved FQNs that the local model does not own are
    taken to be other ranks' (expert parallelism) and are not "extra" in strict mode; in a single
    process they are. The model's own parameters must always be in the checkpoint (strict mode).
    """

    def __init__(self, model: nn.Module, optimizer: Any, *, format: Format = "packed", strict: bool = True) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        named_leaves(optimizer)  # validate the optimizer argument now, not at save time
        self.model = model
        self.optimizer = optimizer
        self.format: Format = format
        self.strict = strict

    def state_dict(self) -> SparseStateDict:
        """The sparse optimizer dict (see :func:`sparse_ckpt.sparse_state_dict`), tagged for the planner."""
        sd = sparse_state_dict(self.model, self.optimizer, format=self.format)
        return SparseStateDict(sd, self, self._has_stateless_param())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore from what DCP read (see :func:`sparse_ckpt.load_sparse_state_dict`).

        Refuses a :class:`SparseStateDict` that :class:`SparseLoadPlanner` did not plan when the
        optimizer had a parameter without state: DCP would have read only the keys the target
        already had, so state saved for that parameter would be silently dropped.
        """
        data: Mapping[str, Any] = state_dict
        if isinstance(state_dict, SparseStateDict):
            if not state_dict.planned and state_dict.needs_plan:
                raise CheckpointMismatchError(
                    "this optimizer has parameters without state, and the load target was not built from the "
                    "checkpoint, so state saved for them would be silently dropped; " + _PLANNER_HINT
                )
            if state_dict.unresolved:
                data = dict(state_dict)
                data.update(dict.fromkeys(state_dict.unresolved))
        load_sparse_state_dict(
            self.model, self.optimizer, data, strict=self.strict, allow_unowned=_multi_rank()
        )

    def _has_stateless_param(self) -> bool:
        for _leaf, opt in named_leaves(self.optimizer):
            state = opt.state
            for group in opt.param_groups:
                for p in group["params"]:
                    if not state.get(p):
                        return True
        return False

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a SparseOptimizerState cannot be pickled or copied; DCP calls state_dict() only on top-level "
            "values of the dict given to dcp.save/dcp.load, so put it at the top level, or nest "
            "state.state_dict() instead"
        )

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__reduce_ex__(2)

    def __repr__(self) -> str:
        return f"SparseOptimizerState(format={self.format!r}, strict={self.strict}, optimizer={self.optimizer!r})"


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class SparseLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that makes optimizer load targets match the checkpoint.

    For every :class:`SparseStateDict` in the load target it replaces the dict's content by the
    checkpoint's optimizer entries under the same path: all packed group tables (every rank's),
    flat ``param_groups`` entries and ``state`` tensors of the parameters the *local* model owns
    (other ranks' experts are not read), and any other entry under the path. State tensors shaped
    like their parameter are allocated like it (a DTensor parameter: same mesh and placements;
    a plain one: same device), with the checkpoint's dtype; other tensors (``step``, ...) are plain
    CPU tensors; bytes items get a placeholder that DCP replaces. The optimizer itself is not
    touched until ``load_state_dict``, which validates before mutating. Everything else in the
    target is planned exactly as by ``DefaultLoadPlanner``.
    """

    def __init__(self, *, flatten_sharded_tensors: bool = True, allow_partial_load: bool = False) -> None:
        """``allow_partial_load``: as ``DefaultLoadPlanner``'s, for the entries that are not optimizer dicts."""
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
        if targets and metadata is not None:
            paths = {key: metadata_path(metadata, key) for key in metadata.state_dict_metadata}
            for path, target in targets:
                _rebuild_target(path, target, metadata, paths)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Read packed group tables with ``torch.load(weights_only=True)``; other items as DCP does.

        ``DefaultLoadPlanner.load_bytes`` unpickles every bytes item with ``weights_only=False``,
        so a tampered table item could run code before the table decoder ever sees it. A table is
        plain ``bytes``; anything else under a packed key is a :class:`CheckpointFormatError`.
        """
        if _PACKED_PREFIX in read_item.dest_index.fqn:
            value = _plain_bytes_item(read_item.dest_index.fqn, value)
        super().load_bytes(read_item, value)


def _plain_bytes_item(key: str, value: io.BytesIO) -> io.BytesIO:
    """Check that a DCP bytes item holds plain ``bytes``; return a fresh stream of it for DCP."""
    try:
        obj = torch.load(value, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal of the restricted unpickler
        raise CheckpointFormatError(f"packed group table {key!r} is not a plain bytes item ({exc})") from None
    if not isinstance(obj, bytes):
        raise CheckpointFormatError(f"packed group table {key!r} holds a {type(obj).__name__}, expected bytes")
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


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
) -> None:
    depth = len(path)
    entries: list[tuple[tuple[str | int, ...], Any]] = []
    for key, md in metadata.state_dict_metadata.items():
        p = paths[key]
        if len(p) > depth and p[:depth] == path and isinstance(p[depth], str):
            entries.append((p[depth:], md))
    where = ".".join(map(str, path))
    if not entries:
        raise CheckpointMismatchError(
            f"the checkpoint has no optimizer entries under {where!r} (saved under another key, or no optimizer)"
        )
    fmap = build_fqn_map(target.owner.model)
    flat_fqns = {
        str(rel[0])[len("param_groups.") :].rpartition(".")[0]
        for rel, _md in entries
        if str(rel[0]).startswith("param_groups.") and not str(rel[0]).startswith(_PACKED_PREFIX)
    }
    new: dict[str, Any] = {}
    unresolved: list[str] = []
    for rel, md in entries:
        inner = str(rel[0])
        value: Any
        if inner.startswith(_PACKED_PREFIX):
            value = _allocate(md, None, "")
        elif inner.startswith("param_groups."):
            fqn = inner[len("param_groups.") :].rpartition(".")[0]
            if fqn and fqn not in fmap.canonical:
                continue  # another rank's parameter
            value = _allocate(md, None, "")
        elif inner.startswith("state."):
            fqn = _longest_prefix(inner[len("state.") :], fmap.canonical)
            if fqn is None:
                if _longest_prefix(inner[len("state.") :], flat_fqns) is None:
                    unresolved.append(inner)
                continue  # another rank's parameter (or nobody's: unresolved, checked on load)
            key_leaf = inner.rpartition(".")[2] if len(rel) == 1 else str(rel[-1])
            value = _allocate(md, _param(fmap, fqn), key_leaf)
        else:
            value = _allocate(md, None, "")
        set_path(new, rel, value)
    target.clear()
    target.update(new)
    target.planned = True
    target.unresolved = unresolved


def _param(fmap: FqnMap, fqn: str) -> torch.Tensor:
    return fmap.param_of[fmap.canonical[fqn]]


def _longest_prefix(body: str, known: Mapping[str, Any] | set[str]) -> str | None:
    """Longest proper dotted prefix of ``body`` that is in ``known``."""
    dot = body.rfind(".")
    while dot > 0:
        candidate = body[:dot]
        if candidate in known:
            return candidate
        dot = body.rfind(".", 0, dot)
    return None


def _allocate(md: Any, like: torch.Tensor | None, key_leaf: str) -> Any:
    """A load buffer for one checkpoint item (``None`` for bytes items: DCP replaces it)."""
    if isinstance(md, BytesStorageMetadata) or not isinstance(md, TensorStorageMetadata):
        return None
    size = tuple(md.size)
    dtype = md.properties.dtype
    if like is not None and key_leaf != "step" and size == tuple(like.shape):
        if isinstance(like, DTensor):
            return dtensor_empty(size, dtype=dtype, device_mesh=like.device_mesh, placements=like.placements)
        return torch.empty(size, dtype=dtype, device=like.device)
    return torch.empty(size, dtype=dtype)
