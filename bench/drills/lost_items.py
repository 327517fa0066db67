"""Count the single-lost-item outcomes of every format: ``python -m bench.lost_items [--in-memory]``.

For each of 13 torch optimizers and each format of tests/load/lost_item_sweep.py (packed; flat
through ``SparseOptimizerState`` and a ``MultiOptimizer``; ``integrations.dsd``'s flat and nested
dicts, of one optimizer and of two), save a tiny checkpoint, remove each optimizer item alone from
its ``.metadata`` (``--in-memory``: from the dict, as DCP would store it) and load: ``refused``
(a sparse_ckpt error, the target untouched), ``exact``, ``silent`` (loaded, not what was saved) or
``raw`` (another exception). Prints a table per format and the totals, for the core backend
``SPARSE_CKPT_BACKEND`` selects. The test suite runs the same sweep (all of it in memory, some of it
through DCP: tests/load/test_every_format_complete.py); this is the whole of it through DCP, with
counts. It uses the tests' fixtures (tests/ on ``sys.path``)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[2] / "tests"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lost_items", description=__doc__.split("\n")[0])
    parser.add_argument("--in-memory", action="store_true", help="remove items from the dict, not from .metadata")
    parser.add_argument("--formats", default="", help="comma list (default: all)")
    parser.add_argument("--optimizers", default="", help="comma list (default: all)")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(_TESTS), str(_TESTS / "load")]
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import lost_item_sweep as sweep

    from sparse_ckpt import _backend

    formats = args.formats.split(",") if args.formats else list(sweep.FORMATS)
    names = args.optimizers.split(",") if args.optimizers else list(sweep.OPTIMIZERS)
    totals: dict[str, Counter[str]] = {}
    print(f"backend {_backend.NAME}, {'in memory' if args.in_memory else 'items removed from .metadata'}")
    for fmt in formats:
        totals[fmt] = Counter()
        for name in names:
            if args.in_memory:
                result = {".".join(map(str, k)): v for k, v in sweep.in_memory_outcomes(name, fmt).items()}
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    result = sweep.outcomes(name, fmt, Path(tmp))
            counts = Counter(v.split(":")[0] for v in result.values())
            totals[fmt].update(counts)
            odd = [k for k, v in result.items() if v.startswith(("silent", "raw"))]
            print(
                f"{fmt:18} {name:13} "
                + " ".join(f"{k}={counts[k]}" for k in ("refused", "exact", "silent", "raw"))
                + (f"  e.g. {odd[:3]}" if odd else ""),
                flush=True,
            )
    print()
    print("| format | items | refused | exact | silent | raw |")
    print("| --- | --- | --- | --- | --- | --- |")
    for fmt, c in totals.items():
        print(f"| {fmt} | {sum(c.values())} | {c['refused']} | {c['exact']} | {c['silent']} | {c['raw']} |")
    all_counts = sum(totals.values(), Counter())
    print(
        f"| all | {sum(all_counts.values())} | {all_counts['refused']} | {all_counts['exact']} | "
        f"{all_counts['silent']} | {all_counts['raw']} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
