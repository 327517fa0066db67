"""The flat format's save and load on a bench fixture:
``python -m bench.flat_format [--fixture 24x128] [--runs 9] [--calls save,load]``.

Times, per call (one warm-up, then ``--runs``), the CPU time of this process (``time.process_time``:
less disturbed than wall time by other jobs on a shared machine) and the wall time of:

* ``save``: ``sparse_state_dict(model, optimizer, format="flat")``;
* ``load``: ``load_sparse_state_dict(model, fresh, sd)`` into a fresh AdamW (built untimed);
* ``dcp.save``: ``dcp.save({"optim": SparseOptimizerState(model, optimizer, format="flat")})`` to a new
  directory; ``dcp.load``: the same into a fresh optimizer with ``SparseLoadPlanner``.

Prints medians and minimums. Run it on two checkouts (``PYTHONPATH=<checkout>``), alternating, to
compare them (bench/README.md, *Flat format: the key record*)."""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

import sparse_ckpt as sc
from sparse_ckpt import _backend

from ..suite.fixtures import FixtureCache, parse_fixture_specs


def _time(fn: Callable[[], Any], setup: Callable[[], Any] | None, runs: int) -> tuple[list[float], list[float]]:
    cpu: list[float] = []
    wall: list[float] = []
    for i in range(runs + 1):
        arg = setup() if setup is not None else None
        gc.collect()
        gc.disable()
        try:
            c0, w0 = time.process_time(), time.perf_counter()
            fn() if arg is None else fn(arg)  # type: ignore[call-arg]
            c1, w1 = time.process_time(), time.perf_counter()
        finally:
            gc.enable()
        if i:  # the first call is the warm-up
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
    return cpu, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flat_format", description=__doc__.split("\n")[0])
    parser.add_argument("--fixture", default="24x128")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--calls", default="save,load,dcp.save,dcp.load", help="comma list of the calls to time")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    spec = parse_fixture_specs(args.fixture)[0]
    fx = FixtureCache(hidden=spec.hidden, device="cpu", embed=spec.embed).get(spec.scale, "layer")
    model, opt = fx.model, fx.optimizer
    sd = sc.sparse_state_dict(model, opt, format="flat")
    tmp = Path(tempfile.mkdtemp(prefix="flat_format_"))
    try:
        saved = tmp / "saved"
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, format="flat")}, checkpoint_id=saved)
        counter = [0]

        def new_dir() -> Path:
            counter[0] += 1
            return tmp / f"s{counter[0]}"

        cases: dict[str, tuple[Callable[..., Any], Callable[[], Any] | None]] = {
            "save": (lambda: sc.sparse_state_dict(model, opt, format="flat"), None),
            "load": (lambda fresh: sc.load_sparse_state_dict(model, fresh, sd), fx.new_optimizer),
            "dcp.save": (
                lambda path: dcp.save(
                    {"optim": sc.SparseOptimizerState(model, opt, format="flat")}, checkpoint_id=path
                ),
                new_dir,
            ),
            "dcp.load": (
                lambda fresh: dcp.load(
                    {"optim": sc.SparseOptimizerState(model, fresh, format="flat")},
                    checkpoint_id=saved,
                    planner=sc.SparseLoadPlanner(),
                ),
                fx.new_optimizer,
            ),
        }
        print(
            f"flat format, fixture {spec.label}, {fx.n_params} params, {len(sd)} dict entries, backend "
            f"{_backend.NAME}, {args.runs} runs"
        )
        print("| call | CPU median | CPU min | wall median | wall min |")
        print("| --- | --- | --- | --- | --- |")
        for name, (fn, setup) in cases.items():
            if name not in args.calls.split(","):
                continue
            cpu, wall = _time(fn, setup, args.runs)
            print(
                f"| {name} | {statistics.median(cpu) * 1e3:.1f} ms | {min(cpu) * 1e3:.1f} ms | "
                f"{statistics.median(wall) * 1e3:.1f} ms | {min(wall) * 1e3:.1f} ms |",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
