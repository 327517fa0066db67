"""The memory bound the library keeps to, written once."""

from __future__ import annotations

ITEM_BYTES = 256 << 20
"""256 MiB: the largest bucket a ``state_layout="buffers"`` save writes (unless one state chunk is
larger), hence a DCP load's extra memory (two buckets); and the tensor bytes the checkpoint tools
read per batch when they read every item."""
