"""The C++ core's ``plan_scatter`` alone (the scatter plan of every ``state_layout="buffers"`` load),
on synthetic layout tables shaped like the ``24x128:h64`` fixture: ``--params`` parameters (default
4 776), each with ``exp_avg`` and ``exp_avg_sq`` of shape ``(--dim, --dim)`` float32.

* ``whole``: one layout table holding every state tensor whole, loaded by a rank that holds every
  parameter whole (one op per state tensor);
* ``sharded``: two layout tables, each holding half of every state tensor along dim 0, loaded by
  a rank whose chunk is the whole parameter (two ops per state tensor).

Prints the median and minimum of ``--runs`` calls per case (one thread; the tables are built once).

    python -m bench.plan_scatter --runs 21
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sparse_ckpt import _core_py
from sparse_ckpt._layouts.bucketed import BUCKET_BYTES

KEYS = ("exp_avg", "exp_avg_sq")


def _fqns(n: int) -> list[str]:
    """``n`` MoE-like parameter names (128 experts of three weights per layer, then the rest)."""
    out = []
    for i in range(n):
        layer, rest = divmod(i, 199)
        if rest < 192:
            out.append(f"model.layers.{layer}.mlp.experts.{rest // 3}.w{rest % 3 + 1}.weight")
        else:
            out.append(f"model.layers.{layer}.attn.proj{rest - 192}.weight")
    return out


def tables(core: Any, params: int, dim: int, parts: int) -> tuple[list[bytes], Callable[[str], Any]]:
    """``parts`` layout tables, table ``p`` holding rows ``[p*dim/parts, (p+1)*dim/parts)`` of every
    state tensor, and the ``chunk_of`` of a rank that holds every parameter whole."""
    fqns = _fqns(params)
    rows = dim // parts
    out = []
    for p in range(parts):
        entries = [(fqn, key, "float32", 4, (dim, dim), (p * rows, 0), (rows, dim)) for fqn in fqns for key in KEYS]
        out.append(core.encode_layout("leaf", entries, BUCKET_BYTES)[0])
    whole = ((dim, dim), (0, 0), (dim, dim))
    return out, lambda fqn: whole


def median_ms(fn: Callable[[], Any], runs: int) -> tuple[float, float]:
    """Median and minimum wall time of ``fn()`` in ms over ``runs`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def main(argv: Sequence[str] | None = None) -> int:
    """Time ``plan_scatter`` on the ``whole`` and ``sharded`` cases; print one line per case."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=4776)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--backend", choices=("cpp", "python"), default="cpp")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    core = importlib.import_module("sparse_ckpt._C") if args.backend == "cpp" else _core_py
    for name, parts in (("whole", 1), ("sharded", 2)):
        layouts, chunk_of = tables(core, args.params, args.dim, parts)
        entries = 2 * args.params * parts
        med, best = median_ms(functools.partial(core.plan_scatter, "leaf", layouts, chunk_of), args.runs)
        print(
            f"{name:8s} {entries:6d} entries: median {med:8.3f} ms  min {best:8.3f} ms  "
            f"({med * 1e3 / entries:.3f} us/entry, {args.runs} runs, {args.backend})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
