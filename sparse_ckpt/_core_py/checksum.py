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
    if not isinstance(dest, (bytearray, memoryview)):
        raise TypeError(f"expected bytearray or memoryview, got {type(dest).__name__}")
    if isinstance(dest, memoryview):
        if not dest.c_contiguous:  # (a released view raises here)
            raise ValueError("expected a C-contiguous buffer")
        if dest.readonly:
            raise ValueError("expected a writable buffer")
    if type(addresses) is not list:
        raise TypeError(f"expected addresses as a list, got {type(addresses).__name__}")
    if type(sizes) is not list:
        raise TypeError(f"expected sizes as a list, got {type(sizes).__name__}")
    if len(sizes) != len(addresses):
        raise ValueError(f"addresses and sizes differ in length ({len(addresses)} and {len(sizes)})")
    total = 0
    pairs = []
    for i in range(len(addresses)):
        address = _gather_int(addresses, i, "addresses", (1 << 64) - 1)
        n = _gather_int(sizes, i, "sizes", _MOST_GATHER_BYTES)
        if n and not address:
            raise ValueError(f"addresses[{i}] is 0 for {n} bytes")
        total += n
        if total > _MOST_GATHER_BYTES:
            raise ValueError(f"sizes add up to more than {_MOST_GATHER_BYTES} bytes")
        pairs.append((address, n))
    view = memoryview(dest)
    if total != view.nbytes:
        raise ValueError(f"sizes add up to {total} bytes, the buffer has {view.nbytes}")
    if total:
        target = ctypes.c_char.from_buffer(view)
        base = ctypes.addressof(target)
        done = 0
        for address, n in pairs:
            ctypes.memmove(base + done, address, n)
            done += n
        del target
    return crc32c(view)


def _gather_int(items: list[Any], i: int, what: str, most: int) -> int:
    v = items[i]
    if type(v) is not int:
        raise TypeError(f"expected {what}[{i}] as an int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{what}[{i}] is negative: {v!r}")
    if v > most:
        raise ValueError(f"{what}[{i}] is too large: {v!r}")
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
