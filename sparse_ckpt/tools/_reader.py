"""The shared checkpoint reader of the tools and of `sparse_ckpt.tools.export`.

Opens a DCP checkpoint without a model (`open_checkpoint`), reads chosen items in this
process a bounded number of bytes at a time (`read_entries`, `batches`) and decodes
one optimizer's entries into its groups and per-FQN state (`split_optimizer`, `Group`).

Reading never runs code from the checkpoint: ``.metadata`` is read by the restricted unpickler
(:mod:`sparse_ckpt._dcp.safe_reader`; no item is read from outside the checkpoint directory),
bytes items with ``torch.load(weights_only=True)`` (``convert`` copies the model's that way) or
not unpickled at all (``raw_keys``). Settings and tables are read; per-item state is seen through its DCP metadata.
The scalars of scalar tables (packed version 2) lead each parameter's state as on load, so a
version-1 and a version-2 checkpoint of one optimizer read the same. The table format is
specified in docs/formats.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from .. import _backend
from .._dcp.items import read_items
from .._dcp.metadata import METADATA_FILE, OptimizerEntries, read_metadata, set_path
from .._dcp.safe_reader import SafeFileSystemReader
from .._format.codec import encode_settings, encode_table
from .._format.keys import (
    BUFFERS_PREFIX,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    escape_part,
    is_buffer_item,
    is_flat_part,
    is_plain_part,
    is_state_item,
    packed_table_key,
    state_key,
)
from .._format.keys_record import is_record_key, read_key_records
from .._format.nested import NESTED_KEYS, nested_kind, nested_to_sparse
from .._layouts.bucketed import dtype_name
from .._layouts.bucketed_view import layout_view
from .._leaves import SINGLE_LEAF
from .._limits import ITEM_BYTES
from .._load.completeness import check_key_record, check_recorded_items, check_table_leaves
from .._load.decode import decode_group_tables
from .._load.decode_state import decode_scalar_tables, merge_scalars, merge_state
from .._load.positional import POSITION_MARK, named_by_position
from .._text import one_line
from ..errors import CheckpointFormatError, SparseCheckpointError, UsageError

__all__ = [
    "BATCH_BYTES",
    "FLAT_LEAF_IN_MIXED",
    "Group",
    "batches",
    "check_new_dir",
    "cut",
    "decode_tables",
    "dtype_name",
    "entry_values",
    "expand_scalar_tables",
    "item_bytes",
    "loader_needed",
    "named_groups",
    "open_checkpoint",
    "optimizer_format",
    "optimizer_values",
    "pack_flat_groups",
    "read_entries",
    "read_keys",
    "select_optimizers",
    "sparse_values",
    "split_optimizer",
]
FLAT_LEAF_IN_MIXED = "(flat entries)"
"""Leaf name shown for flat ``param_groups`` entries in a checkpoint that also has packed tables."""


BATCH_BYTES = ITEM_BYTES
"""Tensor bytes read at once when a command reads every item (bounded memory)."""
T = TypeVar("T")


def open_checkpoint(path: str | os.PathLike[str]) -> Metadata:
    """The checkpoint's DCP metadata, read by the restricted unpickler (nothing in it runs).

    `NotACheckpointError` when ``path`` is no directory or has no ``.metadata``;
    `CheckpointFormatError` when ``.metadata`` cannot be read (garbage, truncated, another
    format), names a global DCP's metadata is not made of, or has a storage record outside ``path``,
    with a one-line reason.
    """
    try:
        return read_metadata(path)
    except SparseCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - the file could not be opened or read
        raise CheckpointFormatError(
            f"{os.path.join(os.fspath(path), METADATA_FILE)!r} cannot be read ({one_line(exc)}): "
            "corrupt, or not a DCP checkpoint"
        ) from None


class _CachedReader(SafeFileSystemReader):
    """A `SafeFileSystemReader` that serves metadata already read (``.metadata`` is unpickled once)."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata) -> None:
        super().__init__(os.fspath(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The cached metadata, stamped with this reader's load id as DCP's reader does."""
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def item_bytes(md: Any) -> int:
    """Bytes a tensor item occupies in memory (0 for a bytes item)."""
    if isinstance(md, TensorStorageMetadata):
        return math.prod(md.size) * md.properties.dtype.itemsize
    return 0


def read_entries(
    path: str | os.PathLike[str],
    metadata: Metadata,
    keys: Iterable[str],
    *,
    raw_keys: Collection[str] = (),
    unpickle_keys: Collection[str] = (),
    consume: Callable[[str, Any], None] | None = None,
    require_storage: bool = False,
) -> dict[str, Any]:
    """Read the given flattened keys in this process: ``{key: tensor, object or raw bytes}``.

    The one item reader of the library (`sparse_ckpt._dcp.items.read_items`, which a
    ``state_layout="buffers"`` load reads its buckets with), handed this checkpoint's storage
    reader. Tensors come back as full CPU tensors (DCP's chunks of an item are assembled). Bytes
    items in ``raw_keys`` are not unpickled at all (their bytes), every other one with
    ``torch.load(weights_only=True)`` (packed tables must be ``bytes``; ``unpickle_keys``: items that
    are not an optimizer's, which ``convert`` copies); a tensor item whose chunks
    in ``.metadata`` do not cover it is a `CheckpointFormatError` (DCP would leave the rest
    unread). With ``consume``, each
    value goes to ``consume(key, value)`` as soon as it is read (one item alive at a time; an item
    without data is not handed over) and the result is empty; ``require_storage``: an item without
    its storage record is refused by name before anything is read (as a load refuses it). A
    failure is a `CheckpointFormatError` with one line of reason (a missing data file, a truncated
    item, ...); errors of sparse_ckpt's own checks pass through as they are.
    """
    keys = list(keys)
    if not keys:
        return {}
    reader = _CachedReader(path, metadata)
    try:
        reader.set_up_storage_reader(reader.read_metadata(), is_coordinator=True)
        values = read_items(
            reader,
            metadata,
            keys,
            consume,
            raw_keys=raw_keys,
            unpickle_keys=unpickle_keys,
            require_storage=require_storage,
            where=f" of {os.fspath(path)!r}",
        )
    except SparseCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the storage layer raises on a damaged checkpoint
        what = f"item {keys[0]!r}" if len(keys) == 1 else f"{len(keys)} items"
        raise CheckpointFormatError(f"cannot read {what} of {os.fspath(path)!r}: {one_line(exc)}") from None
    return {key: values[key] for key in keys if key in values}


def batches(metadata: Metadata, keys: Iterable[str], limit: int = BATCH_BYTES) -> Iterator[list[str]]:
    """``keys`` in order, cut into lists of at most ``limit`` tensor bytes (an item above it alone)."""
    return cut(keys, lambda key: item_bytes(metadata.state_dict_metadata[key]), limit)


def cut(things: Iterable[T], size: Callable[[T], int], limit: int = BATCH_BYTES) -> Iterator[list[T]]:
    """``things`` in order, cut into lists of at most ``limit`` bytes by ``size`` (a thing above it alone)."""
    batch: list[T] = []
    total = 0
    for thing in things:
        n = size(thing)
        if batch and total + n > limit:
            yield batch
            batch, total = [], 0
        batch.append(thing)
        total += n
    if batch:
        yield batch


class Group:
    """One decoded param group: settings (Python values), their encoded bytes, and its FQNs."""

    def __init__(self, settings: dict[str, Any], blob: bytes) -> None:
        self.settings = settings
        self.blob = blob
        self.fqns: list[str] = []
        self.settings_vary = False


def decode_tables(values: Mapping[str, Any], records: list[tuple[str, ...]] | None = None) -> dict[str, list[Group]]:
    """Packed tables among ``values`` -> ``leaf -> groups`` (tables of one leaf merged by group
    index); their item records are appended to ``records`` when given."""
    tables = {inner[len(PACKED_PREFIX) :]: v for inner, v in values.items() if inner.startswith(PACKED_PREFIX)}
    leaves: dict[str, list[Group]] = {}
    for table in decode_group_tables(tables):
        if records is not None and table.items is not None:
            records.append(table.items)
        merged = leaves.setdefault(table.leaf, [])
        for gi, (idx, fqns) in enumerate(table.groups):
            if gi == len(merged):
                merged.append(Group(table.settings[idx], table.blobs[idx]))
            elif merged[gi].blob != table.blobs[idx]:
                merged[gi].settings_vary = True
            merged[gi].fqns.extend(fqns)
    return leaves


def flat_groups(settings_by_fqn: Mapping[str, dict[str, Any]]) -> list[Group]:
    """Flat settings -> one group per distinct settings, in order of first appearance."""
    groups: dict[bytes, Group] = {}
    for fqn, raw in settings_by_fqn.items():
        blob = encode_settings(f"flat:{fqn}", 0, raw)
        group = groups.get(blob)
        if group is None:
            group = groups[blob] = Group(raw, blob)
        group.fqns.append(fqn)
    return list(groups.values())


def split_optimizer(values: Mapping[str, Any]) -> tuple[dict[str, list[Group]], list[Group], dict, list[str]]:
    """``(packed leaves, flat groups, state_by_fqn, unmatched keys)`` of one optimizer's entries,
    decoded by the load's own decoder (`sparse_ckpt._load.decode.decode_group_tables` and
    `sparse_ckpt._load.decode_state.merge_state`), with the tools' views of groups and buffers.

    Per-item state values and buffers may be DCP metadata objects instead of tensors (only their
    keys, dtypes and sizes matter here); tables and layout tables must be their bytes. Scalars
    (values: CPU tensors and Python scalars) lead each FQN's state as on load; buffered state
    appears as per-item metadata (`sparse_ckpt._layouts.bucketed_view.layout_view`). A state key that a
    scalar table records for a parameter but no entry holds, or an item the group tables' item
    records list but the checkpoint lacks, is a `CheckpointMismatchError` (an incomplete
    checkpoint).
    """
    records: list[tuple[str, ...]] = []
    leaves = decode_tables(values, records)
    known = {fqn: fqn for groups in leaves.values() for g in groups for fqn in g.fqns}
    settings_by_fqn, state_by_fqn, _tables, scalar_tables, unmatched = _backend.core.unflatten(values, known)
    buffer_keys = [k for k in unmatched if k.startswith(BUFFERS_PREFIX)]
    unmatched = [k for k in unmatched if not k.startswith(BUFFERS_PREFIX)]
    state_by_fqn = merge_state(
        state_by_fqn,
        scalar_tables,
        is_known=lambda f: f in known or f in settings_by_fqn,
        unmatched=unmatched,
        buffered=lambda _keys_of: layout_view(buffer_keys, values),
    )
    if records:
        check_recorded_items(records, values, None, None)
    if scalar_tables or buffer_keys:
        check_table_leaves(list(leaves), scalar_tables, buffer_keys)
    record_keys = [k for k in unmatched if is_record_key(k)]
    if record_keys:  # a flat or nested checkpoint's key record: every recorded key is there
        record = read_key_records({k: values[k] for k in record_keys})
        assert record is not None
        unmatched = [k for k in unmatched if not is_record_key(k)]
        named = {fqn for fqn, raw in settings_by_fqn.items() if "param_names" in raw}
        everything = set(settings_by_fqn).union(
            state_by_fqn, *(fqns for _i, _n, fqns in record.groups), *(fqns for _k, _l, fqns in record.state)
        )
        check_key_record(record, settings_by_fqn, named, state_by_fqn, {}, [], everything)
    return leaves, flat_groups(settings_by_fqn), state_by_fqn, unmatched


def named_groups(leaves: dict[str, list[Group]], flat: list[Group]) -> list[tuple[str, list[Group]]]:
    """Packed leaves plus the flat groups as one more leaf (``optim``, or ``(flat entries)`` when mixed)."""
    named = list(leaves.items())
    if flat:
        named.append((FLAT_LEAF_IN_MIXED if leaves else SINGLE_LEAF, flat))
    return named


def optimizer_format(opt: OptimizerEntries, leaves: Mapping[str, Any], flat: list[Group]) -> str:
    """How ``opt`` is stored: ``torch`` (a torch ``optimizer.state_dict()``, int ids, its parameters
    named ``#<id>``), ``nested`` (torch DSD), ``mixed``, ``packed`` or ``flat``."""
    if opt.nested and any(
        f.startswith(POSITION_MARK) for groups in leaves.values() for g in groups for f in g.fqns[:1]
    ):
        return "torch"
    return "nested" if opt.nested else "mixed" if leaves and flat else "packed" if leaves else "flat"


def select_optimizers(found: list[OptimizerEntries], key: str | None) -> list[OptimizerEntries]:
    """``found`` (``key=None``) or the one optimizer named ``key`` (`UsageError` if none)."""
    if key is None:
        return found
    chosen = [opt for opt in found if opt.name == key]
    if not chosen:
        names = ", ".join(repr(o.name) for o in found) or "none"
        raise UsageError(f"no optimizer entries under key {key!r} (found: {names})")
    return chosen


def _metadata_only(inner: str) -> bool:
    """An entry the tools see through its DCP metadata, not read: a per-item state value
    (`sparse_ckpt._format.keys.is_state_item`) or a buffer (`sparse_ckpt._format.keys.is_buffer_item`)."""
    return is_state_item(inner) or is_buffer_item(inner)


def read_keys(opt: OptimizerEntries) -> list[str]:
    """The flattened keys of ``opt``'s entries that the tools read: every entry but the per-item
    state values and buffers, whose DCP metadata is enough (`_metadata_only`)."""
    return [flat for inner, flat in opt.inner.items() if not _metadata_only(inner)]


def entry_values(opt: OptimizerEntries, metadata: Metadata, read: Mapping[str, Any]) -> dict[str, Any]:
    """``opt``'s entries by inner key: per-item state as its DCP metadata, every other entry as
    read (``read``: flattened key -> value; entries missing from it are left out); DSD's nested
    entries rewritten into their packed equivalent (`sparse_values`)."""
    values: dict[str, Any] = {}
    for inner, flat in opt.inner.items():
        if _metadata_only(inner):
            values[inner] = metadata.state_dict_metadata[flat]
        elif flat in read:
            values[inner] = read[flat]
    return sparse_values(opt, values)


def sparse_values(
    opt: OptimizerEntries, values: Mapping[str, Any], fqns: list[str] | None = None, *, placeholders: bool = True
) -> dict[str, Any]:
    """``values`` (``opt``'s entries by inner key) with torch DSD's nested entries rebuilt into
    their dict and rewritten into its packed equivalent (`sparse_ckpt._format.nested.nested_to_sparse`:
    one group table of leaf ``optim``, ``state.{fqn}.{key}`` entries); any other entry as it is.
    A torch ``optimizer.state_dict()`` (int ids) is named by position first
    (`sparse_ckpt._load.positional.named_by_position`: ``fqns``, its ``param_names``, or ``#<id>``
    with ``placeholders``)."""
    if not opt.nested:
        return dict(values)
    out: dict[str, Any] = {}
    root: dict[str, Any] = {NESTED_KEYS[0]: {}, NESTED_KEYS[1]: []}
    for inner, value in values.items():
        rel = opt.nested.get(inner)
        if rel is None:
            out[inner] = value
        else:
            set_path(root, rel, value)
    if nested_kind(root) == "ids":
        root = named_by_position(root, fqns, placeholders=placeholders)
    out.update(nested_to_sparse(root))
    return out


def optimizer_values(path: str | os.PathLike[str], metadata: Metadata, opt: OptimizerEntries) -> dict[str, Any]:
    """One optimizer's entries: settings and tables read, per-item ``state.*`` as their DCP metadata."""
    return entry_values(opt, metadata, read_entries(path, metadata, read_keys(opt)))


def expand_scalar_tables(values: Mapping[str, Any], *, flat: bool) -> dict[str, Any]:
    """The scalar tables among ``values`` as the per-item entries (``state.{fqn}.{key}``) of
    packed version 1, FQN by FQN, each FQN's in its saved order; every entry gets its own tensor.

    ``flat=True``: a key the flat layout cannot hold is a `CheckpointFormatError`;
    otherwise it is escaped (packed). A key that ``values`` already holds is a
    `CheckpointFormatError` (a scalar also saved per item).
    """
    tables = {k[len(SCALARS_PREFIX) :]: v for k, v in values.items() if k.startswith(SCALARS_PREFIX)}
    if not tables:
        return {}
    for k, v in tables.items():
        if not isinstance(v, bytes):
            raise CheckpointFormatError(f"scalar table '{SCALARS_PREFIX}{k}' is a {type(v).__name__}, expected bytes")
    out: dict[str, Any] = {}
    state = merge_scalars({}, decode_scalar_tables(tables))
    for fqn, scalars in state.items():
        for key, value in scalars.items():
            if is_flat_part(key) if flat else is_plain_part(key):
                part = key
            elif flat:
                raise CheckpointFormatError(
                    f"scalar state {key!r} of {fqn!r} cannot be written in the flat format (a key must be a str "
                    "without '.')"
                )
            else:
                part = escape_part(key)
            item = state_key(fqn, part)
            if item in values:
                raise CheckpointFormatError(
                    f"state key {key!r} of {fqn!r} is both in a scalar table and the per-item entry {item!r} "
                    "(corrupt or edited checkpoint)"
                )
            out[item] = value
    return out


def pack_flat_groups(flat: list[Group], leaf: str, leaves: Mapping[str, Any]) -> dict[str, bytes]:
    """Flat groups as one packed table of leaf ``leaf``: ``{table key: table}``."""
    if leaf in leaves:
        raise UsageError(f"leaf {leaf!r} already has packed tables; pick another --leaf")
    table = encode_table(leaf, [(g.settings, g.fqns) for g in flat])
    return {packed_table_key(leaf, table): table}


LOADER = (
    "sparse_ckpt: dcp.load(..., planner=sparse_ckpt.SparseLoadPlanner()) into a SparseOptimizerState or MultiOptimizer"
)


def loader_needed(summary: Mapping[str, Any]) -> str:
    """Which loader restores an optimizer that `inspect_checkpoint` summarised, and what others do."""
    if summary["format"] == "torch":
        return (
            f"{LOADER} whose optimizers are built with the saved groups (by position, as torch loads it), or "
            "optimizer.load_state_dict; `convert --to packed --fqns FILE` names its parameters"
        )
    if summary["format"] == "nested":
        dsd = "torch DSD's set_optimizer_state_dict (it wrote it)"
        if summary["without_state"]:
            dsd += f", which would invent state for its {summary['without_state']} parameter(s) without state"
        return f"{LOADER} (read by FQN, nothing invented; `convert --to packed` migrates it), or {dsd}"
    if summary["format"] == "flat":
        if summary["without_state"]:
            return (
                f"{LOADER}; torch DSD's set_optimizer_state_dict(flatten_optimizer_state_dict=True) would invent state "
                f"for its {summary['without_state']} parameter(s) without state"
            )
        return f"{LOADER}, or torch DSD's set_optimizer_state_dict(flatten_optimizer_state_dict=True)"
    if summary["foreign_guards"]:
        return f"{LOADER}; other loaders are refused while planning (foreign-loader guards)"
    return (
        f"{LOADER}; it has no foreign-loader guard (written by sparse_state_dict() directly, or by sparse_ckpt before "
        "guards): a loader that does not know the format and uses allow_partial_load=True would silently miss its "
        "settings and scalar state"
    )


def check_new_dir(path: str | os.PathLike[str]) -> None:
    """`UsageError` unless ``path`` does not exist or is an empty directory."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UsageError(f"destination {os.fspath(path)!r} exists and is not an empty directory")
