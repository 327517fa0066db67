"""Command line of the bench: ``python bench/run.py`` or ``python -m bench`` (DESIGN §8).

Measures, for synthetic MoE AdamW optimizers, the floor (``optimizer.state_dict()`` /
``load_state_dict``), ``sparse_state_dict`` / ``load_sparse_state_dict`` (both core backends,
both formats), torch DSD get/set, DCP save/load of the resulting dicts and the core functions
alone. Writes ``results.json``, ``results.md`` and ``scaling.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

if __package__ in (None, ""):  # ``python bench/run.py``: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import sparse_ckpt
from bench import report
from bench.fixtures import LAYOUTS, STATE_INITS, FixtureCache, Scale, parse_scales
from bench.measure import (
    FixtureContext,
    Method,
    backend_modules,
    device_sync,
    dsd_sparse_roundtrip_probe,
    plan_methods,
    runner_for,
    silence_known_warnings,
    time_method,
    use_backend,
)

DEFAULT_SCALES = "8x64,24x128,61x256"
QUICK_SCALES = "2x8,4x16"
QUICK_REPEATS = 3
QUICK_DSD_MAX_PARAMS = 10_000
QUICK_BUDGET_S = 2.0
QUICK_DCP_MAX_ITEMS = 1_500
DEFAULT_DCP_MAX_ITEMS = 150_000
DEFAULT_BUDGET_S = 60.0
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


class DeviceUnavailable(RuntimeError):
    """The requested ``--device`` cannot be used on this machine."""


def check_device(name: str) -> None:
    """Import what ``name`` needs and make sure one such device is present."""
    if name == "cpu":
        return
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable("--device cuda: torch.cuda.is_available() is False (no GPU or a CPU-only torch)")
        return
    if name == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise DeviceUnavailable(f"--device npu: torch_npu is not importable ({exc})") from None
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            raise DeviceUnavailable("--device npu: torch_npu is installed but no NPU is available")
        return
    raise DeviceUnavailable(f"unknown device {name!r}")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str, backends: dict[str, Any]) -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "sparse_ckpt": getattr(sparse_ckpt, "__version__", "?"),
        "default_backend": sparse_ckpt.backend(),
        "backends": {name: "available" if not isinstance(mod, str) else f"unavailable ({mod})"
                     for name, mod in backends.items()},
        "device": device,
        "torch_threads": torch.get_num_threads(),
    }
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
    return info


# --------------------------------------------------------------------------- progress


class TextBar:
    """A minimal progress bar on stderr for when tqdm is not installed."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.total, self.n, self.stream, self.width = max(total, 1), 0, stream, width
        self.desc = ""
        self.t0 = time.perf_counter()

    def set_description(self, desc: str) -> None:
        """Show ``desc`` after the bar."""
        self.desc = desc
        self._draw()

    def update(self, k: int = 1) -> None:
        """Advance by ``k`` steps."""
        self.n += k
        self._draw()

    def _draw(self) -> None:
        done = int(self.width * self.n / self.total)
        elapsed = time.perf_counter() - self.t0
        line = f"\r[{'#' * done}{'.' * (self.width - done)}] {self.n}/{self.total} {elapsed:6.0f}s {self.desc[:60]:<60}"
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        self.stream.write("\n")
        self.stream.flush()


def progress_bar(total: int, enabled: bool = True) -> Any:
    """tqdm when installed, else :class:`TextBar` (``enabled=False``: a bar that prints nothing)."""
    if not enabled:
        return TextBar(total, stream=io.StringIO())
    try:
        from tqdm import tqdm
    except ImportError:
        return TextBar(total)
    return tqdm(total=total, unit="fig", dynamic_ncols=True)


# --------------------------------------------------------------------------- main loop


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see ``bench/README.md``)."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu", help="where params and state live")
    p.add_argument("--scales", default=None, help=f"LxE list (default {DEFAULT_SCALES}; --quick: {QUICK_SCALES})")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of: layer (one group per layer), "
                   "param (one group per parameter)")
    p.add_argument("--repeats", type=int, default=None, help=f"timed repeats after one warm-up (default 5; "
                   f"--quick: {QUICK_REPEATS})")
    p.add_argument("--quick", action="store_true", help="small scales, few repeats: < 2 min on 2 cores")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default bench/out)")
    p.add_argument("--hidden", type=int, default=0, help="realistic tensors: (N, N) weights (default: tiny (2,))")
    p.add_argument("--no-state-fraction", type=float, default=0.5, help="fraction of experts without state")
    p.add_argument("--dsd-max-params", type=int, default=None,
                   help=f"skip DSD get/set above this many params (default: no limit; --quick: {QUICK_DSD_MAX_PARAMS})")
    p.add_argument("--dcp-max-items", type=int, default=None,
                   help=f"skip DCP save/load of dicts with more entries (default {DEFAULT_DCP_MAX_ITEMS:,}; "
                   f"--quick: {QUICK_DCP_MAX_ITEMS:,}; 0: no limit)")
    p.add_argument("--floor-load-max-groups", type=int, default=0,
                   help="skip the floor optimizer.load_state_dict() above this many param groups: torch's own "
                   "load is O(params x groups): one call at 47 275 groups ran > 10 min on 2 cores (default 0: no limit)")
    p.add_argument("--dsd-set-max-groups", type=int, default=0,
                   help="skip DSD set_optimizer_state_dict above this many param groups: it calls torch's "
                   "load_state_dict, O(params x groups) (default 0: no limit)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds per method and run: fewer repeats when exceeded (default {DEFAULT_BUDGET_S:g}; "
                   f"--quick: {QUICK_BUDGET_S:g})")
    p.add_argument("--state-init", choices=STATE_INITS, default="fill",
                   help="fill: write AdamW state directly (default); step: one real optimizer step")
    p.add_argument("--methods", default=None, help="only methods whose id starts with one of these comma prefixes "
                   "(e.g. sparse/,floor/); the others are recorded as skipped")
    p.add_argument("--gc", action="store_true", help="keep the garbage collector enabled while timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None, help="directory for DCP checkpoints (default: system temp)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report", metavar="RESULTS_JSON", default=None,
                   help="measure nothing: re-render results.md and scaling.png (into --out) from a results.json")
    args = p.parse_args(argv)
    if args.scales is None:
        args.scales = QUICK_SCALES if args.quick else DEFAULT_SCALES
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else 5
    if args.dsd_max_params is None:
        args.dsd_max_params = QUICK_DSD_MAX_PARAMS if args.quick else 0
    if args.dcp_max_items is None:
        args.dcp_max_items = QUICK_DCP_MAX_ITEMS if args.quick else DEFAULT_DCP_MAX_ITEMS
    if args.budget is None:
        args.budget = QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    try:
        args.scale_list = parse_scales(args.scales)
    except ValueError as exc:
        p.error(str(exc))
    args.layout_list = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in args.layout_list if x not in LAYOUTS]
    if bad or not args.layout_list:
        p.error(f"--layouts: unknown {bad}; choose from {LAYOUTS}")
    return args


# Methods that end in torch's Optimizer.load_state_dict, O(params x groups): (option, reason).
GROUP_LIMITS = {
    ("floor", "load_state_dict"): ("--floor-load-max-groups", "torch's load_state_dict is O(params x groups)"),
    ("dsd", "set"): ("--dsd-set-max-groups", "it calls torch's load_state_dict, O(params x groups)"),
}


def skip_reason(m: Method, ctx: FixtureContext, args: argparse.Namespace, backends: dict[str, Any]) -> dict | None:
    """``{"status": "skipped"|"unavailable", "reason": ...}`` or ``None`` to measure."""
    if m.backend is not None and isinstance(backends.get(m.backend), str):
        return {"status": "unavailable", "reason": backends[m.backend]}
    if args.methods and not m.id.startswith(tuple(x for x in args.methods.split(",") if x)):
        return {"status": "skipped", "reason": f"not selected by --methods {args.methods}"}
    n_params = ctx.fx.n_params
    if m.family == "dsd" and args.dsd_max_params and n_params > args.dsd_max_params:
        return {"status": "skipped", "reason": f"{n_params:,} params > --dsd-max-params {args.dsd_max_params:,}"}
    limited = GROUP_LIMITS.get((m.family, m.op))
    if limited is not None:
        option, why = limited
        limit = getattr(args, option.removeprefix("--").replace("-", "_"))
        n_groups = len(ctx.fx.optimizer.param_groups)
        if limit and n_groups > limit:
            return {"status": "skipped", "reason": f"{n_groups:,} groups > {option} {limit:,} ({why})"}
    if m.family == "dcp" and args.dcp_max_items:
        n_items = len(ctx.dcp_input(m.fmt or "packed", m.part or "all"))
        if n_items > args.dcp_max_items:
            return {"status": "skipped", "reason": f"{n_items:,} entries > --dcp-max-items {args.dcp_max_items:,}"}
    return None


def run_bench(args: argparse.Namespace, partial_path: str | None = None) -> dict[str, Any]:
    """Measure everything ``args`` asks for; return the results dict (without targets).

    With ``partial_path``, the results so far are written there after every (scale, layout).
    """
    silence_known_warnings()
    backends = backend_modules()
    methods = plan_methods()
    cache = FixtureCache(hidden=args.hidden, device=args.device, no_state_fraction=args.no_state_fraction,
                         state_init=args.state_init, seed=args.seed)
    sync = device_sync(args.device)
    results: dict[str, Any] = {
        "schema": "sparse_ckpt-bench/1",
        "command": "python -m bench " + " ".join(shlex.quote(a) for a in (args.argv or [])),
        "machine": machine_info(args.device, backends),
        "config": {
            "scales": [s.label for s in args.scale_list],
            "layouts": args.layout_list,
            "repeats": args.repeats,
            "quick": args.quick,
            "hidden": args.hidden,
            "no_state_fraction": args.no_state_fraction,
            "dsd_max_params": args.dsd_max_params or None,
            "dcp_max_items": args.dcp_max_items or None,
            "floor_load_max_groups": args.floor_load_max_groups or None,
            "dsd_set_max_groups": args.dsd_set_max_groups or None,
            "budget_s": args.budget,
            "state_init": args.state_init,
            "gc": args.gc,
            "seed": args.seed,
            "methods": [m.id for m in methods],
        },
        "runs": [],
        "notes": {},
    }
    probe = FixtureCache(device=args.device).get(Scale(2, 4), "layer")
    results["notes"]["dsd_sparse_roundtrip"] = (
        "DSD set_optimizer_state_dict on a fresh optimizer, given DSD get_optimizer_state_dict of an optimizer "
        f"where some params have no state (2x4 probe): {dsd_sparse_roundtrip_probe(probe)}. dsd/set is therefore "
        "timed with DSD get of a twin optimizer that has state on every parameter."
    )
    total = len(args.scale_list) * len(args.layout_list) * (len(methods) + 1)
    bar = progress_bar(total, enabled=not args.no_progress)
    tmp_root = tempfile.mkdtemp(prefix="sparse_ckpt_bench_", dir=args.tmp)
    try:
        for scale in args.scale_list:
            for layout in args.layout_list:
                bar.set_description(f"{scale.label} {layout}: building fixture")
                fx = cache.get(scale, layout)
                bar.update(1)
                run: dict[str, Any] = {"scale": scale.label, "layers": scale.layers, "experts": scale.experts,
                                       "layout": layout, **fx.info, "figures": {}}
                ctx = FixtureContext(fx, tmp_root, args.device)
                try:
                    for m in methods:
                        bar.set_description(f"{scale.label} {layout}: {m.id}")
                        run["figures"][m.id] = measure_one(m, ctx, args, backends, sync)
                        bar.update(1)
                finally:
                    ctx.close()
                results["runs"].append(run)
                if partial_path:
                    os.makedirs(os.path.dirname(partial_path) or ".", exist_ok=True)
                    with open(partial_path, "w", encoding="utf-8") as f:
                        json.dump(results, f, indent=1, default=str)
            cache.drop_scale(scale)
    finally:
        bar.close()
        import shutil

        shutil.rmtree(tmp_root, ignore_errors=True)
    return results


def measure_one(m: Method, ctx: FixtureContext, args: argparse.Namespace, backends: dict[str, Any],
                sync: Any) -> dict[str, Any]:
    """One figure: measured, or skipped/unavailable/error with the reason."""
    meta = {"family": m.family, "op": m.op, "backend": m.backend, "format": m.fmt, "part": m.part, "label": m.label}
    skip = skip_reason(m, ctx, args, backends)
    if skip is not None:
        return {**meta, **skip}
    module = backends.get(m.backend) if m.backend else None
    try:
        if m.backend is not None:
            with use_backend(m.backend, module):  # type: ignore[arg-type]
                fig = time_method(runner_for(m, ctx, module), repeats=args.repeats, budget_s=args.budget, sync=sync,
                                  gc_off=not args.gc)
        else:
            fig = time_method(runner_for(m, ctx, None), repeats=args.repeats, budget_s=args.budget, sync=sync,
                              gc_off=not args.gc)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, the bench goes on
        return {**meta, "status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    if m.family == "dcp" and m.op == "save":
        from bench.measure import dcp_stats

        path = ctx.saved_dir(f"{m.fmt}_{m.part}")
        if path is not None:
            fig.update(dcp_stats(path))
    return {**meta, **fig}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; return the process exit code (2: bad arguments or device unavailable)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    if args.report:
        with open(args.report, encoding="utf-8") as f:
            results = json.load(f)
        print_summary(results, report.write_all(results, args.out))
        return 0
    try:
        check_device(args.device)
    except DeviceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    partial = os.path.join(args.out, "results.partial.json")
    results = run_bench(args, partial)
    results["elapsed_s"] = time.perf_counter() - t0
    paths = report.write_all(results, args.out)
    if os.path.exists(partial):
        os.remove(partial)
    print_summary(results, paths)
    return 0


def print_summary(results: dict[str, Any], paths: dict[str, Any], stream: TextIO = sys.stdout) -> None:
    """The targets table and compact per-run tables on stdout."""
    for line in _summary_lines(results):
        print(line, file=stream)
    print(file=stream)
    print(f"wrote {paths['json']}", file=stream)
    print(f"wrote {paths['md']}", file=stream)
    if paths["png"]:
        print(f"wrote {paths['png']}", file=stream)
    else:
        print(f"note: {paths['plot_message']}", file=stream)
    print(f"elapsed {results['elapsed_s']:.0f} s", file=stream)


def _summary_lines(results: dict[str, Any]) -> Iterator[str]:
    for run in results["runs"]:
        yield ""
        yield from report.run_markdown(run)
    yield ""
    yield "## Targets"
    yield from report.targets_markdown(results["targets"])


if __name__ == "__main__":
    raise SystemExit(main())
