"""The bounds-checked byte reader of the Python core's decoders (group tables, layout tables).

Every read checks the remaining length first, and every count is checked against the remaining
bytes before anything is allocated; a defect is a :class:`CheckpointFormatError` saying where
(``{where}: {what} at byte {pos}``).
"""

from __future__ import annotations

import struct

from .errors import CheckpointFormatError

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


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
            raise self.fail(f"truncated {self.noun} reading {what} ({n} bytes wanted, {len(self.data) - self.pos} left)")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def header(self, magic: bytes, version: int, what: str) -> None:
        """The magic bytes and the u16 version that open a table (``what``: what the magic says it is)."""
        if self.take(len(magic), "magic") != magic:
            raise CheckpointFormatError(f"{self.where}: bad magic, not {what}")
        found = _U16.unpack(self.take(2, "version"))[0]
        if found != version:
            raise CheckpointFormatError(
                f"{self.where}: unsupported version {found} (this library reads version {version})"
            )

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u32(self, what: str) -> int:
        return _U32.unpack(self.take(4, what))[0]

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
        return tuple(_I64.unpack(self.take(8, what))[0] for _ in range(n))
