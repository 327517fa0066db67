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
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._torch_internals import file_item_location
from ..errors import CheckpointFormatError, SparseCheckpointError

__all__ = ["damaged", "diagnose", "guard_reads", "reason"]

_HINT = "a damaged, truncated or partly copied checkpoint; nothing was loaded into the optimizer"


def reason(exc: BaseException) -> str:
    """``exc`` in a few words: its type and first line, without torch's advice to pass
    ``weights_only=False`` (never right for a damaged or untrusted file)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if "weights_only" in str(exc):
        text = "the restricted (weights-only) unpickler refused it"
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def damaged(key: str, file: str | None, why: str) -> CheckpointFormatError:
    """The error for item ``key`` of data file ``file`` (``None``: unknown)."""
    where = f" in file {file!r}" if file else ""
    return CheckpointFormatError(f"checkpoint item {key!r}{where}: {why} ({_HINT})")


def diagnose(storage_reader: Any, metadata: Any, items: Iterable[Any]) -> CheckpointFormatError | None:
    """The first damaged item among the ``ReadItem``\\ s ``items`` (its storage record lost, its file
    missing or shorter than the record, or its bytes not a readable tensor or object), as the error
    to raise; ``None`` when none is found."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        return None
    for item in items:
        key = item.storage_index.fqn
        info = storage.get(item.storage_index)
        if info is None:
            return damaged(key, None, "its storage record is missing from the checkpoint's .metadata")
        where = file_item_location(storage_reader, info)
        if where is None:
            continue
        file, offset, length = where
        if not os.path.isfile(file):
            return damaged(key, file, "the file is missing")
        size = os.path.getsize(file)
        if size < offset + length:
            return damaged(key, file, f"the file ends at byte {size}, inside the item's bytes [{offset}, {offset + length})")
        with open(file, "rb") as f:
            f.seek(offset)
            blob = f.read(length)
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to read the item is damage
            return damaged(key, file, f"its bytes are not a readable item ({reason(exc)})")
    return None


def guard_reads(storage_reader: Any, metadata: Any) -> None:
    """Make the next ``read_data`` of ``storage_reader`` (torch's ``FileSystemReader``, the load in
    progress) raise `diagnose`'s `CheckpointFormatError` instead of a raw error of a damaged file
    (or, when no item can be blamed, a `CheckpointFormatError` carrying the raw error's `reason`).
    The wrapper is an attribute of that reader object only, and removes itself when it is called."""
    from torch.distributed.checkpoint import FileSystemReader

    if type(storage_reader) is not FileSystemReader:
        return
    if "read_data" in vars(storage_reader):
        return  # already guarded (or the user's own attribute: left alone)
    plain = type(storage_reader).read_data

    def read_data(plan: Any, planner: Any) -> Any:
        vars(storage_reader).pop("read_data", None)
        try:
            return plain(storage_reader, plan, planner)
        except SparseCheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - refused by name below
            error = diagnose(storage_reader, metadata, plan.items)
            if error is None:
                files = sorted({getattr(storage_reader, "path", "")})
                error = CheckpointFormatError(f"reading the checkpoint {files[0]!r} failed ({reason(exc)}; {_HINT})")
            raise error from None

    storage_reader.read_data = read_data
