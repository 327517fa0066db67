"""Shared helpers of the Python core, twin of csrc/common.cpp and csrc/common.hpp: the table
codec's constants, the little-endian structs, :func:`len32` and the bounds-checked :class:`Reader`
of the decoders (group tables, layout tables).

The core's input contract (narrow on purpose: the library checks and converts user data once, at
the Python boundary -- ``capture`` checks what post-hooks and adapters return, ``decode`` turns
any mapping into a dict -- before it reaches the core):

  * sequences (param groups, ``params``, FQN lists, ``groups_fqn``, tensor shapes) are lists or
    tuples; pairs and triples (``(settings, fqns)``, ``(index, fqns)``, ``(raw, fqn, param)``,
    what ``to_parts`` returns) are tuples of exactly that length;
  * mappings are dicts; a dict subclass (``optimizer.state``'s ``defaultdict``, an
    ``OrderedDict`` in a state or a group) is read as a dict, in its storage order, without
    calling its own methods (the Python twin uses ``dict.items(d)`` where one can arrive);
  * tables and tensor data are ``bytes``; keys, FQNs, leaf, dtype and device names are ``str``
    (the codec raises its own :class:`CheckpointFormatError` for a non-str key or FQN); tensor
    dimensions are 64-bit ints.

Outside it the C++ core raises ``TypeError``/``ValueError`` (``expected ..., got ...``) and never
reads the input another way; the Python twin does what Python does. One function reads Python's
protocols on purpose: ``map_parameters`` walks ``_parameters``/``_modules`` mappings that are not
exact dicts through their own ``items()``, as torch's ``named_parameters`` does.

Vocabulary:
  * ``groups_fqn``: ``list[tuple[dict, list[str]]]`` -- one ``(settings, fqns)`` per param group,
    ``settings`` being the group without its ``"params"`` entry.
  * ``state_fqn``: ``dict[str, dict]`` -- per-parameter optimizer state keyed by FQN.
  * A *table* is the binary encoding of a leaf's ``groups_fqn``; its format is specified in
    docs/formats.md ("Table codec").

Every read of :class:`Reader` checks the remaining length first, and every count is checked
against the remaining bytes before anything is allocated; a defect is a
:class:`CheckpointFormatError` saying where (``{where}: {what} at byte {pos}``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from .errors import CheckpointFormatError

MAGIC = b"SCKT"
VERSION = 1
MAX_DEPTH = 32
MAX_ITEMSIZE = 16
"""The largest dtype item size (bytes) a table or layout records (complex128)."""

U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
U64 = struct.Struct("<Q")
F64 = struct.Struct("<d")
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
U32_MAX = 2**32 - 1

TensorToParts = Callable[[Any], tuple[str, tuple[int, ...], str, bytes]]
PartsToTensor = Callable[[str, tuple[int, ...], str, bytes], Any]
ScalarParts = Callable[[Any], "tuple[str, tuple[int, ...], str, bytes] | None"]


def utf8(text: str, where: str) -> bytes:
    """``text`` as UTF-8; text UTF-8 cannot encode (a lone surrogate) is a :class:`CheckpointFormatError`
    ``f"{where}: string is not valid unicode (...)"``."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CheckpointFormatError(f"{where}: string is not valid unicode ({exc.reason})") from None


def len32(n: int) -> bytes:
    """A length as u32; one the table format cannot hold is a :class:`CheckpointFormatError`."""
    if n > U32_MAX:
        raise CheckpointFormatError(f"length {n} does not fit the table format (at most {U32_MAX})")
    return U32.pack(n)


class Reader:
    """Reads ``data`` from the start; ``noun`` names what is read in truncation messages."""

    __slots__ = ("data", "noun", "pos", "where")

    def __init__(self, data: bytes, where: str, noun: str = "table") -> None:
        self.data = data
        self.pos = 0
        self.where = where
        self.noun = noun

    def fail(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.where}: {what} at byte {self.pos}")

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise self.fail(
                f"truncated {self.noun} reading {what} ({n} bytes wanted, {len(self.data) - self.pos} left)"
            )
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def header(self, magic: bytes, version: int, what: str, oldest: int | None = None) -> int:
        """The magic bytes and the u16 version that open a table (``what``: what the magic says it
        is); versions ``oldest`` (default: ``version``) to ``version`` are read. Returns the version."""
        if self.take(len(magic), "magic") != magic:
            raise CheckpointFormatError(f"{self.where}: bad magic, not {what}")
        found = U16.unpack(self.take(2, "version"))[0]
        first = version if oldest is None else oldest
        if not first <= found <= version:
            reads = f"version {version}" if first == version else f"versions {first} to {version}"
            raise CheckpointFormatError(f"{self.where}: unsupported version {found} (this library reads {reads})")
        return found

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u32(self, what: str) -> int:
        return U32.unpack(self.take(4, what))[0]

    def count(self, what: str, min_item_size: int) -> int:
        n = self.u32(what)
        if n * min_item_size > len(self.data) - self.pos:
            raise self.fail(f"{what} claims {n} entries but only {len(self.data) - self.pos} bytes are left")
        return n

    def string(self, what: str) -> str:
        n = self.u32(what)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid utf-8") from None

    def dims(self, n: int, what: str) -> tuple[int, ...]:
        """``n`` little-endian int64 values."""
        return tuple(I64.unpack(self.take(8, what))[0] for _ in range(n))
