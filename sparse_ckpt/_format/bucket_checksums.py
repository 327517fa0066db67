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

import torch

from .. import _backend
from ..errors import CheckpointFormatError

__all__ = ["CHECKSUMS_MAGIC", "CHECKSUMS_VERSION", "check_bucket", "split_checksums", "tensor_crc", "with_checksums"]

CHECKSUMS_MAGIC = b"SCKC"
CHECKSUMS_VERSION = 1
_TAIL = struct.Struct("<IH4s")
"""``u32 n_buckets | u16 version | magic``: the last bytes of the trailer."""


def tensor_crc(t: torch.Tensor, value: int = 0) -> int:
    """The CRC-32C of the bytes of tensor ``t`` (row-major; copied to the CPU first when it is not there);
    ``value``: the CRC-32C of the bytes before them (the result is then the CRC of both)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.reshape(-1)  # (a copy only when not contiguous)
    if flat.numel() == 0:
        return _backend.core.crc32c(b"", value)
    return _backend.core.crc32c(memoryview(flat.view(torch.uint8).numpy()), value)


def with_checksums(table: bytes, buckets: Sequence[torch.Tensor], crcs: Sequence[int] | None = None) -> bytes:
    """``table`` (a layout table) followed by the checksum trailer of ``buckets`` (in bucket order);
    ``crcs``: their CRC-32C where the caller computed them (`sparse_ckpt._save.worker`)."""
    if crcs is None:
        crcs = [tensor_crc(b) for b in buckets]
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
