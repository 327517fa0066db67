"""Twin of csrc/checksum.cpp: CRC-32C (Castagnoli; reflected polynomial ``0x82F63B78``), the
checksums a save writes of the buckets of ``state_layout="buffers"`` (docs/formats.md, *Bucket
checksums*).

The C++ core uses the CPU's ``crc32`` instruction where it has one. This twin works on whole
blocks at a time with numpy: the CRC register is linear over GF(2), so the register after a
message is the XOR of each block's register (computed from zero, all blocks side by side, one
byte column per step) shifted over the bytes that follow it (:func:`_shift`, four table lookups
per block). The bytes that do not fill a block go through the byte-at-a-time table.
"""

from __future__ import annotations

import ctypes
import threading
from functools import cache
from typing import Any

import numpy as np

from .common import U32_MAX

POLY = 0x82F63B78
_BLOCK = 1024
"""Bytes per block of the numpy path."""
_ROWS = 16384
"""Blocks per numpy pass (16 MiB of input in one transposed copy)."""
_MIN_BLOCKS = 8
"""Fewer whole blocks than this: the byte loop alone (the numpy set-up costs more)."""


def _byte_table() -> list[int]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        out.append(c)
    return out


_TABLE = _byte_table()
_NP_TABLE = np.array(_TABLE, dtype=np.uint32)


def crc32c(data: Any, value: int = 0) -> int:
    """The CRC-32C of ``data`` (``bytes``, ``bytearray`` or a C-contiguous ``memoryview``: its
    bytes), continuing from ``value``, the CRC of the bytes before it (``0``: none), as
    ``zlib.crc32`` continues: ``crc32c(b + c) == crc32c(c, crc32c(b))``. ``crc32c(b"123456789")``
    is ``0xE3069283``. ``TypeError`` for another type of ``data`` or a non-``int`` ``value``,
    ``ValueError`` for a non-contiguous view or a ``value`` outside ``0..2**32-1``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected bytes, bytearray or memoryview, got {type(data).__name__}")
    if isinstance(data, memoryview) and not data.c_contiguous:
        raise ValueError("expected a C-contiguous buffer")
    if type(value) is not int:
        raise TypeError(f"expected value as an int, got {type(value).__name__}")
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"value {value!r} is not a 32-bit CRC (0 to 4294967295)")
    raw = np.frombuffer(data, dtype=np.uint8) if len(memoryview(data)) else np.empty(0, np.uint8)
    reg = value ^ U32_MAX
    blocks = raw.size // _BLOCK
    if blocks >= _MIN_BLOCKS:
        reg = _blocks(reg, raw[: blocks * _BLOCK].reshape(blocks, _BLOCK))
        raw = raw[blocks * _BLOCK :]
    table = _TABLE
    for b in raw.tobytes():
        reg = table[(reg ^ b) & 0xFF] ^ (reg >> 8)
    return reg ^ U32_MAX


_MOST_GATHER_BYTES = 1 << 62
"""The most bytes `gather_crc` copies (each size and their sum)."""


def gather_crc(dest: Any, addresses: list[int], sizes: list[int]) -> int:
    """Copy ``sizes[i]`` bytes from each address ``addresses[i]``, in order, into ``dest`` (a
    ``bytearray`` or a writable C-contiguous ``memoryview``, exactly filled) and return the CRC-32C of
    ``dest`` (:func:`crc32c`). The C++ core copies and checksums piece by piece (each piece while it is
    in the cache) without the GIL.

    The caller vouches for the addresses: each ``[addresses[i], addresses[i] + sizes[i])`` is readable
    memory that stays allocated and unchanged during the call and does not overlap ``dest`` (the save
    passes the data addresses of plain contiguous CPU tensors it holds). Refused, before anything is
    copied: another type of ``dest`` (``TypeError``), a view that is not C-contiguous or is read-only
    (``ValueError``); ``addresses``/``sizes`` that are not lists (``TypeError``) or differ in length; an
    element that is not an ``int`` (``TypeError``), negative, an address beyond 64 bits or a size beyond
    ``2**62``, a zero address of a nonzero size, sizes adding up to more than ``2**62`` or to another
    count than ``dest``'s bytes (``ValueError``), each checked in that order, index by index."""
    view, pairs = _checked_gather(dest, addresses, sizes, "")
    _copy(view, pairs)
    return crc32c(view)


def gather_many(
    jobs: list[tuple[Any, list[int], list[int], bool]], claims: bytearray | None = None, from_end: bool = False
) -> list[int | None]:
    """`gather_crc` of each job ``(dest, addresses, sizes, checksum)`` of the list ``jobs`` in one call (the
    C++ core holds no GIL for all of them, where they copy 1 MiB or more), in order (``from_end``: from
    the last back); per job the CRC-32C of its ``dest`` where this call ran it and ``checksum`` is
    ``True``, else ``None``.

    ``claims`` (a ``bytearray`` of one byte per job, zeros at first) shares the jobs between calls on
    several threads: a call runs a job only where it turns the job's byte from 0 to 1 (atomically), so
    each job runs once, in whichever call claims it first (e.g. one thread's call from the first job on
    and another's ``from_end``); without ``claims`` every job runs.

    Every job is checked before anything is copied, as `gather_crc` checks it, each message after
    ``jobs[j]: ``; before that, ``jobs`` that is not a list; per job, one that is not a tuple
    (``TypeError``) or not of four items (``ValueError``) and a ``checksum`` that is not a ``bool``
    (``TypeError``); after the jobs, ``claims`` that is neither ``None`` nor a ``bytearray`` (``TypeError``)
    or not of ``len(jobs)`` bytes (``ValueError``), then ``from_end`` that is not a ``bool`` (``TypeError``)."""
    if type(jobs) is not list:
        raise TypeError(f"expected jobs as a list, got {type(jobs).__name__}")
    checked = []
    for j, job in enumerate(jobs):
        prefix = f"jobs[{j}]: "
        if type(job) is not tuple:
            raise TypeError(f"{prefix}expected a tuple, got {type(job).__name__}")
        if len(job) != 4:
            raise ValueError(f"{prefix}expected (dest, addresses, sizes, checksum), got {len(job)} items")
        dest, addresses, sizes, checksum = job
        if type(checksum) is not bool:
            raise TypeError(f"{prefix}expected checksum as a bool, got {type(checksum).__name__}")
        checked.append((*_checked_gather(dest, addresses, sizes, prefix), checksum))
    if claims is not None:
        if type(claims) is not bytearray:
            raise TypeError(f"expected claims as a bytearray or None, got {type(claims).__name__}")
        if len(claims) != len(jobs):
            raise ValueError(f"claims has {len(claims)} bytes for {len(jobs)} jobs")
    if type(from_end) is not bool:
        raise TypeError(f"expected from_end as a bool, got {type(from_end).__name__}")
    out: list[int | None] = [None] * len(checked)
    for j in reversed(range(len(checked))) if from_end else range(len(checked)):
        if claims is not None:
            with _CLAIMS:
                if claims[j]:
                    continue  # claimed by another call
                claims[j] = 1
        view, pairs, checksum = checked[j]
        _copy(view, pairs)
        if checksum:
            out[j] = crc32c(view)
    return out


_CLAIMS = threading.Lock()
"""Makes a claim (test and set of a job's byte) one step for the calls of `gather_many` on several threads."""


def _checked_gather(dest: Any, addresses: Any, sizes: Any, prefix: str) -> tuple[memoryview, list[tuple[int, int]]]:
    """`gather_crc`'s checks, in its order, each message after ``prefix``: ``(a view of dest, (address,
    size) pairs)``."""
    if not isinstance(dest, (bytearray, memoryview)):
        raise TypeError(f"{prefix}expected bytearray or memoryview, got {type(dest).__name__}")
    if isinstance(dest, memoryview):
        if not dest.c_contiguous:  # (a released view raises here)
            raise ValueError(f"{prefix}expected a C-contiguous buffer")
        if dest.readonly:
            raise ValueError(f"{prefix}expected a writable buffer")
    if type(addresses) is not list:
        raise TypeError(f"{prefix}expected addresses as a list, got {type(addresses).__name__}")
    if type(sizes) is not list:
        raise TypeError(f"{prefix}expected sizes as a list, got {type(sizes).__name__}")
    if len(sizes) != len(addresses):
        raise ValueError(f"{prefix}addresses and sizes differ in length ({len(addresses)} and {len(sizes)})")
    total = 0
    pairs = []
    for i in range(len(addresses)):
        address = _gather_int(addresses, i, "addresses", (1 << 64) - 1, prefix)
        n = _gather_int(sizes, i, "sizes", _MOST_GATHER_BYTES, prefix)
        if n and not address:
            raise ValueError(f"{prefix}addresses[{i}] is 0 for {n} bytes")
        total += n
        if total > _MOST_GATHER_BYTES:
            raise ValueError(f"{prefix}sizes add up to more than {_MOST_GATHER_BYTES} bytes")
        pairs.append((address, n))
    view = memoryview(dest)
    if total != view.nbytes:
        raise ValueError(f"{prefix}sizes add up to {total} bytes, the buffer has {view.nbytes}")
    return view, pairs


def _copy(view: memoryview, pairs: list[tuple[int, int]]) -> None:
    """Copy each ``(address, size)`` of ``pairs`` into ``view``, in order."""
    if view.nbytes:
        target = ctypes.c_char.from_buffer(view)
        base = ctypes.addressof(target)
        done = 0
        for address, n in pairs:
            ctypes.memmove(base + done, address, n)
            done += n
        del target


def _gather_int(items: list[Any], i: int, what: str, most: int, prefix: str) -> int:
    v = items[i]
    if type(v) is not int:
        raise TypeError(f"{prefix}expected {what}[{i}] as an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{prefix}{what}[{i}] is negative: {v!r}")
    if v > most:
        raise ValueError(f"{prefix}{what}[{i}] is too large: {v!r}")
    return v


def _blocks(reg: int, rows: np.ndarray) -> int:
    """The register after the blocks ``rows`` (``(n, _BLOCK)`` bytes), starting from ``reg``."""
    t0, t1, t2, t3 = _shift()
    for first in range(0, rows.shape[0], _ROWS):
        columns = np.ascontiguousarray(rows[first : first + _ROWS].T)  # (_BLOCK, n): one byte of every block per row
        state = np.zeros(columns.shape[1], dtype=np.uint32)
        for column in columns:
            state = _NP_TABLE[(state ^ column) & 0xFF] ^ (state >> 8)
        for s in state.tolist():
            reg = t0[reg & 0xFF] ^ t1[(reg >> 8) & 0xFF] ^ t2[(reg >> 16) & 0xFF] ^ t3[reg >> 24] ^ s
    return reg


@cache
def _shift() -> tuple[list[int], list[int], list[int], list[int]]:
    """The linear map "run ``_BLOCK`` zero bytes through the register", as four byte tables."""
    basis = []
    for bit in range(32):
        reg = 1 << bit
        for _ in range(_BLOCK):
            reg = _TABLE[reg & 0xFF] ^ (reg >> 8)
        basis.append(reg)
    tables = []
    for k in range(4):
        t = [0] * 256
        for v in range(1, 256):
            low = v & -v
            t[v] = t[v ^ low] ^ basis[8 * k + low.bit_length() - 1]
        tables.append(t)
    return tables[0], tables[1], tables[2], tables[3]
