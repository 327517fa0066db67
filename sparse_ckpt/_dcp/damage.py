"""Damaged data files and lost storage records: a `CheckpointFormatError` naming the item and the file.

DCP's ``FileSystemReader.read_data`` raises whatever its file access and ``torch.load`` raise on a
damaged checkpoint -- ``FileNotFoundError`` for a removed file, ``EOFError``/zip ``RuntimeError``
for a truncated one, ``UnpicklingError`` (whose text advises ``weights_only=False``: wrong for a
damaged or untrusted file) for zeroed bytes, ``KeyError(MetadataIndex)`` for a lost storage record.
`diagnose` finds which item of a plan is damaged and says so; `reason` is an exception's text
without torch's advice. `guard_reads` makes a load's ``read_data`` raise these instead.
"""

from __future__ import annotations

import io
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._torch_internals import file_item_location
from ..errors import CheckpointFormatError, SparseCheckpointError
from .saved_tensor import _LOCAL, data_start, directory, end_record, pickled_dtype_disagrees

__all__ = [
    "check_headers",
    "crc_failure",
    "damaged",
    "diagnose",
    "guard_reads",
    "header_crc_failure",
    "header_damage",
    "locate",
    "reason",
    "with_file",
]

_HINT = "a damaged, truncated or partly copied checkpoint; nothing was loaded into the optimizer"


def reason(exc: BaseException) -> str:
    """``exc`` in a few words: its type and first line, without torch's advice to pass
    ``weights_only=False`` (never right for a damaged or untrusted file)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if "weights_only" in str(exc):
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        text = "the restricted (weights-only) unpickler refused it" + (f": global {named[1]!r}" if named else "")
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def damaged(key: str, file: str | None, why: str) -> CheckpointFormatError:
    """The error for item ``key`` of data file ``file`` (``None``: unknown)."""
    where = f" in file {file!r}" if file else ""
    return CheckpointFormatError(f"checkpoint item {key!r}{where}: {why} ({_HINT})")


def locate(storage_reader: Any, metadata: Any, items: Iterable[Any]) -> tuple[str, str | None, str] | None:
    """``(key, file, why)`` of the first damaged item among the ``ReadItem``\\ s ``items`` (its storage
    record lost, its file missing or shorter than the record, or its bytes not a readable tensor or
    object); ``None`` when none is found."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        return None
    for item in items:
        key = item.storage_index.fqn
        info = storage.get(item.storage_index)
        if info is None:
            return key, None, "its storage record is missing from the checkpoint's .metadata"
        where = file_item_location(storage_reader, info, subclasses=True)
        if where is None:
            continue
        file, offset, length = where
        if not os.path.isfile(file):
            return key, file, "the file is missing"
        size = os.path.getsize(file)
        if size < offset + length:
            return key, file, f"the file ends at byte {size}, inside the item's bytes [{offset}, {offset + length})"
        with open(file, "rb") as f:
            f.seek(offset)
            blob = f.read(length)
        bad = crc_failure(blob)
        if bad is not None:
            return key, file, f"its record {bad!r} fails its CRC-32 check"
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to read the item is damage
            return key, file, f"its bytes are not a readable item ({reason(exc)})"
    return None


def diagnose(storage_reader: Any, metadata: Any, items: Iterable[Any]) -> CheckpointFormatError | None:
    """`locate`'s damaged item as the error to raise; ``None`` when none is found."""
    found = locate(storage_reader, metadata, items)
    return None if found is None else damaged(*found)


def with_file(
    exc: CheckpointFormatError, storage_reader: Any, metadata: Any, items: Iterable[Any]
) -> CheckpointFormatError:
    """``exc`` (an item refused as it was read, which names no file) with the item and file
    `locate` blames added; ``exc`` itself when none is found."""
    found = locate(storage_reader, metadata, items)
    if found is None or found[1] is None or found[1] in str(exc):
        return exc
    return CheckpointFormatError(f"{exc} [item {found[0]!r} in file {found[1]!r}]")


def guard_reads(storage_reader: Any, metadata: Any, checked: Callable[[str], bool] = lambda key: False) -> None:
    """Make the next ``read_data`` of ``storage_reader`` (torch's ``FileSystemReader``, the load in
    progress) raise `diagnose`'s `CheckpointFormatError` instead of a raw error of a damaged file
    (or, when no item can be blamed, a `CheckpointFormatError` carrying the raw error's `reason`).
    The wrapper is an attribute of that reader object only, and removes itself when it is called.
    ``checked(key)``: the planner CRC-checks bytes item ``key`` itself (see `check_headers`)."""
    from torch.distributed.checkpoint import FileSystemReader

    from .safe_reader import SafeFileSystemReader

    if type(storage_reader) not in (FileSystemReader, SafeFileSystemReader):
        return
    if "read_data" in vars(storage_reader):
        return  # already guarded (or the user's own attribute: left alone)
    plain = type(storage_reader).read_data

    def read_data(plan: Any, planner: Any) -> Any:
        vars(storage_reader).pop("read_data", None)
        try:
            check_headers(storage_reader, metadata, plan.items, checked)
            return plain(storage_reader, plan, planner)
        except CheckpointFormatError as exc:  # an item refused as read (no file named): name its file
            raise with_file(exc, storage_reader, metadata, plan.items) from None
        except SparseCheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - refused by name below
            error = diagnose(storage_reader, metadata, plan.items)
            if error is None:
                files = sorted({getattr(storage_reader, "path", "")})
                error = CheckpointFormatError(f"reading the checkpoint {files[0]!r} failed ({reason(exc)}; {_HINT})")
            raise error from None

    storage_reader.read_data = read_data


def crc_failure(blob: bytes) -> str | None:
    """The name of the first record of the ``torch.save`` archive ``blob`` (a bytes item: a table, a
    flat setting, a pickled value) whose bytes fail the CRC-32 its zip directory records; ``None``
    when all pass or the archive's directory cannot be read (``torch.load`` then refuses it). One
    ``zlib.crc32`` per record: a few microseconds for the small items it is used on."""
    end = end_record(blob)
    if end is None:
        return None
    at, (n, cd_size, cd_off) = end[0], end[1][4:7]
    if cd_off + cd_size > at:
        return None
    for record in directory(blob, cd_off, n):
        if record is None:
            return None
        name, f = record
        method, crc, size, local = f[4], f[7], f[8], f[16]
        if local + _LOCAL.size > len(blob):
            return name
        head = _LOCAL.unpack_from(blob, local)
        start = local + _LOCAL.size + head[9] + head[10]
        if head[0] != 0x04034B50 or (
            method == 0 and (start + size > len(blob) or zlib.crc32(blob[start : start + size]) != crc)
        ):
            return name
    return None


_TAIL = 4096
"""Bytes read from an item's end to find its zip directory (a one-tensor archive's is ~0.5 KiB)."""


def header_damage(record: str) -> str:
    """The refusal's words for record ``record`` that `header_crc_failure` names."""
    return (
        f"its record {record!r} is damaged (its zip header or CRC-32 check fails, or it disagrees with the "
        "checkpoint's .metadata)"
    )


def header_crc_failure(
    f: Any, offset: int, length: int, expect: tuple[tuple[int, ...], torch.dtype] | None = None
) -> str | None:
    """The name of the first record of the ``torch.save`` archive at ``[offset, offset + length)`` of
    the open file ``f`` whose local header is damaged (its signature or name, or, for tensor data
    records (``*/data/*``), a data start other than where ``torch.save`` puts it: a damaged
    extra-field length moves where ``torch.load`` reads the tensor from), or, other than tensor data
    records, whose bytes fail their CRC-32: a zeroed ``byteorder`` record makes ``torch.load``
    byte-swap a tensor, a zeroed ``data.pkl`` byte can change its shape or dtype. With ``expect``
    (the ``(sizes, dtype)`` its ``.metadata`` records), also the storage record of another byte
    length and a ``data.pkl`` that names another dtype's storage (`pickled_dtype_disagrees`; a shape
    that disagrees fails DCP's own size check, the fast path compares all of it).
    ``None`` when all pass or the directory cannot be read."""
    tail_at = max(0, length - _TAIL)
    f.seek(offset + tail_at)
    tail = f.read(length - tail_at)
    end = end_record(tail)
    if end is None:
        return None
    n, cd_off = end[1][4], end[1][6]
    if cd_off < tail_at:
        return None
    for record in directory(tail, cd_off - tail_at, n):
        if record is None:
            return None
        name, rec = record
        flags, method, crc, size, name_len, local = rec[3], rec[4], rec[7], rec[8], rec[10], rec[16]
        if local + _LOCAL.size + name_len > length:
            return name
        f.seek(offset + local)
        head = f.read(_LOCAL.size + name_len)
        fields = _LOCAL.unpack_from(head)
        start = local + _LOCAL.size + fields[9] + fields[10]
        # a damaged local header moves where torch.load reads the record's bytes from
        if (
            fields[0] != 0x04034B50
            or fields[9] != name_len
            or head[_LOCAL.size :] != name.encode()
            or start + size > length
        ):
            return name
        if fields[2] != flags or fields[3] != method or (not flags & 8 and fields[6:9] != (crc, size, rec[9])):
            return name  # the header disagrees with the directory: torch.load may read other bytes
        if "/data/" in name:
            if local < 0xFFFFFFFF and size < 0xFFFFFFFF and start != data_start(local, name_len):
                return name  # torch.save aligns a tensor's bytes: another start is a damaged extra field
            if expect is not None and name.endswith("/data/0") and size != math.prod(expect[0]) * expect[1].itemsize:
                return name
            continue  # tensor bytes: no check (see docs/guarantees.md)
        if method != 0 or size > 1 << 20:
            continue
        f.seek(offset + start)
        blob = f.read(size)
        if zlib.crc32(blob) != crc:
            return name
        if expect is not None and name.endswith("/data.pkl") and pickled_dtype_disagrees(blob, expect[1]):
            return name
    return None


def check_headers(
    storage_reader: Any, metadata: Any, items: Iterable[Any], checked: Callable[[str], bool] = lambda key: False
) -> None:
    """`header_crc_failure` for every tensor item of ``items`` (``ReadItem``\\ s) that DCP is about to
    read with ``torch.load``, `crc_failure` for every bytes item (DCP's own ``load_bytes`` unpickles
    what a stock planner reads: a zeroed float would load as 0.0) unless ``checked(key)`` (the
    planner checks it as it reads it); a failure is `damaged`'s `CheckpointFormatError`."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        return
    seen: set[Any] = set()
    f, path = None, None
    try:
        for item in items:
            if item.storage_index in seen:
                continue
            seen.add(item.storage_index)
            where = file_item_location(storage_reader, storage.get(item.storage_index), subclasses=True)
            if where is None or not os.path.isfile(where[0]):
                continue  # read_data's own error, diagnosed by the guard
            if where[0] != path:
                if f is not None:
                    f.close()
                f, path = open(where[0], "rb"), where[0]  # noqa: SIM115 - closed below
            if getattr(item.type, "name", "") == "BYTE_IO":  # a pickled object: all its records
                if checked(item.dest_index.fqn):
                    continue  # the planner's load_bytes checks it (weights_only_object)
                f.seek(where[1])
                bad = crc_failure(f.read(where[2]))
            else:
                bad = header_crc_failure(f, where[1], where[2], _chunk_of(metadata, item.storage_index))
            if bad is not None:
                raise damaged(item.storage_index.fqn, where[0], header_damage(bad))
    finally:
        if f is not None:
            f.close()


def _chunk_of(metadata: Any, index: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    """``(sizes, dtype)`` of the stored chunk of tensor item ``index`` (a ``MetadataIndex``) as
    ``.metadata`` records it; ``None`` when it records no such tensor chunk."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = getattr(metadata, "state_dict_metadata", {}).get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    offset = tuple(index.offset) if index.offset is not None else None
    chunks = [c for c in md.chunks if offset is None or tuple(c.offsets) == offset]
    if (
        index.index is not None
        and 0 <= index.index < len(md.chunks)
        and tuple(md.chunks[index.index].offsets) == offset
    ):
        chunks = [md.chunks[index.index]]
    return (tuple(chunks[0].sizes), md.properties.dtype) if len(chunks) == 1 else None
