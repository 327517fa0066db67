"""Pause Python's cyclic garbage collector around a whole save or load, thread- and interrupt-safely.

A save or load allocates O(P) containers that are never garbage; with the collector running,
its generational passes rescan the growing heap many times per call, which at 10^5 parameters
costs more than the work itself. The pause nests and is shared between threads: the collector
is re-enabled only when the last pause in progress (in any thread) ends, and only if it was
enabled when the first of them began, so concurrent calls can never leave it disabled.

A ``KeyboardInterrupt`` (or any exception) arriving at any point must not leave the collector
disabled or the lock held. How that is ensured (CPython 3.11 ``sys.settrace`` line events and
signal handlers, measured; see tests/safety/test_interrupt_safety.py):

* Each pause is a token in ``_active``; ending a pause is idempotent (the first call for a token
  does the work, later calls do nothing), and the last step of an end is the token's removal, so
  an end interrupted half-way is simply completed by the next one. Every pause is ended twice,
  ``try: end`` / ``finally: end``, so an interrupt inside the first end still runs the second.
* The ``try:`` of that pair is written on the same line as its body: a separate ``try:`` line
  gets a line event *before* the protected range begins (an interrupt there would skip both
  ends); on one line the compiler drops the ``try``'s NOP and the first event is protected.
* The lock is taken only as ``with _lock: call()`` on one line: a multi-line ``with`` gets a
  second line event on the ``with`` line *after* its body and *before* the lock's ``__exit__``
  runs, and an interrupt there leaves the lock held. On one line no event falls between acquire
  and release; an interrupt inside ``call()`` unwinds through the ``with``, which releases.
* Signal handlers run only between bytecodes (after calls, at function entry, on backward
  jumps). An interrupt at the entry of ``contextlib``'s ``__enter__``/``__exit__``, outside every
  frame of ours, leaves the generator suspended at its ``yield``; CPython closes it when the
  context manager is freed (when the exception's traceback is dropped), which runs the
  ``finally`` and ends the pause.
"""

from __future__ import annotations

import gc
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.RLock()  # reentrant: a finalizer ending a pause can never deadlock its own thread
_active: set[int] = set()
"""Tokens of the pauses in progress, in every thread."""
_restore = [False]
"""Whether the collector was enabled when the first pause in progress began."""
_tokens = itertools.count()


def _begin_locked(token: int) -> None:
    """Register ``token`` and disable the collector (``_lock`` held).

    Stopped after any line, the state is still consistent: the recorded setting is only read
    while a token is registered, and a registered token is unregistered by :func:`_end_locked`.
    """
    if not _active:
        _restore[0] = gc.isenabled()
    _active.add(token)
    gc.disable()


def _end_locked(token: int) -> None:
    """End pause ``token`` once (``_lock`` held); a call for an ended or unknown token does nothing.

    The last pause re-enables the collector if it was enabled before the first began; the token
    is removed last, so an end stopped before that is redone in full by the next call.
    """
    if token in _active:
        if len(_active) == 1 and _restore[0]:
            gc.enable()
        _active.discard(token)


def _begin(token: int) -> None:
    """:func:`_begin_locked` under the lock."""
    # keep on one line: no line event between acquire and release
    with _lock: _begin_locked(token)  # fmt: skip


def _end(token: int) -> None:
    """:func:`_end_locked` under the lock."""
    # keep on one line: no line event between acquire and release
    with _lock: _end_locked(token)  # fmt: skip


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic GC for the duration of the block (nesting-, thread- and interrupt-safe).

    On exit the collector's setting is what it was before the first pause in progress began,
    once no other pause (in any thread) is in progress.
    """
    token = next(_tokens)
    try:
        _begin(token)
        yield
    finally:
        # body on the try's line: its line event is protected
        try: _end(token)  # fmt: skip
        # idempotent: completes an end the first did not finish
        finally: _end(token)  # fmt: skip


def pauses_in_progress() -> int:
    """How many pauses are in progress in all threads (0 whenever no save or load is running)."""
    return len(_active)
