"""Where one ``sparse_state_dict(..., state_layout="buffers")`` call (what ``dcp.save`` of a
``SparseOptimizerState`` runs) spends its time, per phase, on a bench fixture (default
``24x128:h64``: AdamW, 4 776 parameters, 9 552 state tensors of 64x64 float32): the core's
``map_parameters``, ``flatten_packed_state`` and ``encode_layout``, and ``bucketed.collect`` and
``bucketed.fill`` (the copy into the buckets), each timed around its calls.

Prints the median and minimum of ``--runs`` calls (one thread, after one warm-up call).

    python -m bench.save_phases --runs 15
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from sparse_ckpt import _backend, _fqn, sparse_state_dict
from sparse_ckpt._layouts import bucketed

from ..suite.fixtures import FixtureCache, parse_fixture_specs

CORE_PHASES = ("flatten_packed_state", "encode_layout")


def _timed(fn: Callable[..., Any], times: list[float]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t0)

    return call


class _TimedCore:
    """The core backend with the functions of :data:`CORE_PHASES` timed."""

    def __init__(self, core: Any, times: dict[str, list[float]]) -> None:
        self._core = core
        self._times = times

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._core, name)
        return _timed(fn, self._times[name]) if name in CORE_PHASES else fn


@contextlib.contextmanager
def timed_phases() -> Iterator[dict[str, list[float]]]:
    """Time every phase's calls while inside (the seconds of each call, per phase)."""
    times: dict[str, list[float]] = {name: [] for name in ("map_parameters", *CORE_PHASES, "collect", "fill")}
    saved = (_fqn.map_parameters, bucketed.collect, bucketed.fill, _backend.core)
    _fqn.map_parameters = _timed(saved[0], times["map_parameters"])
    bucketed.collect = _timed(saved[1], times["collect"])
    bucketed.fill = _timed(saved[2], times["fill"])
    _backend.core = _TimedCore(saved[3], times)
    try:
        yield times
    finally:
        _fqn.map_parameters, bucketed.collect, bucketed.fill, _backend.core = saved


def main(argv: Sequence[str] | None = None) -> int:
    """Time ``sparse_state_dict(state_layout="buffers")`` and its phases; print one line each."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="24x128:h64")
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = parse_fixture_specs(args.fixture)[0]
    fx = FixtureCache(hidden=spec.hidden, device="cpu", embed=spec.embed).get(spec.scale, "layer")
    sparse_state_dict(fx.model, fx.optimizer, state_layout="buffers")  # warm-up
    total: list[float] = []
    with timed_phases() as times:
        for _ in range(args.runs):
            t0 = time.perf_counter()
            sparse_state_dict(fx.model, fx.optimizer, state_layout="buffers")
            total.append(time.perf_counter() - t0)
    print(f"{args.fixture}, {_backend.backend()} core, {args.runs} runs (ms: median, min)")
    for name, values in {"total": total, **times}.items():
        if values:
            print(
                f"  {name:22s} {statistics.median(values) * 1e3:8.2f} {min(values) * 1e3:8.2f}  ({len(values)} calls)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
