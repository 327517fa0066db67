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
needed to find it. The pickle is not unpickled: a small interpreter of the few opcodes
``torch.save`` uses for one tensor (`_read_pickle`) reads it into plain tuples, resolving no
global and calling nothing, and accepts only ``_rebuild_tensor_v2``, the legacy storage class
names and ``OrderedDict``. Anything else -- another dtype encoding
(``_rebuild_tensor_v3``: float8, uint16, ...), strides, an unexpected record -- returns ``None``
and the caller uses ``torch.load``, which reads every case. ``torch.load`` checks no CRC either,
so the fast path checks as much as the path it replaces; a short read is refused.
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import torch

from .._host_memory import empty_host

__all__ = ["directory", "end_record", "read_saved_tensor"]

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


_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_ORDERED_DICT = ("collections", "OrderedDict")


_NOT_TAKEN = "not the one-tensor pickle"  # a ValueError's message: `_read_pickle`'s answer is then None


class _PickleMachine:
    """The state of `_read_pickle`'s interpreter (stack, marks, memo, position in ``data``) and one
    method per opcode it reads (`_OPS`); a method raises ``ValueError(_NOT_TAKEN)`` (or an error of a short or
    damaged pickle) for anything outside the one-tensor pickle."""

    __slots__ = ("data", "marks", "memo", "pos", "stack")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}

    def take(self, k: int) -> bytes:
        if self.pos + k > len(self.data):
            raise ValueError("truncated")
        out = self.data[self.pos : self.pos + k]
        self.pos += k
        return out

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos)
        if end < 0:
            raise ValueError("truncated")
        out = self.data[self.pos : end].decode("ascii")
        self.pos = end + 1
        return out

    def int_le(self, k: int, signed: bool = False) -> int:
        return int.from_bytes(self.take(k), "little", signed=signed)

    def push(self, value: Any) -> None:
        self.stack.append(value)

    def since_mark(self) -> tuple[Any, ...]:
        at = self.marks.pop()
        items = tuple(self.stack[at:])
        del self.stack[at:]
        return items

    def proto(self) -> None:
        if self.take(1)[0] > 2:
            raise ValueError(_NOT_TAKEN)

    def global_(self) -> None:
        ref = (self.line(), self.line())
        if ref not in (_REBUILD, _ORDERED_DICT) and not (ref[0] == "torch" and ref[1] in _STORAGE_DTYPES):
            raise ValueError(_NOT_TAKEN)
        self.push(("global", ref))

    def put(self, k: int) -> None:
        value = self.stack[-1]
        self.memo[self.int_le(k)] = value

    def get(self, k: int) -> None:
        self.push(self.memo[self.int_le(k)])

    def mark(self) -> None:
        self.marks.append(len(self.stack))

    def unicode(self) -> None:
        self.push(self.take(self.int_le(4)).decode("utf-8"))

    def long1(self) -> None:
        self.push(self.int_le(self.take(1)[0], signed=True))

    def tuple_n(self, k: int) -> None:
        if len(self.stack) < k:
            raise ValueError(_NOT_TAKEN)
        items = tuple(self.stack[len(self.stack) - k :])
        del self.stack[len(self.stack) - k :]
        self.push(items)

    def persid(self) -> None:
        self.push(("storage", self.stack.pop()))

    def reduce(self) -> None:
        """Records the call, never makes it."""
        args, fn = self.stack.pop(), self.stack.pop()
        if type(fn) is not tuple or fn[:1] != ("global",) or type(args) is not tuple:
            raise ValueError(_NOT_TAKEN)
        if fn[1] == _ORDERED_DICT and args:
            raise ValueError(_NOT_TAKEN)
        self.push(("call", fn[1], args))

    def stop(self) -> Any:
        """The value: the one item left, where the pickle ends here with no open mark."""
        ok = self.pos == len(self.data) and len(self.stack) == 1 and not self.marks
        return self.stack.pop() if ok else None


_OPS: dict[bytes, Callable[[_PickleMachine], None]] = {
    b"\x80": _PickleMachine.proto,  # PROTO
    b"c": _PickleMachine.global_,  # GLOBAL
    b"q": lambda m: m.put(1),  # BINPUT
    b"r": lambda m: m.put(4),  # LONG_BINPUT
    b"h": lambda m: m.get(1),  # BINGET
    b"j": lambda m: m.get(4),  # LONG_BINGET
    b"(": _PickleMachine.mark,  # MARK
    b"X": _PickleMachine.unicode,  # BINUNICODE
    b"K": lambda m: m.push(m.int_le(1)),  # BININT1
    b"M": lambda m: m.push(m.int_le(2)),  # BININT2
    b"J": lambda m: m.push(m.int_le(4, signed=True)),  # BININT
    b"\x8a": _PickleMachine.long1,  # LONG1
    b")": lambda m: m.push(()),  # EMPTY_TUPLE
    b"\x85": lambda m: m.tuple_n(1),  # TUPLE1
    b"\x86": lambda m: m.tuple_n(2),  # TUPLE2
    b"\x87": lambda m: m.tuple_n(3),  # TUPLE3
    b"t": lambda m: m.push(m.since_mark()),  # TUPLE
    b"\x88": lambda m: m.push(True),  # NEWTRUE
    b"\x89": lambda m: m.push(False),  # NEWFALSE
    b"Q": _PickleMachine.persid,  # BINPERSID
    b"R": _PickleMachine.reduce,  # REDUCE
}
"""The opcodes `_read_pickle` reads but STOP, each the `_PickleMachine` step it takes."""


def _read_pickle(data: bytes) -> Any:
    """The value of the pickle ``data`` when it is what ``torch.save`` writes for one tensor, read by
    a small interpreter of the few protocol-2 opcodes that pickle uses (`_OPS`); ``None`` for anything else.

    Nothing is unpickled in Python's sense: no global is resolved and nothing is called. A
    ``GLOBAL`` is kept as its ``(module, name)`` (only ``_rebuild_tensor_v2``, a legacy storage
    class or ``OrderedDict`` are accepted), ``REDUCE`` only records a call (``("call", global,
    args)``; ``OrderedDict`` only with no arguments), ``BINPERSID`` only records the storage's id
    (``("storage", pid)``). Values are ints, strs, bools and tuples."""
    machine = _PickleMachine(data)
    try:
        while True:
            op = machine.take(1)
            if op == b".":  # STOP
                return machine.stop()
            step = _OPS.get(op)
            if step is None:
                return None
            step(machine)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError):
        return None


def end_record(buf: bytes) -> tuple[int, tuple[int, ...]] | None:
    """``(offset, fields)`` of the zip end-of-central-directory record in ``buf`` (the last one; its
    fields unpacked by ``_EOCD``: ``[4]`` records, ``[5]`` directory size, ``[6]`` directory offset),
    ``None`` where there is none."""
    at = buf.rfind(b"PK\x05\x06")
    if at < 0 or len(buf) - at < _EOCD.size:
        return None
    return at, _EOCD.unpack_from(buf, at)


def directory(buf: bytes, pos: int, n: int) -> Iterator[tuple[str, tuple[int, ...]] | None]:
    """The ``n`` central directory records from offset ``pos`` of ``buf``, in order: ``(name, fields)``
    (``fields`` unpacked by ``_CDIR``: ``[4]`` compression, ``[7]`` CRC-32, ``[8]`` size, ``[10]`` name
    length, ``[16]`` local header offset), then ``None`` (and no more) at a record cut off or
    without its signature."""
    for _ in range(n):
        if pos + _CDIR.size > len(buf):
            yield None
            return
        f = _CDIR.unpack_from(buf, pos)
        if f[0] != 0x02014B50:
            yield None
            return
        yield buf[pos + _CDIR.size : pos + _CDIR.size + f[10]].decode("utf-8", "replace"), f
        pos += _CDIR.size + f[10] + f[11] + f[12]


def _records(tail: bytes, base: int) -> dict[str, tuple[int, int, int]] | None:
    """``name -> (local header offset, size, compression)`` from the central directory found in
    ``tail`` (the last bytes of the archive, ``base``: the archive offset of ``tail[0]``)."""
    end = end_record(tail)
    if end is None:
        return None
    _sig, _disk, _cd_disk, _n_here, n, cd_size, cd_off, _comment = end[1]
    if cd_off == 0xFFFFFFFF or cd_size == 0xFFFFFFFF or n == 0xFFFF or cd_off < base:
        return None  # zip64 (an archive over 4 GiB) or a directory outside the tail
    out: dict[str, tuple[int, int, int]] = {}
    for record in directory(tail, cd_off - base, n):
        if record is None:
            return None
        name, f = record
        out[name] = (f[16], f[8], f[4])
    return out


def _data_at(head: bytes, local: int, name: str) -> int | None:
    """The archive offset of a record's data, from its local header in ``head`` (the archive's
    first bytes), which must carry the record's ``name`` (a damaged header would move the data)."""
    if local + _LOCAL.size > len(head):
        return None
    f = _LOCAL.unpack_from(head, local)
    at = local + _LOCAL.size
    if f[0] != 0x04034B50 or head[at : at + f[9]] != name.encode():
        return None
    return at + f[9] + f[10]


def _read_at(f: BinaryIO, offset: int, length: int) -> bytes:
    f.seek(offset)
    return f.read(length)


def read_saved_tensor(
    f: BinaryIO, offset: int, length: int, size: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
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
    names = {}
    for name, rec in records.items():
        for suffix in ("/data.pkl", "/byteorder", "/data/0"):
            if name.endswith(suffix) and name.count("/") == suffix.count("/"):
                found[suffix] = rec
                names[suffix] = name
    if len(found) != 3 or any(rec[2] != 0 for rec in found.values()):
        return None
    pkl_local, pkl_size, _ = found["/data.pkl"]
    order_local, order_size, _ = found["/byteorder"]
    data_local, data_size, _ = found["/data/0"]
    if data_size != nbytes or max(pkl_local, order_local) > data_local:
        return None
    head = _read_at(f, offset, min(length, data_local + _LOCAL.size + 1024))
    data_at, pkl_at, order_at = (
        _data_at(head, loc, names[suffix])
        for loc, suffix in ((data_local, "/data/0"), (pkl_local, "/data.pkl"), (order_local, "/byteorder"))
    )
    if data_at is None or pkl_at is None or order_at is None or data_at + nbytes > length:
        return None
    if data_at != data_start(data_local, len(names["/data/0"].encode())):
        return None  # a damaged header moved the data (the caller's header check refuses it)
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
    of storage ``"0"`` on the CPU, without ``requires_grad`` or hooks (read by `_read_pickle`)."""
    obj = _read_pickle(pkl)
    if type(obj) is not tuple or len(obj) != 3 or obj[:2] != ("call", _REBUILD) or len(obj[2]) != 6:
        return False
    storage, storage_offset, got_size, stride, requires_grad, hooks = obj[2]
    if type(storage) is not tuple or len(storage) != 2 or storage[0] != "storage":
        return False
    pid = storage[1]
    if type(pid) is not tuple or len(pid) != 5:
        return False
    kind, cls, key, location, numel = pid
    return (
        kind == "storage"
        and type(cls) is tuple
        and cls[0] == "global"
        and cls[1][0] == "torch"
        and _STORAGE_DTYPES.get(cls[1][1]) == dtype
        and key == "0"
        and location == "cpu"
        and numel == torch.Size(size).numel()
        and storage_offset == 0
        and type(got_size) is tuple
        and got_size == tuple(size)
        and stride == contiguous_strides(size)
        and requires_grad is False
        and hooks == ("call", _ORDERED_DICT, ())
    )


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a new contiguous tensor of ``size`` (``torch.empty(size).stride()``,
    a dimension of 0 counted as 1), the only strides a direct read takes and the ones a buffered
    load gives a DTensor state tensor made from its bucket (`sparse_ckpt._layouts.bucketed_scatter`)."""
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


_ALIGN = 64
"""``torch.save`` starts every record's data at a multiple of 64 bytes of its archive (the extra
field of the record's local header pads it there: 4 bytes of field header, then the padding)."""


def data_start(local: int, name_len: int) -> int:
    """Where ``torch.save`` puts the data of a record whose local header is at archive offset
    ``local`` (an archive under 4 GiB: no zip64 field): the first multiple of 64 after the header,
    its name and the 4-byte header of the padding field."""
    base = local + _LOCAL.size + name_len + 4
    return -(-base // _ALIGN) * _ALIGN


_STORAGE_GLOBAL = re.compile(rb"ctorch\n(\w+Storage)\n")


def pickled_dtype_disagrees(pkl: bytes, dtype: torch.dtype) -> bool:
    """Whether the pickle ``pkl`` of a saved tensor (its ``data.pkl`` record) names one legacy storage
    class and it is not ``dtype``'s (``torch.load`` would rebuild another dtype, which DCP's copy into
    the target would cast silently). A scan for the ``GLOBAL`` opcode, no interpretation: a few
    microseconds per item. Other encodings (``_rebuild_tensor_v3``'s ``UntypedStorage``) are not
    judged here; the storage size is the data record's length, the shape DCP's own size check."""
    names = _STORAGE_GLOBAL.findall(pkl)
    if len(names) != 1:
        return False
    saved = _STORAGE_DTYPES.get(names[0].decode("ascii"))
    return saved is not None and saved != dtype
