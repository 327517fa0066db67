"""How the bench times one method: a warm-up call, then up to ``repeats`` samples within a budget,
each with fresh untimed set-up, the collector off while timing (like ``timeit``)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any, Optional

from .fixtures import gc_paused

Runner = tuple[Callable[[Any], Any], Optional[Callable[[], Any]]]  # Optional, not "| None": evaluated on import (3.9)
"""``(call, setup)``: ``call(setup())`` is timed; ``setup`` (untimed) may be ``None``."""


def _timed(call: Callable[[Any], Any], arg: Any, inner: int, sync: Callable[[], None], gc_off: bool) -> float:
    # Like timeit: no collection inside the timed region (and no gc.collect() here, which takes
    # ~1 s with torch's object graph loaded).
    with gc_paused() if gc_off else contextlib.nullcontext():
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            call(arg)
        sync()
        return (time.perf_counter() - t0) / inner


def time_method(
    runner: Runner,
    *,
    repeats: int,
    budget_s: float,
    sync: Callable[[], None] = lambda: None,
    gc_off: bool = True,
    min_sample_s: float = 0.005,
) -> dict[str, Any]:
    """Warm up once, then time up to ``repeats`` calls; return median/min/max/n and the samples.

    Calls without per-sample set-up that take less than ``min_sample_s`` are repeated inside one
    sample (``inner`` calls, the sample being their mean). When the warm-up shows that
    ``repeats`` samples would exceed ``budget_s``, fewer are taken (at least one); when the
    warm-up alone exceeds ``budget_s``, it is the only sample (``warmup_included``).
    """
    call, setup = runner

    def prepare() -> Any:
        if setup is None:
            return None
        with gc_paused():  # untimed; a fresh 616 000-group optimizer takes 9x longer with the collector on
            return setup()

    warm = _timed(call, prepare(), 1, sync, gc_off)
    inner = 1
    if setup is None and warm < min_sample_s:
        inner = max(1, min(10_000, int(min_sample_s / max(warm, 1e-9))))
    out: dict[str, Any] = {"status": "ok", "warmup_s": warm, "inner": inner, "repeats_requested": repeats}
    if warm >= budget_s:
        samples = [warm]
        out["warmup_included"] = True
        out["note"] = f"one call took {warm:.1f} s >= budget {budget_s:g} s: the warm-up is the only sample"
    else:
        n = min(repeats, max(1, int(budget_s // max(warm, 1e-9))))
        if n < repeats:
            out["note"] = f"{n} of {repeats} repeats (budget {budget_s:g} s)"
        samples = [_timed(call, prepare(), inner, sync, gc_off) for _ in range(n)]
    out.update(summarize(samples))
    return out


def summarize(samples: list[float]) -> dict[str, Any]:
    """``median_s``, ``min_s``, ``max_s``, ``n`` and the ``samples_s`` themselves."""
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "n": len(samples),
        "samples_s": samples,
    }
