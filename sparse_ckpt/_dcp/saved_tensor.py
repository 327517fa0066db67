"""Reading one ``torch.save``\\ d tensor -- a DCP item as ``FileSystemWriter`` writes it -- straight
into a new tensor: the bytes of its storage record, with one ``readinto``.

``torch.load`` of a DCP item costs ~0.2 ms beyond the read itself (the archive reader's set-up,
the weights-only unpickler, buffered reads through Python), which a load of a few hundred
1 MiB per-item state tensors pays a few hundred times. The archive is a plain zip (stored, not
compressed) whose records this module finds from the central directory at its end:
``<archive>/data.pkl`` (the pickle of the tensor: a ``_rebuild_tensor_v2`` call on storage
``"0"``), ``<archive>/byteorder`` and ``<archive>/data/0`` (the storage's bytes).

Only the plain case is taken: one contiguous, little-endian CPU tensor of the expected dtype and
shape, storage offset 0, the whole storage, no ``requires_grad``, no hooks, no zip64 record
needed to find it. The pickle is read by a restricted unpickler that knows nothing but
``_rebuild_tensor_v2``, the legacy storage class names and ``OrderedDict``, and builds nothing
from them (it only records the call's arguments). Anything else -- another dtype encoding
(``_rebuild_tensor_v3``: float8, uint16, ...), strides, an unexpected record -- returns ``None``
and the caller uses ``torch.load``, which reads every case. ``torch.load`` checks no CRC either,
so the fast path checks as much as the path it replaces; a short read is refused.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections import OrderedDict
from typing import Any, BinaryIO

import torch

from .._host_memory import empty_host

__all__ = ["read_saved_tensor"]

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}
"""The legacy storage class names ``torch.save`` pickles for these dtypes (other dtypes are saved
with ``_rebuild_tensor_v3`` and an ``UntypedStorage``: not taken here)."""

_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory record
_CDIR = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header
_TAIL = 4096
"""Bytes read from an item's end to find its central directory (a one-tensor archive's is ~0.5 KiB)."""


class _Rebuild:
    """What the pickle asks ``_rebuild_tensor_v2`` to build: its arguments, recorded."""

    def __init__(self, *args: Any) -> None:
        self.args = args


class _Storage:
    """The persistent id of a storage: ``('storage', class name, key, location, numel)``."""

    def __init__(self, pid: Any) -> None:
        self.pid = pid


class _StorageClass(str):
    """A storage class named by the pickle, as its name (nothing of torch is resolved)."""


class _Unpickler(pickle.Unpickler):
    """Knows ``torch._utils._rebuild_tensor_v2``, the legacy storage class names and
    ``collections.OrderedDict``; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuild
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageClass(name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not read here")

    def persistent_load(self, pid: Any) -> Any:
        return _Storage(pid)


def _records(tail: bytes, base: int) -> dict[str, tuple[int, int, int]] | None:
    """``name -> (local header offset, size, compression)`` from the central directory found in
    ``tail`` (the last bytes of the archive, ``base``: the archive offset of ``tail[0]``)."""
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        return None
    _sig, _disk, _cd_disk, _n_here, n, cd_size, cd_off, _comment = _EOCD.unpack_from(tail, at)
    if cd_off == 0xFFFFFFFF or cd_size == 0xFFFFFFFF or n == 0xFFFF or cd_off < base:
        return None  # zip64 (an archive over 4 GiB) or a directory outside the tail
    pos = cd_off - base
    out: dict[str, tuple[int, int, int]] = {}
    for _ in range(n):
        if pos + _CDIR.size > len(tail):
            return None
        f = _CDIR.unpack_from(tail, pos)
        if f[0] != 0x02014B50:
            return None
        method, size, name_len, extra_len, comment_len, local = f[4], f[8], f[10], f[11], f[12], f[16]
        name = tail[pos + _CDIR.size : pos + _CDIR.size + name_len].decode("utf-8", "replace")
        out[name] = (local, size, method)
        pos += _CDIR.size + name_len + extra_len + comment_len
    return out


def _data_at(head: bytes, local: int) -> int | None:
    """The archive offset of a record's data, from its local header in ``head`` (the archive's
    first bytes)."""
    if local + _LOCAL.size > len(head):
        return None
    f = _LOCAL.unpack_from(head, local)
    if f[0] != 0x04034B50:
        return None
    return local + _LOCAL.size + f[9] + f[10]


def _read_at(f: BinaryIO, offset: int, length: int) -> bytes:
    f.seek(offset)
    return f.read(length)


def read_saved_tensor(f: BinaryIO, offset: int, length: int, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The tensor ``torch.save`` wrote at ``[offset, offset + length)`` of the open file ``f``, read
    with one ``readinto`` into a new contiguous CPU tensor, when it is a plain contiguous tensor of
    ``size`` and ``dtype`` (see the module doc); ``None`` for anything else (read it with
    ``torch.load``). Raises ``EOFError`` when the file ends inside the tensor's bytes."""
    nbytes = torch.Size(size).numel() * dtype.itemsize
    if nbytes == 0 or sys.byteorder != "little" or length < nbytes:
        return None
    tail_at = max(0, length - _TAIL)
    records = _records(_read_at(f, offset + tail_at, length - tail_at), tail_at)
    if records is None:
        return None
    found = {}
    for name, rec in records.items():
        for suffix in ("/data.pkl", "/byteorder", "/data/0"):
            if name.endswith(suffix) and name.count("/") == suffix.count("/"):
                found[suffix] = rec
    if len(found) != 3 or any(rec[2] != 0 for rec in found.values()):
        return None
    pkl_local, pkl_size, _ = found["/data.pkl"]
    order_local, order_size, _ = found["/byteorder"]
    data_local, data_size, _ = found["/data/0"]
    if data_size != nbytes or max(pkl_local, order_local) > data_local:
        return None
    head = _read_at(f, offset, min(length, data_local + _LOCAL.size + 1024))
    data_at, pkl_at, order_at = (_data_at(head, loc) for loc in (data_local, pkl_local, order_local))
    if data_at is None or pkl_at is None or order_at is None or data_at + nbytes > length:
        return None
    if head[order_at : order_at + order_size] != b"little" or pkl_at + pkl_size > len(head):
        return None
    if not _plain_tensor(head[pkl_at : pkl_at + pkl_size], size, dtype):
        return None
    out = empty_host(size, dtype)
    view = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
    f.seek(offset + data_at)
    got = f.readinto(view)
    if got != nbytes:
        raise EOFError(f"{got} of {nbytes} bytes")
    return out


def _plain_tensor(pkl: bytes, size: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether pickle ``pkl`` rebuilds one contiguous tensor of ``size`` and ``dtype`` from the whole
    of storage ``"0"`` on the CPU, without ``requires_grad`` or hooks."""
    try:
        obj = _Unpickler(io.BytesIO(pkl)).load()
    except Exception:  # noqa: BLE001 - anything unexpected: torch.load reads it
        return False
    if type(obj) is not _Rebuild or len(obj.args) != 6:
        return False
    storage, storage_offset, got_size, stride, requires_grad, hooks = obj.args
    if type(storage) is not _Storage or type(storage.pid) is not tuple or len(storage.pid) != 5:
        return False
    kind, cls, key, location, numel = storage.pid
    return (
        kind == "storage"
        and type(cls) is _StorageClass
        and _STORAGE_DTYPES[cls] == dtype
        and key == "0"
        and location == "cpu"
        and numel == torch.Size(size).numel()
        and storage_offset == 0
        and tuple(got_size) == tuple(size)
        and tuple(stride) == _contiguous(size)
        and requires_grad is False
        and type(hooks) is OrderedDict
        and not hooks
    )


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
