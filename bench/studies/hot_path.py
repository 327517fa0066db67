"""The in-memory hot path against the floor, alternated in one process: ``sparse_state_dict`` and
``load_sparse_state_dict`` (C++ core, packed format) against torch's own ``optimizer.state_dict()``
on one bench fixture (default ``61x256``, one group per parameter: 47 275 parameters, 23 851 with
state), the figures bench/README's *In-memory hot path* section gives.

Each round times the floor, the save and the load once each, in a rotating order (so a slow spell
of a shared machine falls on every method alike), with the collector paused as the bench does; a
load target is a fresh optimizer built untimed, and the loaded one is collected untimed after the
round. Printed: per method the median (min-max) of the wall and CPU seconds, and the median of the
per-round ratios save / floor and load / floor (the figures the targets are stated in).

    python -m bench.hot_path --rounds 21

``--names deepseek`` builds the same parameters under DeepSeek-V3's module names, one module deeper
(``model.layers.0.mlp.experts.5.gate_proj.weight``, ``model.layers.0.self_attn.q_proj.weight``), and
``--state-init step`` gets the state from one real AdamW step instead of filling it:

    python -m bench.hot_path --rounds 21 --names deepseek --state-init step

``--checks`` times each phase and check of a save and a load on its own (the functions below,
wrapped with a timer; min and median over ``--rounds`` calls), the per-call cost of each check;
``--profile save|load`` prints the cProfile of one call instead (sorted by ``--sort``, default
``tottime``); ``--instructions`` measures the instructions of one call of each method under
``valgrind --tool=callgrind`` (repeatable where wall time is not; each method in its own process,
torch imported and the fixture built under valgrind: minutes per method; needs a C compiler and
valgrind's ``callgrind.h`` for the client requests that bracket the call):

    PYTHONHASHSEED=0 python -m bench.hot_path --instructions
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import sparse_ckpt as sc

from .. import provenance
from ..suite.fixtures import NAME_STYLES, STATE_INITS, FixtureCache, gc_paused, parse_scales

METHODS = ("floor", "save", "load")


def _calls(fx: Any) -> dict[str, tuple[Callable[[Any], Any], Callable[[], Any] | None]]:
    sd = sc.sparse_state_dict(fx.model, fx.optimizer)
    return {
        "floor": (lambda _: fx.optimizer.state_dict(), None),
        "save": (lambda _: sc.sparse_state_dict(fx.model, fx.optimizer), None),
        "load": (lambda target: sc.load_sparse_state_dict(fx.model, target, sd), fx.new_optimizer),
    }


def _fixture(args: argparse.Namespace) -> Any:
    (scale,) = parse_scales(args.scale)
    names, state_init = getattr(args, "names", "bench"), getattr(args, "state_init", "fill")
    return FixtureCache(seed=args.seed, names=names, state_init=state_init).get(scale, args.layout)


def alternated(fx: Any, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of every method once, in rotating order; wall and CPU seconds per call."""
    calls = _calls(fx)
    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    for call, setup in calls.values():  # warm-up (kept FQN map built, caches filled)
        call(setup() if setup else None)
    for r in range(rounds):
        order = METHODS[r % 3 :] + METHODS[: r % 3]
        for m in order:
            call, setup = calls[m]
            with gc_paused():
                arg = setup() if setup else None
                c0, t0 = time.process_time(), time.perf_counter()
                call(arg)
                t1, c1 = time.perf_counter(), time.process_time()
            wall[m].append(t1 - t0)
            cpu[m].append(c1 - c0)
            del arg
        gc.collect()
    out: dict[str, Any] = {"wall": wall, "cpu": cpu}
    for kind, samples in (("wall", wall), ("cpu", cpu)):
        for m in ("save", "load"):
            out[f"{m}/floor {kind}"] = statistics.median(a / b for a, b in zip(samples[m], samples["floor"]))
    return out


def _print_alternated(res: dict[str, Any]) -> None:
    for kind in ("wall", "cpu"):
        for m in METHODS:
            s = res[kind][m]
            print(
                f"{kind:4} {m:5}: median {1e3 * statistics.median(s):7.1f} ms  "
                f"({1e3 * min(s):.1f}-{1e3 * max(s):.1f}, n={len(s)})"
            )
    for kind in ("wall", "cpu"):
        print(
            f"median per-round ratio ({kind}): save {res[f'save/floor {kind}']:.3f}x / load "
            f"{res[f'load/floor {kind}']:.3f}x the floor"
        )


def _write(res: dict[str, Any], args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    """The alternated run as JSON: samples per method, the median ratios, the fixture and machine."""
    import json
    import platform

    import torch

    cmd = " ".join(["python -m bench.hot_path", *(sys.argv[1:] if argv is None else argv)])
    data = {
        "command": cmd,
        "scale": args.scale,
        "layout": args.layout,
        "names": args.names,
        "state_init": args.state_init,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": sc.backend(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "samples_s": {"wall": res["wall"], "cpu": res["cpu"]},
        "ratios": {k: v for k, v in res.items() if "/floor" in k},
        "provenance": provenance.record(),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def profile(fx: Any, method: str, sort: str, limit: int) -> None:
    """cProfile of one call of ``method`` (after a warm-up call)."""
    import cProfile
    import pstats

    call, setup = _calls(fx)[method]
    call(setup() if setup else None)
    with gc_paused():
        arg = setup() if setup else None
        prof = cProfile.Profile()
        prof.enable()
        call(arg)
        prof.disable()
    pstats.Stats(prof).sort_stats(sort).print_stats(limit)


PHASES: dict[str, tuple[str, ...]] = {
    # (module, name) of what a save or a load runs: the core's passes and the Python checks
    "save": (
        "sparse_ckpt._save.save:build_fqn_map",
        "sparse_ckpt._save.save:capture_by_fqn",
        "core:claim_owners",
        "sparse_ckpt._save.save:_refuse_reserved",
        "core:flatten_packed_state",
        "sparse_ckpt._save.save:record_lists",
        "sparse_ckpt._save.save:encode_table",
        "sparse_ckpt._save.save:groups_tail",
        "sparse_ckpt._format.tags:items_record",
        "sparse_ckpt._format.tags:items_record_parts",
        "sparse_ckpt._format.tags:seal_parts",
        "sparse_ckpt._format.tags:seal",
    ),
    "load": (
        "sparse_ckpt._load.load:build_fqn_map",
        "sparse_ckpt._load.load:decode_checkpoint",
        "sparse_ckpt._load.decode:without_foreign_guards",
        "core:unflatten",
        "sparse_ckpt._load.decode:decode_group_tables",
        "sparse_ckpt._load.decode:check_table",
        "sparse_ckpt._load.decode:split_items_record",
        "sparse_ckpt._load.decode:table_fqns",
        "core:merge_table_settings",
        "sparse_ckpt._load.decode:merge_state",
        "sparse_ckpt._load.decode_state:decode_scalar_tables",
        "core:merge_scalars",
        "sparse_ckpt._load.decode_state:check_complete",
        "sparse_ckpt._load.decode_state:check_lists",
        "sparse_ckpt._load.decode:check_recorded_items",
        "sparse_ckpt._load.load:plan_leaf",
        "core:fqns_of_groups",
        "core:match_groups",
        "core:build_groups",
        "core:cast_states",
        "sparse_ckpt._load.load:_raise_on_mismatch",
        "sparse_ckpt._load.load:commit_prepared",
    ),
}


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def call(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into.append(time.perf_counter() - t0)

    return call


class _TimedCore:
    """The core backend with the functions ``names`` timed into ``times["core:<name>"]``."""

    def __init__(self, core: Any, names: set[str], times: dict[str, list[float]]) -> None:
        self._core, self._names, self._times = core, names, times

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._core, name)
        return _timed(fn, self._times[f"core:{name}"]) if name in self._names else fn


def checks(fx: Any, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of every function of :data:`PHASES` (and of the whole save / load)."""
    import importlib

    from sparse_ckpt import _backend

    calls = _calls(fx)
    out: dict[str, dict[str, list[float]]] = {}
    for method, names in PHASES.items():
        times: dict[str, list[float]] = {n: [] for n in (method, *names)}
        core_names = {n.split(":")[1] for n in names if n.startswith("core:")}
        patched: list[tuple[Any, str, Any]] = []
        for n in names:
            if n.startswith("core:"):
                continue
            mod_name, attr = n.split(":")
            mod = importlib.import_module(mod_name)
            patched.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, _timed(getattr(mod, attr), times[n]))
        saved_core = _backend.core
        _backend.core = _TimedCore(saved_core, core_names, times)
        try:
            call, setup = calls[method]
            call(setup() if setup else None)
            for v in times.values():
                v.clear()
            for _ in range(rounds):
                with gc_paused():
                    arg = setup() if setup else None
                    t0 = time.perf_counter()
                    call(arg)
                    times[method].append(time.perf_counter() - t0)
                del arg
                gc.collect()
        finally:
            _backend.core = saved_core
            for mod, attr, fn in patched:
                setattr(mod, attr, fn)
        out[method] = times
    return out


def _print_checks(res: dict[str, dict[str, list[float]]], rounds: int) -> None:
    for method, times in res.items():
        whole = statistics.median(times[method])
        print(f"{method}: median {1e3 * whole:.1f} ms per call (min {1e3 * min(times[method]):.1f}), {rounds} calls")
        for name, samples in times.items():
            if name == method or not samples:
                continue
            n = len(samples) // rounds  # calls per save / load
            per_call = [sum(samples[r * n : (r + 1) * n]) for r in range(rounds)]
            med = statistics.median(per_call)
            print(
                f"  {name:55} {n}x/call  median {1e3 * med:7.2f} ms  min {1e3 * min(per_call):7.2f} ms  "
                f"({100 * med / whole:4.1f}%)"
            )


_MARKER_C = """#include <valgrind/callgrind.h>
void sc_zero(void) { CALLGRIND_ZERO_STATS; }
void sc_dump(void) { CALLGRIND_DUMP_STATS_AT("one call"); }
"""
"""Callgrind client requests around the measured call: counters zeroed right before it and dumped
right after it (built by the system C compiler against valgrind's header)."""


def _marker(tmp: str) -> str:
    src, lib = os.path.join(tmp, "mark.c"), os.path.join(tmp, "libmark.so")
    with open(src, "w") as f:
        f.write(_MARKER_C)
    subprocess.run([os.environ.get("CC", "cc"), "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


def _one_call_under_callgrind(fx: Any, method: str, marker: str) -> None:
    mark = ctypes.CDLL(marker)
    call, setup = _calls(fx)[method]
    call(setup() if setup else None)
    with gc_paused():
        arg = setup() if setup else None
        mark.sc_zero()
        call(arg)
        mark.sc_dump()


def instructions(args: argparse.Namespace) -> dict[str, int]:
    """Instructions of one call of each method, each in its own process under callgrind."""
    out: dict[str, int] = {}
    env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.%p",
                sys.executable, "-m", "bench.hot_path", "--scale", args.scale, "--layout", args.layout,
                "--names", args.names, "--state-init", args.state_init,
                "--seed", str(args.seed), "--one-call", method, "--marker", _marker(tmp),
            ]  # fmt: skip
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            dumps = sorted(glob.glob(f"{tmp}/cg.*.1"))
            if not dumps:
                raise RuntimeError(f"callgrind wrote no dump for {method} (files: {os.listdir(tmp)})")
            with open(dumps[0]) as f:
                total = next(int(line.split()[1]) for line in f if line.startswith(("summary:", "totals:")))
            out[method] = total
            print(f"{method:5}: {total / 1e6:9.1f} M instructions", flush=True)
    if "floor" in out:
        for m in ("save", "load"):
            if m in out:
                print(f"{m}/floor: {out[m] / out['floor']:.3f}x (instructions)")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", default="61x256")
    p.add_argument("--layout", default="param", choices=("param", "layer"))
    p.add_argument("--names", default="bench", choices=tuple(NAME_STYLES), help="module names (fixtures.NAME_STYLES)")
    p.add_argument("--state-init", default="fill", choices=STATE_INITS, help="fill the state, or one real step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--profile", choices=METHODS)
    p.add_argument("--sort", default="tottime")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--checks", action="store_true", help="time each phase and check of a save and a load")
    p.add_argument("--instructions", action="store_true", help="one call of each method under callgrind")
    p.add_argument("--methods", default=",".join(METHODS), help="with --instructions: which methods")
    p.add_argument("--out", help="write the alternated run's samples and ratios as JSON here")
    p.add_argument("--one-call", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--marker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.instructions:
        instructions(args)
        return
    fx = _fixture(args)
    if args.one_call:
        _one_call_under_callgrind(fx, args.one_call, args.marker)
    elif args.checks:
        _print_checks(checks(fx, args.rounds), args.rounds)
    elif args.profile:
        profile(fx, args.profile, args.sort, args.limit)
    else:
        res = alternated(fx, args.rounds)
        _print_alternated(res)
        if args.out:
            _write(res, args, argv)


if __name__ == "__main__":
    main()
