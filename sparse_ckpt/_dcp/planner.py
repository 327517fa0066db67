"""The load planner: `SparseLoadPlanner` makes every optimizer load target match the checkpoint.

A fresh optimizer's own dict is the wrong load target for a sparse checkpoint: it has no state
keys (so DCP would read no state), and its packed group table carries the digest of *its*
settings, which the checkpoint lacks. The planner finds the optimizer sub-dicts of the load target
(`sparse_ckpt._dcp.stateful.SparseStateDict`, at any depth) and rebuilds each from the
checkpoint's metadata before DCP plans the reads: one rule per kind of entry
(`_TargetBuilder.rebuild`).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from .._format.keys import (
    BUFFERS_PREFIX,
    GROUPS_PREFIX,
    PACKED_PREFIX,
    PLANNER_GUARD_KEY,
    SCALARS_PREFIX,
    STATE_PREFIX,
    is_foreign_guard,
    is_table_key,
    last_part,
    owner_fqn,
    split_group_key,
)
from .._format.nested import NESTED_KEYS
from .._fqn import build_fqn_map
from .._layouts.bucketed_load import BucketReader, items_a_load_reads
from .._leaves import named_leaves
from .._torch_internals import (
    caller_frame,
    clear_dcp_flatten_flag,
    dcp_flatten_as_saved,
    dcp_storage_reader,
    file_item_location,
)
from ..errors import CheckpointMismatchError
from .damage import guard_reads
from .items import allocate_item, check_covered, read_items, weights_only_item
from .origin import ORIGIN_KEY
from .paths import metadata_paths, set_path
from .stateful import SparseOptimizerState, SparseStateDict

__all__ = ["SparseLoadPlanner", "optimizer_bytes", "reads_weights_only"]

_NOT_READ = (PLANNER_GUARD_KEY, ORIGIN_KEY)
"""Entries of an optimizer dict the planner never reads back: the planner guard, and an origin record
(only pickles carry one; a DCP checkpoint is each rank's own, so one that reached the disk is not read)."""

_SKIP = object()
"""What a rule returns for an entry this rank does not read."""


class SparseLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that makes optimizer load targets match the checkpoint.

    For every `SparseStateDict` in the load target it replaces the dict's content by the
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
    (docs/formats.md), so existing checkpoints migrate without DSD's synthetic step.
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
        """Rebuild the optimizer sub-dicts from ``metadata``, then set up as ``DefaultLoadPlanner``.

        DCP's flatten flag left set by an interrupted load (`clear_dcp_flatten_flag`) is cleared
        first: it would flatten this target as torch <= 2.3 did, and the load would fail."""
        clear_dcp_flatten_flag()
        targets = list(_find_targets(state_dict, ()))
        self._optimizer_keys: set[str] = set()
        self._read_here: dict[str, str] = {}
        self._skipped: set[str] = set()
        if targets and metadata is not None:
            paths = metadata_paths(metadata)
            storage_reader = dcp_storage_reader(caller_frame(1))
            guard_reads(storage_reader, metadata, self._reads_weights_only)
            for path, target in targets:
                builder = _TargetBuilder(target, metadata, storage_reader, read_whole=True)
                self._optimizer_keys.update(builder.rebuild(path, paths))
                self._read_here.update(builder.read_here)
                self._skipped.update(builder.under_path)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        """``DefaultLoadPlanner``'s plan without the state items `set_up_planner` read itself.

        When the only checkpoint items the target lacks are optimizer entries this planner chose
        not to plan (other ranks' state, guards, buffers read later), the plan is made directly:
        ``DefaultLoadPlanner`` would first probe for a torch <= 2.3 checkpoint (a second flatten of
        the whole target under a module-wide flag that an interrupt can leave set). Otherwise its
        probe runs as usual, and the flag is cleared after it whatever happens (`dcp_flatten_as_saved`)."""
        assert self.metadata is not None
        missing = self.metadata.state_dict_metadata.keys() - self.state_dict.keys()
        if self.flatten_state_dict and missing and not missing <= getattr(self, "_skipped", set()):
            plan = dcp_flatten_as_saved(super().create_local_plan)
        else:
            plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        if self._read_here:
            plan.items[:] = [item for item in plan.items if item.dest_index.fqn not in self._read_here]
        return plan

    def _reads_weights_only(self, key: str) -> bool:
        """Whether `load_bytes` reads bytes item ``key`` with `weights_only_item` (which checks its CRCs)."""
        return reads_weights_only(key, getattr(self, "_optimizer_keys", ()), everything=self._all_weights_only)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Read every non-tensor optimizer item with ``torch.load(weights_only=True)``; others as DCP does.

        ``DefaultLoadPlanner.load_bytes`` unpickles every bytes item with ``weights_only=False``,
        so a tampered optimizer item could run code before the library ever sees it. Packed group
        and scalar tables must be plain ``bytes``; flat ``param_groups`` values and non-tensor state values
        may be anything the restricted unpickler accepts. Refusals are
        `CheckpointFormatError` naming the key.
        """
        key = read_item.dest_index.fqn
        super().load_bytes(
            read_item,
            optimizer_bytes(key, value, getattr(self, "_optimizer_keys", ()), everything=self._all_weights_only),
        )


def reads_weights_only(key: str, optimizer_keys: Collection[str], *, everything: bool = False) -> bool:
    """Whether a load planner of the library reads bytes item ``key`` weights-only: every table, the
    items of the optimizer dicts it rebuilt (``optimizer_keys``), or ``everything``."""
    return everything or is_table_key(key) or key in optimizer_keys


def optimizer_bytes(
    key: str, value: io.BytesIO, optimizer_keys: Collection[str], *, everything: bool = False
) -> io.BytesIO:
    """Bytes item ``key`` as a load planner of the library hands it to DCP's ``load_bytes``: unpickled
    with ``weights_only=True`` and saved again (`weights_only_item`, which checks its CRCs; tables and
    buffers must be ``bytes``) when `reads_weights_only`, else ``value`` as it is."""
    if not reads_weights_only(key, optimizer_keys, everything=everything):
        return value
    return weights_only_item(key, value, table=is_table_key(key) or BUFFERS_PREFIX in key)


def _find_targets(node: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], SparseStateDict]]:
    """Every `SparseStateDict` below ``node`` with its DCP object path."""
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


class _TargetBuilder:
    """Rebuilds one `SparseStateDict` load target from the checkpoint's entries under its path.

    Each entry (its path below the target, its metadata) gets a load buffer, or is skipped, by the
    rule of its kind (`_kind`): DSD's nested ``state`` and ``param_groups``, the buffers
    layout's items, packed tables (every rank's), foreign-loader guards, flat group settings and
    per-item state (this rank's parameters only), anything else."""

    def __init__(
        self, target: SparseStateDict, metadata: Metadata, storage_reader: Any, *, read_whole: bool = False
    ) -> None:
        self.target = target
        self.metadata = metadata
        self.storage_reader = storage_reader
        self.read_whole = read_whole
        """Read whole per-item state of plain CPU parameters here (see `_read_whole`); the planner
        that asks for it leaves these items (:attr:`read_here`) out of DCP's plan."""
        self.read_here: dict[str, str] = {}
        self.under_path: set[str] = set()
        """Every checkpoint key under the target's path (planned or not)."""
        self.fmap: Any = None
        self.unresolved: list[str] = []
        self.flat_fqns: set[str] = set()
        self.read_now: set[str] = set()
        self.positions: list[Any] | None = None

    def rebuild(self, path: tuple[str | int, ...], paths: Mapping[str, tuple[str | int, ...]]) -> list[str]:
        """Replace the target's content by the checkpoint's entries under ``path``; returns their
        flattened DCP keys (the items this optimizer dict reads).

        Buffers layout: this rank's own layout tables are read (for a leaf without one of its own,
        its layout index, or all of its layouts when it has none); the other layouts the load needs
        and the buffers are left to ``target.reader`` (which reads them one at a time after the
        layouts, through the load's storage reader). Without a storage reader, this rank's own
        buffers (all of a leaf's when it has no layout of its own) are read with the rest."""
        depth = len(path)
        entries: list[tuple[tuple[str | int, ...], Any, str]] = []
        for key, md in self.metadata.state_dict_metadata.items():
            p = paths[key]
            if len(p) > depth and p[:depth] == path and isinstance(p[depth], str):
                self.under_path.add(key)
                if p[depth] not in _NOT_READ:
                    entries.append((p[depth:], md, key))
        if not entries:
            where = ".".join(map(str, path))
            raise CheckpointMismatchError(
                f"the checkpoint has no optimizer entries under {where!r} (saved under another key, or no optimizer)"
            )
        self.fmap = self.target.fmap = build_fqn_map(self.target.owner.model)
        self.flat_fqns = {s[0] for rel, _md, _key in entries if (s := split_group_key(str(rel[0]))) is not None}
        buffered = {
            str(rel[0]): key for rel, _md, key in entries if len(rel) == 1 and str(rel[0]).startswith(BUFFERS_PREFIX)
        }
        self.read_now = items_a_load_reads(buffered, self.storage_reader is not None)
        self.target.reader = (
            None if self.storage_reader is None or not buffered else BucketReader(buffered, self._item_reader())
        )
        whole: dict[str, str] = {}  # DCP key -> key in the target: items read here, not by DCP
        new: dict[str, Any] = {}
        keys: list[str] = []
        for rel, md, key in entries:
            inner = str(rel[0])
            kind = self._kind(rel, inner, md, buffered)
            value = self._RULES[kind](self, rel, inner, md)
            if value is _SKIP:
                continue
            if kind != "guard":  # tensors this rank reads: wholly covered by their chunks
                check_covered(key, md)
            if self.read_whole and kind == "state" and len(rel) == 1 and self._read_whole(value, md, key):
                whole[key] = inner
            set_path(new, rel, value)
            keys.append(key)
        if whole:  # straight from their files into the tensors the optimizer will keep
            read_items(
                self.storage_reader,
                self.metadata,
                list(whole),
                lambda key, t: new.__setitem__(whole[key], t),
                require_storage=True,
            )
            self.read_here.update(whole)
        self.target.lost = _drop_holes(new, {rel for rel, _md, _key in entries})
        self.target.present = {str(rel[0]) for rel, _md, _key in entries}
        self.target.clear()
        self.target.update(new)
        self.target.planned = True
        self.target.unresolved = self.unresolved
        return keys

    @staticmethod
    def _kind(rel: tuple[str | int, ...], inner: str, md: Any, buffered: Mapping[str, str]) -> str:
        if (
            len(rel) > 2 and inner in NESTED_KEYS
        ):  # DSD's nested layout: ('state', fqn, key...) / ('param_groups', i, key)
            return "nested_state" if inner == NESTED_KEYS[0] else "plain"
        if inner in buffered:
            return "buffers"
        if inner.startswith((PACKED_PREFIX, SCALARS_PREFIX)):
            return "plain"  # every rank's tables
        if is_foreign_guard(inner, md):
            return "guard"
        if inner.startswith(GROUPS_PREFIX):
            return "flat_group"
        if inner.startswith(STATE_PREFIX):
            return "state"
        return "plain"

    def _read_whole(self, value: Any, md: Any, key: str) -> bool:
        """Whether the state tensor planned as ``value`` (what DCP would read into) is better read
        by the load itself, whole, through the storage reader: a plain CPU tensor (not a DTensor:
        a shard is DCP's to plan) filled by the item's one chunk, which a ``FileSystemReader``
        loads straight into the tensor the optimizer then keeps (DCP would load it into one tensor
        and copy it into this one)."""
        return (
            self.storage_reader is not None
            and type(value) is torch.Tensor
            and value.device.type == "cpu"
            and isinstance(md, TensorStorageMetadata)
            and len(md.chunks) == 1
            and tuple(md.chunks[0].sizes) == tuple(md.size) == tuple(value.shape)
            and isinstance(self.metadata.storage_data, Mapping)
            and file_item_location(
                self.storage_reader, self.metadata.storage_data.get(MetadataIndex(key, md.chunks[0].offsets))
            )
            is not None
        )

    def _plain(self, rel: tuple[str | int, ...], inner: str, md: Any) -> Any:
        return allocate_item(md, None, "")

    def _nested_state(self, rel: tuple[str | int, ...], inner: str, md: Any) -> Any:
        fqn = str(rel[1])
        if fqn not in self.fmap.canonical:
            if fqn.isdigit():  # a torch optimizer.state_dict()'s id: the load matches it by position
                return allocate_item(md, self._param_at(int(fqn)), str(rel[-1]))
            return _SKIP  # another rank's parameter (the load checks the dict's own groups)
        return allocate_item(md, self._param(fqn), str(rel[-1]))

    def _param_at(self, position: int) -> Any:
        """The target optimizers' parameter at ``position`` (their groups one after the other, as torch
        numbers them), to allocate a torch ``optimizer.state_dict()``'s state like (``None``: none)."""
        if self.positions is None:
            optimizer = getattr(self.target.owner, "optimizer", None)
            leaves = named_leaves(optimizer) if optimizer is not None else []
            self.positions = [p for _leaf, opt in leaves for g in opt.param_groups for p in g["params"]]
        return self.positions[position] if position < len(self.positions) else None

    def _buffers(self, rel: tuple[str | int, ...], inner: str, md: Any) -> Any:
        return allocate_item(md, None, "") if inner in self.read_now else _SKIP

    def _guard(self, rel: tuple[str | int, ...], inner: str, md: Any) -> Any:
        return _SKIP  # for loaders that do not know the format; nothing to read

    def _flat_group(self, rel: tuple[str | int, ...], inner: str, md: Any) -> Any:
        fqn = split_group_key(inner)[0]  # type: ignore[index] - not a table: a flat group key
        if fqn and fqn not in self.fmap.canonical:
            return _SKIP  # another rank's parameter
        return allocate_item(md, None, "")

    def _state(self, rel: tuple[str | int, ...], inner: str, md: Any) -> Any:
        # Which local parameter's buffer to allocate like: a guess by the target's FQNs (the
        # tables are not read yet); the load resolves every key by the checkpoint's own FQNs.
        fqn = owner_fqn(inner[len(STATE_PREFIX) :], self.fmap.canonical)
        if fqn is None:
            if owner_fqn(inner[len(STATE_PREFIX) :], self.flat_fqns) is None:
                self.unresolved.append(inner)
            return _SKIP  # another rank's parameter (or nobody's: unresolved, checked on load)
        key_leaf = last_part(inner) if len(rel) == 1 else str(rel[-1])
        return allocate_item(md, self._param(fqn), key_leaf)

    _RULES: ClassVar[dict[str, Callable[..., Any]]] = {
        "plain": _plain,
        "nested_state": _nested_state,
        "buffers": _buffers,
        "guard": _guard,
        "flat_group": _flat_group,
        "state": _state,
    }

    def _param(self, fqn: str) -> Any:
        return self.fmap.param_of[self.fmap.canonical[fqn]]

    def _item_reader(self) -> Any:
        """``read(dcp_keys, consume)`` through the load's own storage reader (rank-local, no collective)."""
        storage_reader, metadata = self.storage_reader, self.metadata

        def read(dcp_keys: list[str], consume: Any) -> None:
            read_items(storage_reader, metadata, dcp_keys, consume, is_table=lambda key: True, require_storage=True)

        return read


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
