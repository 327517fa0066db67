"""*Bucket checksums* (docs/formats.md, *Bucket checksums*): the CRC-32C of each bucket of a
buffers-layout leaf, carried in the leaf's layout item after its layout table and under its seal.

A bucket is bytes sparse_ckpt lays out itself (many state tensors in one item): the zip records of
its ``torch.save`` archive check their headers, not its data, so a damaged byte of a bucket would
load as a wrong value of some state tensor. The save writes each bucket's CRC-32C (the core's
``crc32c``) after the layout table; every reader of a bucket (a load, the tools) checks it.
Layout items written before the checksums (no trailer) load as before, unchecked.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache

import torch

from .. import _backend
from ..errors import CheckpointFormatError

__all__ = [
    "CHECKSUMS_MAGIC",
    "CHECKSUMS_VERSION",
    "check_bucket",
    "crc_combine",
    "split_checksums",
    "tensor_crc",
    "with_checksums",
]

CHECKSUMS_MAGIC = b"SCKC"
CHECKSUMS_VERSION = 1
_TAIL = struct.Struct("<IH4s")
"""``u32 n_buckets | u16 version | magic``: the last bytes of the trailer."""


def tensor_crc(t: torch.Tensor) -> int:
    """The CRC-32C of the bytes of tensor ``t`` (row-major; copied to the CPU first when it is not there)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.reshape(-1)  # (a copy only when not contiguous)
    if flat.numel() == 0:
        return _backend.core.crc32c(b"")
    return _backend.core.crc32c(memoryview(flat.view(torch.uint8).numpy()))


def with_checksums(table: bytes, crcs: Sequence[int]) -> bytes:
    """``table`` (a layout table) followed by the checksum trailer of its buckets' CRC-32C ``crcs`` (in
    bucket order; `tensor_crc` of each, computed by the capture: `sparse_ckpt._save.worker.CaptureWorker.crcs`)."""
    return b"".join(
        (table, struct.pack(f"<{len(crcs)}I", *crcs), _TAIL.pack(len(crcs), CHECKSUMS_VERSION, CHECKSUMS_MAGIC))
    )


def split_checksums(leaf: str, key: str, payload: bytes) -> tuple[bytes, tuple[int, ...] | None]:
    """A layout item's unsealed bytes as ``(layout table, each bucket's CRC-32C)``; ``None`` for an
    item written without checksums. A trailer of another version or whose count does not fit the
    bytes is a `CheckpointFormatError` naming leaf and key."""
    if len(payload) < _TAIL.size or payload[-4:] != CHECKSUMS_MAGIC:
        return payload, None
    n, version, _magic = _TAIL.unpack_from(payload, len(payload) - _TAIL.size)
    if version != CHECKSUMS_VERSION:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: layout {key!r} has bucket checksums of version {version} (this library reads version "
            f"{CHECKSUMS_VERSION}); load it with the sparse_ckpt that wrote it"
        )
    start = len(payload) - _TAIL.size - 4 * n
    if start < 0:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: layout {key!r} claims {n} bucket checksums in {len(payload)} bytes"
        )
    return payload[:start], struct.unpack_from(f"<{n}I", payload, start)


def check_bucket(leaf: str, key: str, buf: torch.Tensor, bucket: int, crcs: tuple[int, ...] | None) -> None:
    """Bucket ``bucket`` (item ``key``) has the CRC-32C its layout recorded (nothing to check when
    ``crcs`` is ``None``: written without checksums); else a `CheckpointFormatError` naming it."""
    if crcs is None:
        return
    if bucket >= len(crcs):
        raise CheckpointFormatError(
            f"leaf {leaf!r}: buffer item {key!r} is bucket {bucket}, its layout records {len(crcs)} bucket checksums "
            "(a damaged or edited checkpoint)"
        )
    got = tensor_crc(buf)
    if got != crcs[bucket]:
        raise CheckpointFormatError(
            f"leaf {leaf!r}: buffer item {key!r} fails its CRC-32C check (computed {got:08x}, its layout records "
            f"{crcs[bucket]:08x}): a damaged, truncated or partly copied checkpoint; nothing was loaded into the "
            "optimizer"
        )


_POLY = 0x82F63B78  # CRC-32C, reflected


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x) mod P(x)`` in the reflected bit order of the CRC (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    out, p = [], 1 << 30  # x^1
    for _ in range(64):
        out.append(p)
        p = _multmodp(p, p)
    return tuple(out)


_X2N = _x2n_table()
"""``x^(2^k) mod P(x)`` for k = 0..63 (lengths below 2**61 bytes; the table does not cycle after 32
entries as zlib's does: the order of x modulo the CRC-32C polynomial does not divide 2**32 - 1)."""


def crc_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc1`` (of ``A``), ``crc2`` (of ``B``) and ``len(B)`` in bytes
    (zlib's ``crc32_combine`` for this polynomial): two parts of a bucket checksummed apart, by two
    threads, give the bucket's CRC."""
    return _multmodp(_shift_by(len2), crc1) ^ crc2


@lru_cache(maxsize=64)
def _shift_by(len2: int) -> int:
    """``x^(8 * len2) mod P(x)``: what `crc_combine` multiplies the first CRC by (kept for the few lengths
    a save combines again and again, e.g. its pieces of one size)."""
    p, n, k = 1 << 31, len2, 3  # x^0; x^(8 * len2) = product of x^(2^k) over the bits of len2, from k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k], p)
        n >>= 1
        k += 1
    return p
