"""Interpreter start with and without ``sparse-ckpt-run``'s environment, for a process that never imports torch.

``python -m bench.launcher_start [--repeats 20] [--code pass]`` (in a wheel:
``python -m sparse_ckpt.bench.launcher_start``).

Starts ``python -c CODE`` ``--repeats`` times in each environment, alternating (stock, prefixed,
stock, ...) so that a change in the machine's load hits both alike, and reports the median, the
quartiles and the difference of the medians. "prefixed" is the environment ``sparse-ckpt-run`` gives
its command (``sparse_ckpt.launcher.environment``: the hook's folder first on ``PYTHONPATH``), so
each start runs the hook's ``sitecustomize``, which installs the import finder and looks for a
``sitecustomize`` to chain to; the launcher's own start (one per job, before it ``exec``s the
command) is not part of it. The last lines say whether the hook's bytecode was cached (an installed
wheel has it; with ``PYTHONDONTWRITEBYTECODE=1`` and no cache each start compiles the hook, about
4 ms more) and whether the prefixed process imported torch or sparse_ckpt (it must not).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

from sparse_ckpt.launcher import environment
from sparse_ckpt.launcher.cli import SITE_DIR

PROBE = "import sys; print(int('torch' in sys.modules), int('sparse_ckpt' in sys.modules))"


def _start(env: dict[str, str], code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _row(name: str, times: list[float]) -> str:
    q = statistics.quantiles(times, n=4)
    median = statistics.median(times)
    return f"{name:<10} median {median * 1e3:7.1f} ms   quartiles {q[0] * 1e3:6.1f} / {q[2] * 1e3:6.1f} ms"


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run the measurement; print the table; return the medians in ms."""
    parser = argparse.ArgumentParser(prog="python -m bench.launcher_start", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="starts per environment (default: %(default)s)")
    parser.add_argument("--code", default="pass", help="what each interpreter runs (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="also print the medians as JSON")
    args = parser.parse_args(argv)
    stock = {k: v for k, v in os.environ.items() if not k.startswith("SPARSE_CKPT_")}
    prefixed = environment(stock)
    for env in (stock, prefixed):  # warm the file cache once
        _start(env, args.code)
    times: dict[str, list[float]] = {"stock": [], "prefixed": []}
    for _ in range(args.repeats):
        times["stock"].append(_start(stock, args.code))
        times["prefixed"].append(_start(prefixed, args.code))
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"python -c {args.code!r}: {args.repeats} starts each, alternated; {os.cpu_count()} CPUs, load average "
        f"{load:.2f}"
    )
    for name, values in times.items():
        print(_row(name, values))
    print(f"difference of the medians: {medians['prefixed'] - medians['stock']:+.1f} ms")
    cached = [
        os.path.exists(importlib.util.cache_from_source(os.path.join(SITE_DIR, f)))
        for f in ("sitecustomize.py", "_sparse_ckpt_run.py")
    ]
    print(f"hook bytecode cached: {all(cached)} ({SITE_DIR}/__pycache__)")
    imported = subprocess.run(
        [sys.executable, "-c", PROBE], env=prefixed, capture_output=True, text=True, check=True
    ).stdout.split()
    print(f"prefixed process imported torch: {imported[0] == '1'}, sparse_ckpt: {imported[1] == '1'}")
    if args.json:
        print(json.dumps({**medians, "difference": medians["prefixed"] - medians["stock"]}))
    return medians


if __name__ == "__main__":
    main()
