"""How the bench's reports write a time and a size (``1.23 ms``, ``12.3 KiB``)."""

from __future__ import annotations


def fmt_time(seconds: float | None) -> str:
    """``1.23 ms``-style time (µs, ms or s)."""
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: int) -> str:
    """``12.3 KiB``-style size."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover
