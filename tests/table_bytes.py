"""Hand-built packed group tables, byte by byte, independent of the encoders under test.

Layout of a version-1 table (little endian)::

    table    := magic b"SCKT" | u16 version | u32 n_settings | settings* | u32 n_groups | group*
    settings := u32 n_entries | (str key | value)*
    group    := u32 settings_index | u32 n_fqns | str*
    str      := u32 byte_length | bytes
    value    := u8 tag | payload        (4: f64; 9: tensor -- str dtype | u32 ndim | i64 dim* |
                                         str device | u64 nbytes | data)

Every count and length defaults to the true one and can be overridden, to build tables that lie.
:func:`encode` and :func:`decode` call the *active* core (``sparse_ckpt._backend.core``, looked
up at call time, so the suite's ``core_backend`` fixture applies).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

from sparse_ckpt import _backend
from sparse_ckpt._format.tensor_parts import parts_to_tensor, tensor_to_parts

MAGIC = b"SCKT"
VERSION = 1


def u16(n: int) -> bytes:
    """``n`` as a little-endian unsigned 16-bit integer."""
    return struct.pack("<H", n)


def u32(n: int) -> bytes:
    """``n`` as a little-endian unsigned 32-bit integer."""
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    """``n`` as a little-endian unsigned 64-bit integer."""
    return struct.pack("<Q", n)


def i64(n: int) -> bytes:
    """``n`` as a little-endian signed 64-bit integer."""
    return struct.pack("<q", n)


def s(text: str | bytes, length: int | None = None) -> bytes:
    """A length-prefixed string (``str`` is UTF-8 encoded; ``bytes`` are taken as they are).

    ``length`` overrides the written length (a lying prefix).
    """
    raw = text.encode() if isinstance(text, str) else text
    return u32(len(raw) if length is None else length) + raw


def v_float(x: float) -> bytes:
    """A tagged float value (tag 4, f64 payload)."""
    return b"\x04" + struct.pack("<d", x)


def v_tensor(
    dtype: str | bytes = "float32",
    shape: Sequence[int] = (),
    data: bytes = b"\x00\x00\x80\x3f",
    *,
    ndim: int | None = None,
    nbytes: int | None = None,
    device: str | bytes = "cpu",
) -> bytes:
    """A tagged tensor value (tag 9); ``ndim`` and ``nbytes`` override the written counts.

    The default is a 0-d float32 ``1.0`` on the CPU.
    """
    body = b"\x09" + s(dtype) + u32(len(shape) if ndim is None else ndim) + b"".join(i64(d) for d in shape)
    return body + s(device) + u64(len(data) if nbytes is None else nbytes) + data


def settings(*pairs: tuple[str, bytes], n: int | None = None) -> bytes:
    """A settings blob from ``(key, encoded value)`` pairs; ``n`` overrides the entry count."""
    return u32(len(pairs) if n is None else n) + b"".join(s(k) + v for k, v in pairs)


def group(idx: int, fqns: Sequence[str | bytes], n: int | None = None) -> bytes:
    """A group: settings index ``idx`` and its parameter names; ``n`` overrides the name count."""
    return u32(idx) + u32(len(fqns) if n is None else n) + b"".join(s(f) for f in fqns)


def tab(
    setts: list[bytes],
    groups: list[bytes],
    *,
    n_settings: int | None = None,
    n_groups: int | None = None,
    version: int = VERSION,
    magic: bytes = MAGIC,
) -> bytes:
    """A table from encoded :func:`settings` and :func:`group` parts; counts can be overridden to lie."""
    return (
        magic
        + u16(version)
        + u32(len(setts) if n_settings is None else n_settings)
        + b"".join(setts)
        + u32(len(groups) if n_groups is None else n_groups)
        + b"".join(groups)
    )


def encode(leaf: str, groups: list[tuple[dict, list[str]]]) -> bytes:
    """The active core's ``encode_table`` of ``[(settings, fqns)]`` (tensors via ``tensor_to_parts``)."""
    return _backend.core.encode_table(leaf, groups, torch.Tensor, tensor_to_parts)


def decode(table: Any, leaf: str = "optim") -> Any:
    """The active core's ``decode_table`` of ``table`` (tensors via ``parts_to_tensor``)."""
    return _backend.core.decode_table(leaf, table, parts_to_tensor)
