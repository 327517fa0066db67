"""Read, inspect, verify, diff and convert the optimizer part of DCP checkpoints without a model.

The library side of ``python -m sparse_ckpt`` (:mod:`sparse_ckpt.cli` only parses arguments and
prints). Every function takes a checkpoint directory and returns plain data (the ``--json``
schemas):

* :func:`inspect_checkpoint` -- per optimizer and leaf: groups, settings, parameters with and
  without state, state keys, bytes, and MoE expert counts (FQNs ``...experts.N...``);
* :func:`verify_checkpoint` -- read every item (storage records, file bounds, the zip structure
  and CRC-32 of every item, then every item through DCP) and list what is missing or corrupt;
* :func:`diff_checkpoints` -- per leaf: changed group settings, parameters that gained or lost
  state or moved, state shape/dtype changes;
* :func:`convert_checkpoint` -- rewrite the optimizer part between packed and flat format.

Also public, as the building blocks of those functions and of :mod:`sparse_ckpt.export`:
:func:`open_checkpoint` (the metadata, or a one-line error), :func:`select_optimizers`,
:func:`read_entries` and :func:`batches` (read items a bounded number of bytes at a time),
:func:`split_optimizer` (one optimizer's entries -> packed :class:`Group` lists per leaf, flat
groups, state by FQN), :func:`decode_tables` (packed tables -> :class:`Group` lists per leaf),
:func:`named_groups`, :func:`expand_scalar_tables`,
:func:`pack_flat_groups`, :func:`convert_optimizer`, :func:`inspect_details`,
:func:`storage_problems`, :func:`expert_summary`, :func:`check_new_dir`, :func:`dtype_name`,
:func:`jsonable`, :data:`BATCH_BYTES` and :data:`FLAT_LEAF_IN_MIXED`; :class:`UsageError` is a
bad argument or destination.

Settings and tables (group and scalar tables) are read; per-item state is seen through its DCP
metadata only. The scalars of scalar tables (packed version 2) lead each parameter's state as on
load, so every report is the same for a version-1 and a version-2 checkpoint of one optimizer
(except item counts and bytes). ``convert --to flat`` turns scalar tables into per-item state
(DSD's layout); ``--to packed`` keeps state entries as they are (a flat source's per-item state
stays per item, which every reader reads).

Reading never runs code from the checkpoint beyond DCP's own ``.metadata`` unpickling:
optimizer items are read with ``torch.load(weights_only=True)``, other non-tensor items are
either not unpickled at all (``verify``) or read as DCP reads them (``convert``, which must copy
them).
"""

from __future__ import annotations

import io
import math
import os
import re
import warnings
import zipfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from . import _backend
from ._tensor_parts import tensor_to_parts
from .buffers import full_state, layout_view
from .checkpoint_io import (
    METADATA_FILE,
    NotACheckpointError,
    OptimizerEntries,
    find_optimizers,
    metadata_path,
    read_metadata,
    set_path,
    unrecognised_optimizer_items,
)
from .dcp import SparseLoadPlanner, weights_only_item
from .decode import check_complete, decode_group_tables, decode_scalar_tables, merge_scalars
from .errors import CheckpointFormatError, CheckpointMismatchError, SparseCheckpointError
from .keys import (
    BUFFERS_PREFIX,
    GROUPS_PREFIX,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    escape_part,
    foreign_guard_keys,
    foreign_guard_value,
    has_escaped_part,
    is_buffer_item,
    is_flat_part,
    is_plain_part,
    is_state_item,
    is_table_key,
    packed_table_key,
    state_key,
)
from .leaves import SINGLE_LEAF
from .nested import NESTED_KEYS, nested_to_sparse

__all__ = [
    "BATCH_BYTES",
    "FLAT_LEAF_IN_MIXED",
    "Group",
    "UsageError",
    "batches",
    "check_new_dir",
    "convert_checkpoint",
    "convert_optimizer",
    "decode_tables",
    "diff_checkpoints",
    "dtype_name",
    "expand_scalar_tables",
    "expert_summary",
    "inspect_checkpoint",
    "inspect_details",
    "jsonable",
    "loader_needed",
    "named_groups",
    "open_checkpoint",
    "pack_flat_groups",
    "read_entries",
    "select_optimizers",
    "sparse_values",
    "split_optimizer",
    "storage_problems",
    "verify_checkpoint",
]

FLAT_LEAF_IN_MIXED = "(flat entries)"
"""Leaf name shown for flat ``param_groups`` entries in a checkpoint that also has packed tables."""
BATCH_BYTES = 256 << 20
"""Tensor bytes read per ``dcp.load`` call when a command reads every item (bounded memory)."""
_ZIP_MAGIC = b"PK\x03\x04"


class UsageError(Exception):
    """A bad command line or destination (exit status 2)."""


# --------------------------------------------------------------------------- reading


def open_checkpoint(path: str | os.PathLike[str]) -> Metadata:
    """The checkpoint's DCP metadata.

    :class:`NotACheckpointError` when ``path`` is no directory or has no ``.metadata``;
    :class:`CheckpointFormatError` when ``.metadata`` cannot be read (garbage, truncated, another
    format), with a one-line reason.
    """
    try:
        metadata = read_metadata(path)
    except NotACheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever DCP's unpickler raises on garbage
        raise CheckpointFormatError(
            f"{os.path.join(os.fspath(path), METADATA_FILE)!r} cannot be read ({_one_line(exc)}): "
            "corrupt, or not a DCP checkpoint"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, Mapping):
        raise CheckpointFormatError(
            f"{os.path.join(os.fspath(path), METADATA_FILE)!r} holds a {type(metadata).__name__}, not DCP metadata"
        )
    return metadata


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters)."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _unwrap(exc: BaseException) -> BaseException:
    """The first rank's original exception inside DCP's ``CheckpointException``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return inner
    return exc


class _CachedReader(FileSystemReader):
    """A ``FileSystemReader`` that serves metadata already read (``.metadata`` is unpickled once)."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata) -> None:
        super().__init__(os.fspath(path))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The cached metadata, stamped with this reader's load id as DCP's reader does."""
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _ItemPlanner(SparseLoadPlanner):
    """Reads bytes items without running pickled code.

    Keys in ``raw_keys`` are not unpickled at all (their bytes land in :attr:`raw`); keys in
    ``unpickle_keys`` are read as DCP reads them (``convert`` must copy model extras); every other
    bytes item goes through ``torch.load(weights_only=True)`` (packed tables must be ``bytes``).
    """

    def __init__(self, raw_keys: Collection[str] = (), unpickle_keys: Collection[str] = ()) -> None:
        super().__init__()
        self.raw_keys = raw_keys
        self.unpickle_keys = unpickle_keys
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """See the class docstring."""
        key = read_item.dest_index.fqn
        if key in self.raw_keys:
            self.raw[key] = value.read()
        elif key in self.unpickle_keys:
            DefaultLoadPlanner.load_bytes(self, read_item, value)
        else:
            DefaultLoadPlanner.load_bytes(self, read_item, weights_only_item(key, value, table=is_table_key(key)))


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
) -> dict[str, Any]:
    """Read the given flattened keys in this process: ``{key: tensor, object or raw bytes}``.

    Tensors come back as full CPU tensors (DCP reassembles sharded items). Bytes items are read
    as :class:`_ItemPlanner` says (by default ``weights_only=True``). A failure is a
    :class:`CheckpointFormatError` with one line of reason (a missing data file, a truncated item,
    ...); errors of sparse_ckpt's own checks pass through as they are.
    """
    target: dict[str, Any] = {}
    for key in keys:
        md = metadata.state_dict_metadata[key]
        target[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    if not target:
        return target
    planner = _ItemPlanner(raw_keys, unpickle_keys)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
            dcp.load(target, storage_reader=_CachedReader(path, metadata), planner=planner, no_dist=True)
    except (CheckpointException, Exception) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        inner = _unwrap(exc)
        if isinstance(inner, SparseCheckpointError):
            raise inner from None
        what = f"item {next(iter(target))!r}" if len(target) == 1 else f"{len(target)} items"
        raise CheckpointFormatError(f"cannot read {what} of {os.fspath(path)!r}: {_one_line(inner)}") from None
    target.update(planner.raw)
    return target


def batches(metadata: Metadata, keys: Iterable[str], limit: int = BATCH_BYTES) -> Iterator[list[str]]:
    """``keys`` in order, cut into lists of at most ``limit`` tensor bytes (an item above it alone)."""
    batch: list[str] = []
    size = 0
    for key in keys:
        n = item_bytes(metadata.state_dict_metadata[key])
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch


# --------------------------------------------------------------------------- decoding


class Group:
    """One decoded param group: settings (Python values), their encoded bytes, and its FQNs."""

    def __init__(self, settings: dict[str, Any], blob: bytes) -> None:
        self.settings = settings
        self.blob = blob
        self.fqns: list[str] = []
        self.settings_vary = False


def decode_tables(values: Mapping[str, Any]) -> dict[str, list[Group]]:
    """Packed tables among ``values`` -> ``leaf -> groups`` (tables of one leaf merged by group index)."""
    tables = {inner[len(PACKED_PREFIX) :]: v for inner, v in values.items() if inner.startswith(PACKED_PREFIX)}
    leaves: dict[str, list[Group]] = {}
    for table in decode_group_tables(tables):
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
    core = _backend.core
    groups: dict[bytes, Group] = {}
    for fqn, raw in settings_by_fqn.items():
        blob = core.encode_settings(f"flat:{fqn}", 0, raw, torch.Tensor, tensor_to_parts)
        group = groups.get(blob)
        if group is None:
            group = groups[blob] = Group(raw, blob)
        group.fqns.append(fqn)
    return list(groups.values())


def split_optimizer(values: Mapping[str, Any]) -> tuple[dict[str, list[Group]], list[Group], dict, list[str]]:
    """``(packed leaves, flat groups, state_by_fqn, unmatched keys)`` of one optimizer's entries.

    Per-item state values and buffers may be DCP metadata objects instead of tensors (only their
    keys, dtypes and sizes matter here); tables and layout tables must be their bytes. Scalars
    (values: CPU tensors and Python scalars) lead each FQN's state as on load; buffered state
    appears as per-item metadata (:func:`~sparse_ckpt.buffers.layout_view`). A state key that a
    scalar table records for a parameter but no entry holds is a :class:`CheckpointMismatchError`
    (an incomplete checkpoint).
    """
    leaves = decode_tables(values)
    known = {fqn: fqn for groups in leaves.values() for g in groups for fqn in g.fqns}
    settings_by_fqn, state_by_fqn, _tables, scalar_tables, unmatched = _backend.core.unflatten(values, known)
    buffer_keys = [k for k in unmatched if k.startswith(BUFFERS_PREFIX)]
    unmatched = [k for k in unmatched if not k.startswith(BUFFERS_PREFIX)]
    for fqn, entries in layout_view(buffer_keys, values).items():
        state_by_fqn.setdefault(fqn, {}).update(entries)
    if scalar_tables:
        keys_of: dict[str, Any] = {}
        scalars_of = decode_scalar_tables(
            scalar_tables, is_known=lambda f: f in known or f in settings_by_fqn, unmatched=unmatched, keys_of=keys_of
        )
        state_by_fqn = merge_scalars(state_by_fqn, scalars_of)
        check_complete(state_by_fqn, keys_of, keys_of)
    return leaves, flat_groups(settings_by_fqn), state_by_fqn, unmatched


def named_groups(leaves: dict[str, list[Group]], flat: list[Group]) -> list[tuple[str, list[Group]]]:
    """Packed leaves plus the flat groups as one more leaf (``optim``, or ``(flat entries)`` when mixed)."""
    named = list(leaves.items())
    if flat:
        named.append((FLAT_LEAF_IN_MIXED if leaves else SINGLE_LEAF, flat))
    return named


def select_optimizers(found: list[OptimizerEntries], key: str | None) -> list[OptimizerEntries]:
    """``found`` (``key=None``) or the one optimizer named ``key`` (:class:`UsageError` if none)."""
    if key is None:
        return found
    chosen = [opt for opt in found if opt.name == key]
    if not chosen:
        names = ", ".join(repr(o.name) for o in found) or "none"
        raise UsageError(f"no optimizer entries under key {key!r} (found: {names})")
    return chosen


def read_keys(opt: OptimizerEntries) -> list[str]:
    """The flattened keys of ``opt``'s entries that the tools read: every entry but the per-item
    state values (:func:`~sparse_ckpt.keys.is_state_item`) and buffers
    (:func:`~sparse_ckpt.keys.is_buffer_item`), whose DCP metadata is enough."""
    return [flat for inner, flat in opt.inner.items() if not (is_state_item(inner) or is_buffer_item(inner))]


def entry_values(opt: OptimizerEntries, metadata: Metadata, read: Mapping[str, Any]) -> dict[str, Any]:
    """``opt``'s entries by inner key: per-item state as its DCP metadata, every other entry as
    read (``read``: flattened key -> value; entries missing from it are left out); DSD's nested
    entries rewritten into their packed equivalent (:func:`sparse_values`)."""
    values: dict[str, Any] = {}
    for inner, flat in opt.inner.items():
        if is_state_item(inner) or is_buffer_item(inner):
            values[inner] = metadata.state_dict_metadata[flat]
        elif flat in read:
            values[inner] = read[flat]
    return sparse_values(opt, values)


def sparse_values(opt: OptimizerEntries, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (``opt``'s entries by inner key) with torch DSD's nested entries rebuilt into
    their dict and rewritten into its packed equivalent (:func:`sparse_ckpt.nested.nested_to_sparse`:
    one group table of leaf ``optim``, ``state.{fqn}.{key}`` entries); any other entry as it is."""
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
    out.update(nested_to_sparse(root))
    return out


def optimizer_values(path: str | os.PathLike[str], metadata: Metadata, opt: OptimizerEntries) -> dict[str, Any]:
    """One optimizer's entries: settings and tables read, per-item ``state.*`` as their DCP metadata."""
    return entry_values(opt, metadata, read_entries(path, metadata, read_keys(opt)))


# --------------------------------------------------------------------------- storage checks


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``f`` from ``start`` (one DCP item)."""

    def __init__(self, f: io.BufferedReader, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _check_zip(f: io.BufferedReader, offset: int, length: int) -> tuple[str | None, int]:
    """``(error, members whose CRC-32 was not recorded)`` of one item written by ``torch.save``.

    Every member is read and its CRC-32 compared (bit flips that ``torch.load`` accepts silently
    are caught). An item that does not start like a zip archive is not checked here.
    """
    f.seek(offset)
    if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
        return None, 1
    unchecked = 0
    try:
        with zipfile.ZipFile(_Window(f, offset, length)) as zf:
            for info in zf.infolist():
                if info.CRC == 0 and info.file_size:  # written with CRC-32 disabled
                    unchecked += 1
                    continue
                with zf.open(info) as member:
                    while member.read(1 << 22):
                        pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError) as exc:
        return _one_line(exc), 0
    return None, unchecked


def storage_problems(
    path: str | os.PathLike[str], metadata: Metadata, *, check_data: bool = False
) -> tuple[list[dict[str, Any]], set[str], dict[str, Any]]:
    """Missing storage records, missing data files, items past the end of their file and (with
    ``check_data``) items whose zip structure or CRC-32 is broken.

    Returns ``(problems, bad keys, stats)``; a problem is ``{"key", "file", "problem"}`` (a
    missing file is one problem naming how many items it held). Without ``check_data`` only file
    sizes are read (cheap: what ``inspect`` does).
    """
    root = os.fspath(path)
    problems: list[dict[str, Any]] = []
    bad: set[str] = set()
    records: dict[str, list[Any]] = {}
    storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
    for index, info in storage.items():
        records.setdefault(getattr(index, "fqn", str(index)), []).append(info)
    sizes: dict[str, int | None] = {}
    missing_files: dict[str, list[str]] = {}
    to_check: dict[str, list[tuple[int, int, str]]] = {}
    total = 0
    for key, md in metadata.state_dict_metadata.items():
        infos = records.get(key, [])
        expected = len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1
        if len(infos) < expected:
            problems.append({"key": key, "file": None, "problem": f"{expected - len(infos)} of {expected} storage record(s) missing from .metadata"})
            bad.add(key)
            continue
        for info in infos:
            rel = getattr(info, "relative_path", None)
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if not isinstance(rel, str) or not isinstance(offset, int) or not isinstance(length, int):
                problems.append({"key": key, "file": None, "problem": f"storage record is not a file range ({info!r})"})
                bad.add(key)
                break
            total += length
            if rel not in sizes:
                full = os.path.join(root, rel)
                sizes[rel] = os.path.getsize(full) if os.path.isfile(full) else None
            size = sizes[rel]
            if size is None:
                missing_files.setdefault(rel, []).append(key)
                bad.add(key)
                break
            if offset < 0 or length < 0 or offset + length > size:
                problems.append({"key": key, "file": rel, "problem": f"truncated: needs bytes {offset}..{offset + length} of {rel!r}, which has {size}"})
                bad.add(key)
                break
            if check_data and not getattr(info, "transform_descriptors", None):
                to_check.setdefault(rel, []).append((offset, length, key))
    for rel, keys in missing_files.items():
        problems.append({"key": keys[0], "file": rel, "problem": f"data file {rel!r} is missing ({len(keys)} item(s), e.g. {keys[0]!r})"})
    unchecked = 0
    for rel, items in to_check.items():
        with open(os.path.join(root, rel), "rb") as f:
            for offset, length, key in sorted(items):
                if key in bad:
                    continue
                error, n = _check_zip(f, offset, length)
                unchecked += n
                if error is not None:
                    problems.append({"key": key, "file": rel, "problem": f"corrupt item (bytes {offset}..{offset + length} of {rel!r}): {error}"})
                    bad.add(key)
    stats = {"items": len(metadata.state_dict_metadata), "files": len(sizes), "bytes": total, "crc_unchecked": unchecked}
    return problems, bad, stats


# --------------------------------------------------------------------------- inspect


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (how reports name dtypes)."""
    return str(dtype).removeprefix("torch.")


def walk_state(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, leaf value)`` of one parameter's (nested) state."""
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        if isinstance(value, dict):
            out.extend(walk_state(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def jsonable(value: Any) -> Any:
    """A JSON-friendly rendering of a settings value (for reports, not for round trips)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {
            "tensor": dtype_name(value.dtype),
            "shape": list(value.shape),
            "values": jsonable(value.detach().cpu().reshape(-1).tolist()),
        }
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


_EXPERT = re.compile(r"^(?P<layer>(?:.*?\.)?experts)\.(?P<idx>\d+)(?:\.|$)")
_NUMBERS = re.compile(r"(\d+)")


def _natural(text: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in _NUMBERS.split(text)]


def expert_summary(fqns: Iterable[str], has_state: Callable[[str], bool]) -> list[dict[str, Any]]:
    """Per MoE layer (FQNs ``{layer}.experts.{N}.{...}``): how many experts have state.

    An expert *has state* when all its parameters do, is *partial* when some do, and is
    *without state* when none does. Layers are in natural order (``layers.2`` before ``layers.10``).
    """
    layers: dict[str, dict[int, list[bool]]] = {}
    for fqn in fqns:
        m = _EXPERT.match(fqn)
        if m is not None:
            layers.setdefault(m["layer"], {}).setdefault(int(m["idx"]), []).append(has_state(fqn))
    out = []
    for layer in sorted(layers, key=_natural):
        experts = layers[layer]
        ids = sorted(experts)
        without = [e for e in ids if not any(experts[e])]
        partial = [e for e in ids if any(experts[e]) and not all(experts[e])]
        out.append(
            {
                "layer": layer,
                "experts": len(ids),
                "with_state": len(ids) - len(without) - len(partial),
                "partial": len(partial),
                "without_state": len(without),
                "without_state_ids": without,
                "partial_ids": partial,
            }
        )
    return out


def _summarize_leaf(name: str, groups: list[Group], state_by_fqn: Mapping[str, Any], params: bool) -> dict[str, Any]:
    out_groups = []
    keys: dict[str, dict[str, Any]] = {}
    total_bytes = 0
    with_state = without = 0
    stateless: list[str] = []
    for gi, group in enumerate(groups):
        n_with = 0
        for fqn in group.fqns:
            state = state_by_fqn.get(fqn)
            if not state:
                stateless.append(fqn)
                continue
            n_with += 1
            for key, md in walk_state(state):
                info = keys.setdefault(key, {"dtypes": [], "count": 0, "bytes": 0})
                info["count"] += 1
                dtype = _state_sig(md)[0]
                nbytes = item_bytes(md) if isinstance(md, TensorStorageMetadata) else _tensor_bytes(md)
                if dtype not in info["dtypes"]:
                    info["dtypes"].append(dtype)
                info["bytes"] += nbytes
                total_bytes += nbytes
        entry = {
            "index": gi,
            "settings": jsonable(group.settings),
            "params": len(group.fqns),
            "with_state": n_with,
            "without_state": len(group.fqns) - n_with,
        }
        if group.settings_vary:
            entry["settings_vary_across_tables"] = True
        out_groups.append(entry)
        with_state += n_with
        without += len(group.fqns) - n_with
    summary = {
        "name": name,
        "params": with_state + without,
        "with_state": with_state,
        "without_state": without,
        "groups": out_groups,
        "state_keys": keys,
        "state_bytes": total_bytes,
        "experts": expert_summary((f for g in groups for f in g.fqns), lambda f: bool(state_by_fqn.get(f))),
    }
    if params:
        summary["params_without_state"] = stateless
    return summary


def _disk_bytes(metadata: Metadata) -> dict[str, int]:
    out: dict[str, int] = {}
    storage = metadata.storage_data
    if isinstance(storage, Mapping):
        for index, info in storage.items():
            length = getattr(info, "length", None)
            if isinstance(length, int):
                out[index.fqn] = out.get(index.fqn, 0) + length
    return out


def inspect_checkpoint(path: str | os.PathLike[str], key: str | None = None, *, params: bool = False) -> dict[str, Any]:
    """Describe every optimizer in the checkpoint at ``path`` (the ``inspect --json`` schema).

    ``params=True`` adds each leaf's ``params_without_state`` list. ``storage_problems`` lists
    items whose data file is missing or too short (file sizes only; ``verify`` reads the data).
    """
    return inspect_details(path, key, params=params)[0]


def inspect_details(
    path: str | os.PathLike[str], key: str | None = None, *, params: bool = False
) -> tuple[dict[str, Any], dict[tuple[str, str, int], dict[str, Any]]]:
    """:func:`inspect_checkpoint`'s report, and each group's settings as Python values keyed by
    ``(optimizer key, leaf, group index)`` (for text output)."""
    raw: dict[tuple[str, str, int], dict[str, Any]] = {}
    metadata = open_checkpoint(path)
    disk = _disk_bytes(metadata)
    problems, _bad, _stats = storage_problems(path, metadata)
    optimizers = []
    for opt in select_optimizers(find_optimizers(metadata), key):
        values = optimizer_values(path, metadata, opt)
        leaves, flat, state_by_fqn, unmatched = split_optimizer(values)
        fmt = "nested" if opt.nested else "mixed" if leaves and flat else "packed" if leaves else "flat"
        named = named_groups(leaves, flat)
        summaries = [_summarize_leaf(name, groups, state_by_fqn, params) for name, groups in named]
        for name, groups in named:
            for gi, g in enumerate(groups):
                raw[(opt.name, name, gi)] = g.settings
        grouped = {fqn for _name, groups in named for g in groups for fqn in g.fqns}
        orphans = sorted(fqn for fqn in state_by_fqn if fqn not in grouped)
        tables = [] if opt.nested else [v for k, v in values.items() if k.startswith((PACKED_PREFIX, SCALARS_PREFIX))]
        optimizers.append(
            {
                "key": opt.name,
                "format": fmt,
                "leaves": summaries,
                "params": sum(s["params"] for s in summaries),
                "with_state": sum(s["with_state"] for s in summaries),
                "without_state": sum(s["without_state"] for s in summaries),
                "state_bytes": sum(s["state_bytes"] for s in summaries),
                "table_bytes": sum(len(t) for t in tables if isinstance(t, bytes)),
                "scalar_tables": sum(1 for k in values if k.startswith(SCALARS_PREFIX)),
                "disk_bytes": sum(disk.get(flat_key, 0) for flat_key in opt.inner.values()),
                "items": len(opt.inner),
                "state_without_group": orphans,
                "unmatched_keys": unmatched,
                "foreign_guards": len(opt.guards),
            }
        )
        optimizers[-1]["loader"] = loader_needed(optimizers[-1])
    report = {
        "checkpoint": os.fspath(path),
        "optimizers": optimizers,
        "unrecognised_optimizer_items": unrecognised_optimizer_items(metadata, find_optimizers(metadata)),
        "storage_problems": problems,
    }
    return report, raw


LOADER = "sparse_ckpt: dcp.load(..., planner=sparse_ckpt.SparseLoadPlanner()) into a SparseOptimizerState or MultiOptimizer"


def loader_needed(summary: Mapping[str, Any]) -> str:
    """Which loader restores an optimizer that :func:`inspect_checkpoint` summarised, and what others do."""
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


# --------------------------------------------------------------------------- verify


def verify_checkpoint(path: str | os.PathLike[str], *, batch_bytes: int = BATCH_BYTES) -> dict[str, Any]:
    """Read every item of the checkpoint and report what is missing or corrupt (``verify --json``).

    1. Storage: every item has its storage records, its data file exists and holds its byte
       range, and (items written by ``torch.save``, DCP's default) every zip member's CRC-32 matches.
    2. Every intact item is read through ``dcp.load`` (tensors reassembled and size-checked, in
       batches of ``batch_bytes``); bytes items of optimizers with ``weights_only=True``, other
       bytes items not unpickled at all.
    3. Every optimizer's group tables decode (digest, codec) and every state key belongs to a
       parameter of its tables or flat entries.

    ``ok`` is true when ``problems`` is empty. ``crc_unchecked`` counts zip members saved
    without a CRC-32 and items not in zip form (read in step 2 only).
    """
    metadata = open_checkpoint(path)
    problems, bad, stats = storage_problems(path, metadata, check_data=True)
    optimizers = find_optimizers(metadata)
    opt_keys = {flat for opt in optimizers for flat in opt.inner.values()}
    raw_keys = {
        key for key, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata) and key not in opt_keys
    }
    group_keys = {flat for opt in optimizers for flat in read_keys(opt)}
    kept: dict[str, Any] = {}
    read = 0
    intact = [key for key in metadata.state_dict_metadata if key not in bad]
    for batch in batches(metadata, intact, batch_bytes):
        try:
            got = read_entries(path, metadata, batch, raw_keys=raw_keys)
        except SparseCheckpointError:
            got = {}
            for key in batch:  # find the culprits
                try:
                    got.update(read_entries(path, metadata, [key], raw_keys=raw_keys))
                except SparseCheckpointError as exc:
                    problems.append({"key": key, "file": None, "problem": f"unreadable: {exc}"})
                    bad.add(key)
        read += len(got)
        kept.update({k: v for k, v in got.items() if k in group_keys})
        del got
    loaders: dict[str, str] = {}
    for opt in optimizers:
        if any(flat in bad for flat in opt.inner.values()):
            continue  # already reported; decoding would only repeat it
        values = entry_values(opt, metadata, kept)
        name = opt.name or "(top level)"
        try:
            leaves, flat, state_by_fqn, unmatched = split_optimizer(values)
        except SparseCheckpointError as exc:
            problems.append({"key": name, "file": None, "problem": f"optimizer {name!r}: {exc}"})
            continue
        named = named_groups(leaves, flat)
        grouped = {fqn for _leaf, groups in named for g in groups for fqn in g.fqns}
        orphans = [fqn for fqn in state_by_fqn if fqn not in grouped]
        without = len({f for f in grouped if not state_by_fqn.get(f)})
        fmt = "nested" if opt.nested else "mixed" if leaves and flat else "packed" if leaves else "flat"
        loaders[opt.name] = loader_needed({"format": fmt, "without_state": without, "foreign_guards": len(opt.guards)})
        if orphans:
            problems.append({"key": name, "file": None, "problem": f"optimizer {name!r}: state of {len(orphans)} parameter(s) in no group (e.g. {orphans[0]!r})"})
        if unmatched:
            problems.append({"key": name, "file": None, "problem": f"optimizer {name!r}: {len(unmatched)} key(s) match no parameter (e.g. {unmatched[0]!r})"})
    return {
        "checkpoint": os.fspath(path),
        "ok": not problems,
        **stats,
        "read": read,
        "optimizers": [opt.name for opt in optimizers],
        "loaders": loaders,
        "problems": problems,
    }


# --------------------------------------------------------------------------- diff


class _View:
    """One optimizer of one checkpoint as the diff sees it: leaves, groups, state metadata."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata, opt: OptimizerEntries) -> None:
        leaves, flat, state_by_fqn, _unmatched = split_optimizer(optimizer_values(path, metadata, opt))
        self.name = opt.name
        self.leaves = dict(named_groups(leaves, flat))
        self.where: dict[str, tuple[str, int]] = {}
        for leaf, groups in self.leaves.items():
            for gi, g in enumerate(groups):
                for fqn in g.fqns:
                    self.where.setdefault(fqn, (leaf, gi))
        self.state: dict[str, dict[str, tuple[str, tuple[int, ...] | None]]] = {}
        for fqn, state in state_by_fqn.items():
            if state:
                self.state[fqn] = {k: _state_sig(md) for k, md in walk_state(state)}

    def homed(self, leaf: str) -> list[str]:
        """FQNs of ``leaf``'s groups whose home (first group listing them) is ``leaf``, in group order."""
        return [f for g in self.leaves[leaf] for f in g.fqns if self.where.get(f, (None,))[0] == leaf]

    def state_not_in(self, other: _View, fqns: Iterable[str]) -> list[str]:
        """Those of ``fqns`` with state here that ``other`` lists without state."""
        return [f for f in fqns if f in self.state and f in other.where and f not in other.state]


def _state_sig(md: Any) -> tuple[str, tuple[int, ...] | None]:
    """``(dtype name, shape)`` of a state value: a per-item entry's DCP metadata, or a value of a
    scalar table (a tensor, or a Python scalar: ``"object"`` like a per-item non-tensor)."""
    if isinstance(md, TensorStorageMetadata):
        return dtype_name(md.properties.dtype), tuple(md.size)
    if isinstance(md, torch.Tensor):
        return dtype_name(md.dtype), tuple(md.shape)
    return "object", None


def _tensor_bytes(value: Any) -> int:
    """Bytes of a scalar table's tensor value (0 for any other value)."""
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def same_value(a: Any, b: Any) -> bool:
    """Exact equality of settings values: same types, tensors by dtype/shape/values, NaN == NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                         and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))))
        )
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def _add_non_empty(out: dict[str, Any], **entries: Any) -> dict[str, Any]:
    """``out`` with every non-empty one of ``entries`` added (in order); returns ``out``."""
    for key, value in entries.items():
        if value:
            out[key] = value
    return out


def _settings_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    return _add_non_empty(
        {},
        changed={k: (a[k], b[k]) for k in a if k in b and not same_value(a[k], b[k])},
        removed={k: a[k] for k in a if k not in b},
        added={k: b[k] for k in b if k not in a},
    )


def _diff_pair(a: _View, b: _View) -> dict[str, Any]:
    leaves: list[dict[str, Any]] = []
    names = list(a.leaves) + [n for n in b.leaves if n not in a.leaves]
    for name in names:
        ga, gb = a.leaves.get(name), b.leaves.get(name)
        if ga is None or gb is None:
            groups = ga if ga is not None else gb
            assert groups is not None
            leaves.append({"name": name, "only_in": "a" if gb is None else "b", "groups": len(groups),
                           "params": sum(len(g.fqns) for g in groups)})
            continue
        group_diffs = []
        for gi in range(max(len(ga), len(gb))):
            if gi >= len(ga) or gi >= len(gb):
                only = "a" if gi < len(ga) else "b"
                g = (ga if only == "a" else gb)[gi]
                group_diffs.append({"index": gi, "only_in": only, "params": len(g.fqns), "settings": g.settings})
                continue
            entry: dict[str, Any] = {"index": gi}
            settings = _settings_diff(ga[gi].settings, gb[gi].settings)
            if settings:
                entry["settings"] = settings
            in_a, in_b = set(ga[gi].fqns), set(gb[gi].fqns)
            _add_non_empty(
                entry,
                params_added=[f for f in gb[gi].fqns if f not in in_a],
                params_removed=[f for f in ga[gi].fqns if f not in in_b],
            )
            if len(entry) > 1:
                group_diffs.append(entry)
        fqns_a, fqns_b = a.homed(name), b.homed(name)
        gained = b.state_not_in(a, fqns_b)
        lost = a.state_not_in(b, fqns_a)
        changes = []
        for fqn in fqns_b:
            sa, sb = a.state.get(fqn), b.state.get(fqn)
            if not sa or not sb:
                continue
            for k in list(sa) + [k for k in sb if k not in sa]:
                if sa.get(k) != sb.get(k):
                    changes.append({"fqn": fqn, "key": k, "a": _sig_json(sa.get(k)), "b": _sig_json(sb.get(k))})
        entry = _add_non_empty(
            {"name": name}, groups=group_diffs, gained_state=gained, lost_state=lost, state_changes=changes
        )
        if len(entry) > 1:
            leaves.append(entry)
    only_a = [f for f in a.where if f not in b.where]
    only_b = [f for f in b.where if f not in a.where]
    return _add_non_empty(
        {"key_a": a.name, "key_b": b.name, "leaves": leaves}, params_only_in_a=only_a, params_only_in_b=only_b
    )


def _sig_json(sig: tuple[str, tuple[int, ...] | None] | None) -> dict[str, Any] | None:
    if sig is None:
        return None
    return {"dtype": sig[0], "shape": None if sig[1] is None else list(sig[1])}


def count_differences(report: Mapping[str, Any]) -> int:
    """Number of differences in a :func:`diff_checkpoints` report (0: the optimizers agree)."""
    n = len(report.get("optimizers_only_in_a", [])) + len(report.get("optimizers_only_in_b", []))
    for opt in report.get("optimizers", []):
        n += len(opt.get("params_only_in_a", [])) + len(opt.get("params_only_in_b", []))
        for leaf in opt["leaves"]:
            if "only_in" in leaf:
                n += 1
                continue
            for g in leaf.get("groups", []):
                n += 1 if "only_in" in g else sum(len(v) for v in g.get("settings", {}).values())
                n += len(g.get("params_added", [])) + len(g.get("params_removed", []))
            n += len(leaf.get("gained_state", [])) + len(leaf.get("lost_state", [])) + len(leaf.get("state_changes", []))
    return n


def diff_checkpoints(a: str | os.PathLike[str], b: str | os.PathLike[str], key: str | None = None) -> dict[str, Any]:
    """Compare the optimizer parts of checkpoints ``a`` and ``b`` (the ``diff --json`` schema).

    Optimizers are paired by key (``key``, or the only one of each, or equal names). Per leaf:
    groups (by index) whose settings changed or that gained/lost parameters, parameters that
    gained or lost state, and state keys whose dtype or shape changed (values are not compared:
    they change every step). Settings values in the report are Python values (see
    :func:`jsonable` for JSON).
    """
    md_a, md_b = open_checkpoint(a), open_checkpoint(b)
    opts_a = select_optimizers(find_optimizers(md_a), key)
    opts_b = select_optimizers(find_optimizers(md_b), key)
    if len(opts_a) == 1 and len(opts_b) == 1:
        pairs = [(opts_a[0], opts_b[0])]
    else:
        by_name = {o.name: o for o in opts_b}
        pairs = [(o, by_name[o.name]) for o in opts_a if o.name in by_name]
    paired_a = {p[0].name for p in pairs}
    paired_b = {p[1].name for p in pairs}
    report: dict[str, Any] = {
        "a": os.fspath(a),
        "b": os.fspath(b),
        "optimizers": [_diff_pair(_View(a, md_a, oa), _View(b, md_b, ob)) for oa, ob in pairs],
        "optimizers_only_in_a": [o.name for o in opts_a if o.name not in paired_a],
        "optimizers_only_in_b": [o.name for o in opts_b if o.name not in paired_b],
    }
    report["differences"] = count_differences(report)
    return report


# --------------------------------------------------------------------------- convert


def convert_optimizer(
    values: Mapping[str, Any], to: str, *, leaf: str = SINGLE_LEAF, drop_empty_groups: bool = False
) -> dict[str, Any]:
    """One optimizer's entries rewritten in format ``to``; state and unknown entries are kept,
    buffered state (``state_layout="buffers"``) as per-item state of full tensors (``values``
    must then hold the buffers themselves)."""
    core = _backend.core
    leaves, flat, _state, _unmatched = split_optimizer(values)
    buffer_keys = [k for k in values if k.startswith(BUFFERS_PREFIX)]
    if buffer_keys:  # per-item state again, each tensor whole (keys as the packed format writes them)
        known = {f for groups in leaves.values() for g in groups for f in g.fqns} | {f for g in flat for f in g.fqns}
        expanded = core.flatten_state("(buffers)", full_state(buffer_keys, values), known, True)
        values = {**{k: v for k, v in values.items() if not k.startswith(BUFFERS_PREFIX)}, **expanded}
    out = {k: v for k, v in values.items() if not k.startswith(GROUPS_PREFIX)}
    if to == "flat":
        # DSD's layout has no tables: scalars become per-item state again (each FQN's first).
        out = {**expand_scalar_tables(values, flat=True), **{k: v for k, v in out.items() if not k.startswith(SCALARS_PREFIX)}}
        escaped = [k for k in values if is_state_item(k) and has_escaped_part(k)]
        if escaped and leaves:
            raise CheckpointFormatError(
                f"state key {escaped[0]!r} has an escaped part (a state key that is not a plain str, or nested "
                "state that reads as another FQN): the flat layout cannot hold it"
            )
        seen: dict[str, bytes] = {}
        for name, groups in leaves.items():
            for gi, group in enumerate(groups):
                if not group.fqns:
                    if drop_empty_groups:
                        continue
                    raise CheckpointMismatchError(
                        f"leaf {name!r} group {gi} has no parameters; flat format cannot express it "
                        "(pass --drop-empty-groups to drop it)"
                    )
                if group.settings_vary:
                    raise CheckpointMismatchError(
                        f"leaf {name!r} group {gi}: ranks' tables hold different settings for this group"
                    )
                for fqn in group.fqns:
                    prev = seen.setdefault(fqn, group.blob)
                    if prev != group.blob:
                        raise CheckpointMismatchError(f"conflicting saved settings for parameter {fqn!r}")
                out.update(core.flatten_groups(name, [(group.settings, group.fqns)]))
        for group in flat:
            out.update(core.flatten_groups(FLAT_LEAF_IN_MIXED, [(group.settings, group.fqns)]))
    elif to == "packed":
        for key, value in values.items():
            if key.startswith(PACKED_PREFIX):
                out[key] = value
        if flat:
            out.update(pack_flat_groups(flat, leaf, leaves))
        # what sparse_ckpt's Stateful writes: guards that make loaders that do not know the format fail
        firsts = [next((f for g in groups for f in g.fqns), None) for groups in (*leaves.values(), flat)]
        out.update(dict.fromkeys(foreign_guard_keys([f for f in firsts if f is not None]), foreign_guard_value()))
    else:
        raise UsageError(f"--to must be 'packed' or 'flat', got {to!r}")
    return out


def expand_scalar_tables(values: Mapping[str, Any], *, flat: bool) -> dict[str, Any]:
    """The scalar tables among ``values`` as the per-item entries (``state.{fqn}.{key}``) of
    packed version 1, FQN by FQN, each FQN's in its saved order; every entry gets its own tensor.

    ``flat=True``: a key the flat layout cannot hold is a :class:`CheckpointFormatError`;
    otherwise it is escaped (packed). A key that ``values`` already holds is a
    :class:`CheckpointFormatError` (a scalar also saved per item).
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
    table = _backend.core.encode_table(leaf, [(g.settings, g.fqns) for g in flat], torch.Tensor, tensor_to_parts)
    return {packed_table_key(leaf, table): table}


def convert_checkpoint(
    src: str,
    dst: str,
    to: str,
    *,
    key: str | None = None,
    leaf: str = SINGLE_LEAF,
    drop_empty_groups: bool = False,
) -> list[str]:
    """Write ``src`` to ``dst`` with its optimizer part in format ``to``; returns the keys converted."""
    metadata = open_checkpoint(src)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UsageError("SRC and DST must differ")
    check_new_dir(dst)
    opts = select_optimizers(find_optimizers(metadata), key)
    if not opts:
        raise UsageError(f"{src!r} holds no optimizer entries ('<key>.state.*' / '<key>.param_groups.*')")
    converted = {flat for opt in opts for flat in (*opt.inner.values(), *opt.guards)}
    others = [k for k in metadata.state_dict_metadata if k not in converted]
    everything = read_entries(src, metadata, metadata.state_dict_metadata.keys(), unpickle_keys=set(others))
    new_opts = []
    for opt in opts:
        values = sparse_values(opt, {inner: everything[flat] for inner, flat in opt.inner.items()})
        new_opts.append((opt.prefix, convert_optimizer(values, to, leaf=leaf, drop_empty_groups=drop_empty_groups)))
    nested: dict[str, Any] = {}
    for flat_key in others:
        set_path(nested, metadata_path(metadata, flat_key), everything[flat_key])
    for prefix, entries in new_opts:
        for inner, value in entries.items():
            set_path(nested, (*prefix, inner), value)
    os.makedirs(dst, exist_ok=True)
    dcp.save(nested, checkpoint_id=dst, no_dist=True)
    return [opt.name for opt in opts]


def check_new_dir(path: str | os.PathLike[str]) -> None:
    """:class:`UsageError` unless ``path`` does not exist or is an empty directory."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UsageError(f"destination {os.fspath(path)!r} exists and is not an empty directory")
