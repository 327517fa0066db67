"""What the README's test commands sample and CI runs in full (tests/README.md).

``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1``, which .ci/run sets for the full suite, turns every sample into
the whole: the interrupt sweeps interrupt every line event, all three launcher drills run, each with
the stock launcher, the Ray Train drill runs, the multi-rank and CLI tests run on both core backends,
the wheel is built and run (``packaging/test_wheel_bench.py``) and the lost-item and damaged-file
sweeps of ``load/`` run every case (`sample`). Each sampling module
says what its default run leaves to CI.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import pytest

EXHAUSTIVE = os.environ.get("SPARSE_CKPT_EXHAUSTIVE_SWEEPS") == "1"
"""``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1`` (.ci/run sets it): run in full what the default run samples."""

T = TypeVar("T")

SAMPLE_RATE = 0.2
"""The share of a sweep's other cases `sample` keeps by default (seeded: the same cases every run)."""


def sample(cases: Sequence[T], seed: str, kind: Callable[[T], Hashable] = lambda _case: None) -> list[T]:
    """The cases (in their order) a sweep runs: all of them when `EXHAUSTIVE`; else the first, the last,
    the first of every ``kind``, and a `SAMPLE_RATE` share of the rest drawn from ``random.Random(seed)``."""
    if EXHAUSTIVE or len(cases) <= 2:
        return list(cases)
    keep = {0, len(cases) - 1}
    kinds: set[Hashable] = set()
    for i, case in enumerate(cases):
        if (k := kind(case)) not in kinds:
            kinds.add(k)
            keep.add(i)
    rest = [i for i in range(len(cases)) if i not in keep]
    keep.update(random.Random(seed).sample(rest, round(len(rest) * SAMPLE_RATE)))
    return [cases[i] for i in sorted(keep)]


def params(cases: Sequence[tuple[Any, ...]], seed: str, kind: Callable[[Any], Hashable]) -> list[Any]:
    """``cases`` as ``pytest.mark.parametrize`` values, each one `sample` leaves out skipped with a
    reason naming CI: every run collects the same cases, the default run runs the sample."""
    picked = set(sample(cases, seed, kind))
    skip = pytest.mark.skip(reason="CI runs it (SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1, tests/_sampling.py)")
    return [case if case in picked else pytest.param(*case, marks=skip) for case in cases]
