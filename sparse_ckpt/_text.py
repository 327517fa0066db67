"""Text for messages and reports, written once: a list cut to its first few items, and an
exception in one line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["first_n", "one_line"]


def first_n(items: Sequence[Any], limit: int, *, more: str = " (+{n} more)", sep: str = ", ", show: Any = str) -> str:
    """The first ``limit`` of ``items`` (each through ``show``) joined by ``sep``, followed by
    ``more`` formatted with ``n``, the number left out, when some are (``more`` and ``sep`` set the
    wording: ``"a, b (+3 more)"``, ``"a, b and 3 more"``)."""
    shown = sep.join(show(item) for item in items[:limit])
    left = len(items) - limit
    return shown + more.format(n=left) if left > 0 else shown


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters)."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."
