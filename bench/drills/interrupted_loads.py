"""Interrupted-then-clean ``dcp.load`` trials: a Ctrl-C inside one load never breaks the next.

``python -m bench.interrupted_loads --trials 5000`` (``--backend python|cpp``, ``--seed``): each trial
arms a one-shot ``SIGALRM`` timer whose handler raises ``KeyboardInterrupt`` (what Ctrl-C's default
handler does) at a random moment of a ``dcp.load`` of a small model and its optimizer through
`sparse_ckpt.SparseOptimizerState` and `sparse_ckpt.SparseLoadPlanner`, then runs an uninterrupted
load into a fresh optimizer and compares its state and settings with the saved optimizer's. The
trials cycle through the formats and layouts (packed ``auto``, packed ``per_tensor``, flat). Prints
(and with ``--json`` writes) the counts: trials, interrupts that landed inside the load (DCP turns
one that lands inside its reads into a ``CheckpointException``; one raised inside a weakref
callback is swallowed by CPython and never reaches the load), clean loads that failed or were not
exact, and the time taken.

Before the fix, about 1 clean load in 300-600 failed with ``Missing key in checkpoint state_dict``:
an interrupt inside ``DefaultLoadPlanner.create_local_plan`` left DCP's module-wide flatten flag
(``torch.distributed.checkpoint._version._derived_version``) at ``"2_3"``, and the next load
flattened its target the way torch <= 2.3 did.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import sparse_ckpt as sc

from .. import provenance

VARIANTS = (("packed", "auto"), ("packed", "per_tensor"), ("flat", "auto"))
"""(format, state_layout) of the checkpoints the trials cycle through."""


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(4, 2))


def _stepped() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(0)
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.01}], lr=0.1)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.5})
    model(torch.randn(2, 8)).sum().backward()
    model[2].bias.grad = None  # a parameter without state
    opt.step()
    return model, opt


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(1)
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.3)
    opt.add_param_group({"params": model[2].parameters()})
    return model, opt


def _load(path: str, fmt: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    state = sc.SparseOptimizerState(model, opt, format=fmt)  # type: ignore[arg-type]
    dcp.load({"model": model.state_dict(), "optim": state}, checkpoint_id=path, planner=sc.SparseLoadPlanner())


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        for sa, sb in ((a["state"][i], b["state"][i]) for i in a["state"])
    )


class _Alarm:
    """The SIGALRM handler: raises ``KeyboardInterrupt`` while a load is in progress."""

    def __init__(self) -> None:
        self.inside = False
        self.landed = 0

    def __call__(self, _signum: int, _frame: Any) -> None:
        if self.inside:
            self.landed += 1
            self.inside = False
            raise KeyboardInterrupt


def run(trials: int, seed: int = 0, out: Any = sys.stdout) -> dict[str, Any]:
    """``trials`` interrupted-then-clean loads; returns the counts (see the module doc)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model, opt = _stepped()
    expected = opt.state_dict()
    root = tempfile.mkdtemp(prefix="interrupted_loads_")
    paths = {}
    for fmt, layout in VARIANTS:
        paths[fmt, layout] = os.path.join(root, f"{fmt}-{layout}")
        state = sc.SparseOptimizerState(model, opt, format=fmt, state_layout=layout)  # type: ignore[arg-type]
        dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=paths[fmt, layout])
    m, o = _fresh()
    t0 = time.perf_counter()
    for _ in range(10):
        _load(paths[VARIANTS[0]], "packed", m, o)
    per_load = (time.perf_counter() - t0) / 10
    rng = random.Random(seed)
    alarm = _Alarm()
    previous = signal.signal(signal.SIGALRM, alarm)
    failures: list[str] = []
    started = time.perf_counter()
    try:
        for i in range(trials):
            fmt, layout = VARIANTS[i % len(VARIANTS)]
            path = paths[fmt, layout]
            m, o = _fresh()
            alarm.inside = True
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.2 * per_load))
                _load(path, fmt, m, o)
                deadline = time.perf_counter() + 4 * per_load
                while alarm.inside and time.perf_counter() < deadline:
                    pass  # not landed inside the load: landed here (not counted), or swallowed
            except (KeyboardInterrupt, dcp.api.CheckpointException):
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                alarm.inside = False
            m, o = _fresh()
            try:
                _load(path, fmt, m, o)
                if not _same(o.state_dict(), expected):
                    failures.append(f"trial {i} ({fmt}, {layout}): the clean load is not exact")
            except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - counted and reported
                failures.append(
                    f"trial {i} ({fmt}, {layout}): {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
                )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - started
    result = {
        "trials": trials,
        "landed_inside_load": alarm.landed,
        "clean_load_failures": len(failures),
        "failures": failures[:20],
        "seconds": round(elapsed, 1),
        "per_load_s": per_load,
        "backend": sc._backend.core.__name__ if hasattr(sc, "_backend") else "",
        "variants": [list(v) for v in VARIANTS],
    }
    print(
        f"{trials} trials ({alarm.landed} interrupts landed inside a load), {len(failures)} clean loads failed, "
        f"{elapsed:.1f} s",
        file=out,
    )
    for line in failures[:20]:
        print("  " + line, file=out)
    return result


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--trials N --seed S --json PATH``; exit status 1 when a clean load failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the counts here")
    args = parser.parse_args(argv)
    result = run(args.trials, args.seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "provenance": provenance.record()}, f, indent=1)
    return 1 if result["clean_load_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
