"""Pause Python's cyclic garbage collector around a whole save or load, thread-safely.

A save or load allocates O(P) containers that are never garbage; with the collector running,
its generational passes rescan the growing heap many times per call, which at 10^5 parameters
costs more than the work itself. The pause nests and is shared between threads: the collector
is re-enabled only when the outermost pause ends, and only if it was enabled when the first one
began, so concurrent calls can never leave it disabled.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_reenable = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic GC for the duration of the block (nesting- and thread-safe)."""
    global _depth, _reenable
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _reenable:
                gc.enable()
