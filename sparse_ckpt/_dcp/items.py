"""Reading DCP items: weights-only unpickling, load buffers allocated like their parameter, and the
one reader of whole items that a load's buffers layout and the checkpoint tools share.

:func:`read_items` reads chosen items of a checkpoint through a ``StorageReader`` (rank-local, no
collective, no planning through ``dcp.load``): tensors into new CPU tensors (DCP's chunks of one
item are assembled), bytes items unpickled with ``weights_only=True`` unless told otherwise. Each
value goes to ``consume`` as soon as it is complete (a ``state_layout="buffers"`` load keeps one
bucket alive at a time), or into the returned dict.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as dtensor_empty

from .._format.keys import BUFFERS_PREFIX, PACKED_PREFIX, SCALARS_PREFIX, STEP_KEY, is_table_key, table_kind
from .._torch_internals import file_item_location
from ..errors import CheckpointFormatError, CheckpointMismatchError, SparseCheckpointError
from .damage import crc_failure, damaged, diagnose, header_crc_failure, header_damage, reason, with_file
from .saved_tensor import read_saved_tensor

__all__ = [
    "FileWindow",
    "ItemPlanner",
    "WeightsOnlyStream",
    "allocate_item",
    "allocate_like",
    "check_covered",
    "read_items",
    "weights_only_item",
    "weights_only_object",
]

Consume = Callable[[str, Any], None]


_NOT_DATA = "a damaged checkpoint, or one that holds more than data"


class WeightsOnlyStream(io.BytesIO):
    """A bytes item's stream that `weights_only_item` wrote from the object it read weights-only: a
    later reader (``SPARSE_CKPT_SAFE_LOAD``'s ``load_bytes``) need not check it again."""


def weights_only_item(
    key: str, value: io.BytesIO, table: bool, *, what: str | None = None, hint: str = _NOT_DATA
) -> io.BytesIO:
    """Unpickle a DCP bytes item with ``weights_only=True``; return a fresh stream of it for DCP
    (a `WeightsOnlyStream`)."""
    out = WeightsOnlyStream()
    torch.save(weights_only_object(key, value, table, what=what, hint=hint), out)
    out.seek(0)
    return out


def weights_only_object(
    key: str, value: io.BytesIO, table: bool, *, what: str | None = None, hint: str = _NOT_DATA
) -> Any:
    """The object of a DCP bytes item, unpickled with ``weights_only=True`` (``table``: it must be ``bytes``).
    A refusal is a `CheckpointFormatError` naming ``what`` (default: the table kind, or "optimizer
    item") and the key, the global the unpickler refused, and ``hint``."""
    prefix = next((p for p in (SCALARS_PREFIX, BUFFERS_PREFIX) if p in key), PACKED_PREFIX)
    what = what if what is not None else table_kind(prefix) if table else "optimizer item"
    blob = value.getvalue() if isinstance(value, io.BytesIO) else None
    bad = crc_failure(blob) if blob is not None else None
    if bad is not None:
        raise CheckpointFormatError(f"{what} {key!r}: its record {bad!r} fails its CRC-32 check (damaged bytes)")
    try:
        with torch.serialization.safe_globals(numpy_scalar_globals()):
            obj = torch.load(value, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal of the restricted unpickler
        raise CheckpointFormatError(f"{what} {key!r} is not a plain data item ({reason(exc)}): {hint}") from None
    if table and not isinstance(obj, bytes):
        raise CheckpointFormatError(f"{what} {key!r} holds a {type(obj).__name__}, expected bytes")
    return obj


_NUMPY_SCALAR_TYPES = ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_NUMPY_SCALAR_TYPES += ("float16", "float32", "float64", "longdouble", "complex64", "complex128", "clongdouble")


def numpy_scalar_globals() -> list[Any]:
    """What a pickled numeric numpy scalar names (its reconstructor, ``numpy.dtype`` and the dtype's
    class): data only, which torch's ``weights_only`` unpickler refuses unless allowed. A state value a
    stock DSD checkpoint holds as a bytes item (a ``LambdaLR`` computing with numpy) then loads under
    the library's weights-only reads as it does under stock DCP. Empty without numpy."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - DCP needs numpy
        return []
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    out: list[Any] = [core.multiarray.scalar, np.dtype]
    out += [type(np.dtype(getattr(np, name))) for name in _NUMPY_SCALAR_TYPES if hasattr(np, name)]
    return out


def allocate_like(size: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor | None) -> torch.Tensor:
    """A new tensor of ``size`` and ``dtype`` allocated like parameter ``like``: a DTensor parameter
    gives a DTensor with its mesh and placements, a plain one a tensor on its device (a parameter on
    the meta device: on the CPU, so that what is read lands somewhere); ``None``: a CPU tensor."""
    if like is None:
        return torch.empty(size, dtype=dtype)
    if isinstance(like, DTensor):
        return dtensor_empty(size, dtype=dtype, device_mesh=like.device_mesh, placements=like.placements)
    return torch.empty(size, dtype=dtype, device="cpu" if like.device.type == "meta" else like.device)


def allocate_item(md: Any, like: torch.Tensor | None, key_leaf: str) -> Any:
    """A load buffer for one checkpoint item (``None`` for bytes items: DCP replaces it): allocated
    like ``like`` when the item is parameter-shaped state (not ``step``), else a plain CPU tensor."""
    if isinstance(md, BytesStorageMetadata) or not isinstance(md, TensorStorageMetadata):
        return None
    size = tuple(md.size)
    shaped = like is not None and key_leaf != STEP_KEY and size == tuple(like.shape)
    return allocate_like(size, md.properties.dtype, like if shaped else None)


class ItemPlanner(DefaultLoadPlanner):
    """The read callbacks of :func:`read_items` (``read_data`` is called directly, not through
    ``dcp.load``'s planning): a tensor item is allocated on the CPU when its first chunk is read and
    handed over when its last one is; a bytes item is unpickled with ``weights_only=True`` (``unpickle_keys``:
    items that are not an optimizer's, which ``convert`` copies, refused as a "checkpoint item"), or kept
    raw (``raw_keys``). Nothing is unpickled unrestricted."""

    def __init__(
        self,
        metadata: Metadata,
        consume: Consume | None = None,
        *,
        raw_keys: Collection[str] = (),
        unpickle_keys: Collection[str] = (),
        is_table: Callable[[str], bool] = is_table_key,
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._is_table = is_table
        self.metadata = metadata
        self.state_dict: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        self._consume = consume if consume is not None else self.values.__setitem__
        self.consume = self._consume
        self._raw_keys = raw_keys
        self._unpickle_keys = unpickle_keys
        self._chunks_left: dict[str, int] = {}

    @property
    def chunks_expected(self) -> Collection[str]:
        """The tensor items :meth:`expect` was told about."""
        return self._chunks_left.keys()

    def expect(self, plan_items: Iterable[ReadItem]) -> None:
        """Count each tensor item's chunks in the plan (its value is complete after the last)."""
        for item in plan_items:
            key = item.dest_index.fqn
            self._chunks_left[key] = self._chunks_left.get(key, 0) + 1

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        key = read_item.dest_index.fqn
        target = self.state_dict.get(key)
        if target is None:
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            target = self.state_dict[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if tuple(read_item.lengths) == tuple(target.shape):
            return target
        return super().resolve_tensor(read_item)  # a chunk: a view of the whole item

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        key = read_item.dest_index.fqn
        left = self._chunks_left.get(key, 1) - 1
        self._chunks_left[key] = left
        if left <= 0:
            self._consume(key, self.state_dict.pop(key))

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        if key in self._raw_keys:
            self._consume(key, value.read())
        elif key in self._unpickle_keys:  # not the optimizer's: named as an item, never unpickled unrestricted
            self._consume(key, weights_only_object(key, value, table=False, what="checkpoint item"))
        else:
            self._consume(key, weights_only_object(key, value, table=self._is_table(key)))


def check_covered(key: str, md: Any, where: str = "") -> None:
    """A tensor item's chunk records in the ``.metadata`` (``md``) cover its elements: their
    volumes add up to its size. A ``.metadata`` that lost chunk records of an item (or lists
    overlapping ones) would otherwise leave part of the tensor DCP reads into unwritten --
    uninitialized memory loaded as state -- so it is a `CheckpointFormatError` naming the item
    (``where``: e.g. ``" of 'ckpt_dir'"``), before anything is read."""
    if not isinstance(md, TensorStorageMetadata):
        return
    total = math.prod(md.size)
    listed = sum(math.prod(c.sizes) for c in md.chunks)
    if listed != total:
        raise CheckpointFormatError(
            f"item {key!r}{where}: .metadata lists data for {listed} of its {total} elements (a damaged or edited "
            "checkpoint: chunk records lost or overlapping); nothing was loaded"
        )


def read_items(
    storage_reader: Any,
    metadata: Metadata,
    keys: Iterable[str],
    consume: Consume | None = None,
    *,
    raw_keys: Collection[str] = (),
    unpickle_keys: Collection[str] = (),
    is_table: Callable[[str], bool] = is_table_key,
    require_storage: bool = False,
    where: str = "",
) -> dict[str, Any]:
    """Read whole items ``keys`` through ``storage_reader`` (set up for ``metadata``) in this process.

    With ``consume``, ``consume(key, value)`` gets each value when it is complete and the result is
    empty; without, the values are returned by key. Tensors come back as new CPU tensors; bytes
    items as :class:`ItemPlanner` says (``is_table(key)``: the item must unpickle to ``bytes``).
    ``require_storage``: an item without its entry in the metadata's storage records is a
    :class:`CheckpointMismatchError` before anything is read. With ``consume``, a tensor item
    without data (no element) is not handed over, as DCP hands over none; without, it is returned
    empty. Every tensor item's chunk records must cover it (`check_covered`, before anything is
    read; ``where`` names the checkpoint in that error, e.g. ``" of 'ckpt_dir'"``)."""
    targets: dict[str, Any] = {}
    for key in keys:
        md = metadata.state_dict_metadata[key]
        check_covered(key, md, where)
        is_tensor = isinstance(md, TensorStorageMetadata)
        targets[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta") if is_tensor else b""
    if not targets:
        return {}
    planner = ItemPlanner(metadata, consume, raw_keys=raw_keys, unpickle_keys=unpickle_keys, is_table=is_table)
    plan = create_default_local_load_plan(targets, metadata)
    planner.expect(
        item
        for item in plan.items
        if isinstance(metadata.state_dict_metadata[item.dest_index.fqn], TensorStorageMetadata)
    )
    if consume is None:
        for key, target in targets.items():  # a tensor without data (no element): nothing to read
            if isinstance(target, torch.Tensor) and key not in planner.chunks_expected:
                planner.consume(key, torch.empty(tuple(target.shape), dtype=target.dtype))
    storage = getattr(metadata, "storage_data", None)
    if require_storage and isinstance(storage, Mapping):  # a storage reader looks each item up there
        for item in plan.items:
            if item.storage_index not in storage:
                raise CheckpointMismatchError(
                    f"checkpoint item {item.storage_index.fqn!r} has no storage entry in the checkpoint's "
                    ".metadata (a damaged or partial copy): its data cannot be found"
                )
    items = list(plan.items)
    try:
        rest = _read_files_directly(storage_reader, metadata, plan.items, planner)
        if rest:
            plan.items[:] = rest
            storage_reader.read_data(plan, planner).wait()
    except CheckpointFormatError as exc:  # an item refused as read (no file named): name its file
        raise with_file(exc, storage_reader, metadata, items) from None
    except SparseCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged file: refused naming the item and its file
        raise (
            diagnose(storage_reader, metadata, items)
            or CheckpointFormatError(
                f"reading checkpoint items{where} failed ({reason(exc)}): a damaged or truncated checkpoint"
            )
        ) from None
    return planner.values


class FileWindow(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a read-only, seekable stream: one DCP
    item, as ``torch.load`` (a load's direct reads) and ``zipfile`` (``verify``'s CRC checks) read it."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(memoryview(b).cast("B")), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b).cast("B")[:n])
        self._pos += got
        return got


def _read_files_directly(
    storage_reader: Any, metadata: Metadata, items: list[ReadItem], planner: ItemPlanner
) -> list[ReadItem]:
    """Read the plan's whole one-chunk tensor items straight from their files into their own
    tensors (one ``readinto`` of the tensor's bytes, `read_saved_tensor`, or ``torch.load`` of the
    item's bytes where that does not apply: one read, where ``read_data`` loads into one tensor and
    copies into another), in file order; return the items left for ``read_data`` (bytes items,
    chunks of an item, other storage readers)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        return items
    by_key: dict[str, int] = {}
    for item in items:
        by_key[item.dest_index.fqn] = by_key.get(item.dest_index.fqn, 0) + 1
    direct: list[tuple[str, int, int, ReadItem]] = []
    rest: list[ReadItem] = []
    for item in items:
        key = item.dest_index.fqn
        md = metadata.state_dict_metadata[key]
        where = None
        if (
            isinstance(md, TensorStorageMetadata)
            and by_key[key] == 1
            and tuple(item.lengths) == tuple(md.size)
            and not any(item.storage_offsets)
            and not any(item.dest_offsets)
            and item.storage_index in storage
        ):
            where = file_item_location(storage_reader, storage[item.storage_index])
        if where is None:
            rest.append(item)
        else:
            direct.append((*where, item))
    direct.sort(key=lambda d: (d[0], d[1]))
    f = None
    path = None
    try:
        for file, offset, length, item in direct:
            if file != path:
                if f is not None:
                    f.close()
                f, path = open(file, "rb"), file  # noqa: SIM115 - one file open at a time, closed below
            key = item.dest_index.fqn
            md = metadata.state_dict_metadata[key]
            try:
                tensor = read_saved_tensor(f, offset, length, tuple(md.size), md.properties.dtype)
            except EOFError as exc:
                raise CheckpointFormatError(
                    f"checkpoint item {key!r}: its file {file!r} ends inside the item's data ({exc} read; a truncated "
                    "checkpoint)"
                ) from None
            if tensor is None:  # not the plain case: torch.load reads every case
                # a zeroed byteorder: byte-swapped values; a moved data start: other bytes
                bad = header_crc_failure(f, offset, length, (tuple(md.size), md.properties.dtype))
                if bad is not None:
                    raise damaged(key, file, header_damage(bad))
                try:
                    tensor = torch.load(
                        io.BufferedReader(FileWindow(f, offset, length)), map_location="cpu", weights_only=True
                    )
                except Exception as exc:  # noqa: BLE001 - zeroed or cut bytes: refused naming item and file
                    raise damaged(key, file, f"its bytes are not a readable tensor ({reason(exc)})") from None
            if (
                not isinstance(tensor, torch.Tensor)
                or tuple(tensor.shape) != tuple(md.size)
                or tensor.dtype != md.properties.dtype
            ):
                raise CheckpointFormatError(
                    f"checkpoint item {key!r} holds {type(tensor).__name__} "
                    f"{tuple(getattr(tensor, 'shape', ()))} {getattr(tensor, 'dtype', '')}, its metadata says "
                    f"{md.properties.dtype} {tuple(md.size)} (a damaged checkpoint)"
                )
            planner.state_dict[key] = tensor
            planner.commit_tensor(item, tensor)
    finally:
        if f is not None:
            f.close()
    return rest
