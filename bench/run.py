"""Command line of the bench: ``python -m bench`` in a checkout, ``python -m sparse_ckpt.bench`` or
``sparse-ckpt-bench`` from an installed wheel (also ``python bench/run.py``).

Measures, for synthetic MoE AdamW optimizers, the floor (``optimizer.state_dict()`` /
``load_state_dict``), ``sparse_state_dict`` / ``load_sparse_state_dict`` (both core backends,
both formats), torch DSD get/set, DCP save/load of the resulting dicts and the core functions
alone. Writes ``results.json``, ``results.md``, ``headline.png``, ``scaling.png`` and ``core.png``
to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from typing import Any, TextIO

SCRIPT = __package__ in (None, "")
"""Started as ``python bench/run.py`` (not ``-m``)."""
if SCRIPT:  # import the folder as package ``bench``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench  # noqa: F401

    __package__ = "bench"  # lets the relative imports below resolve

import torch

import sparse_ckpt

from . import provenance
from .provenance import cpu_model
from .suite import report, report_markdown
from .suite.devices import DeviceUnavailable, check_device, device_name, synchronize
from .suite.fixtures import LAYOUTS, NAME_STYLES, STATE_INITS, FixtureCache, Scale, gc_paused, parse_scales
from .suite.measure import (
    FixtureContext,
    backend_modules,
    dcp_stats,
    dir_bytes,
    dsd_sparse_roundtrip_probe,
    runner_for,
    silence_known_warnings,
    use_backend,
)
from .suite.methods import EXPORT_SAVE, Method, plan_methods
from .suite.timing import time_method
from .suite.units import fmt_time
from .suite.verdicts import targets_mode

DEFAULT_SCALES = "8x64,24x128,61x256,120x512,200x1024"
QUICK_SCALES = "2x8,4x16"
QUICK_REPEATS = 3
QUICK_DSD_MAX_PARAMS = 10_000
QUICK_BUDGET_S = 2.0
QUICK_DCP_MAX_ITEMS = 1_500
DEFAULT_DCP_MAX_ITEMS = 150_000
DEFAULT_BUDGET_S = 60.0
PROGRESS_MODES = ("auto", "bar", "lines", "off")
FREEZE_MIN_PARAMS = 20_000
"""From this many parameters on, the heap is frozen between figures (:func:`freeze_heap`); below it
the collector's passes are cheap and the freezing itself would cost more than it saves."""
CONSOLE_SCRIPT = "sparse-ckpt-bench"
INSTALLED_OUT = "sparse_ckpt_bench_out"


def in_checkout() -> bool:
    """Whether this package is the ``bench/`` folder of a source checkout (not an installed wheel)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.basename(here) == "bench" and os.path.exists(os.path.join(os.path.dirname(here), "setup.py"))


def default_out() -> str:
    """``bench/out`` (git-ignored) in a checkout; ``./sparse_ckpt_bench_out`` for an installed wheel."""
    if in_checkout():
        return os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    return os.path.abspath(INSTALLED_OUT)


def default_prog() -> str:
    """How this bench was started, for the usage line and the recorded command."""
    if SCRIPT:
        rel = os.path.relpath(__file__)
        return f"python {__file__ if rel.startswith('..') else rel}"
    return f"python -m {__package__}"


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
        "backends": {
            name: "available" if not isinstance(mod, str) else f"unavailable ({mod})" for name, mod in backends.items()
        },
        "device": device,
        "torch_threads": torch.get_num_threads(),
    }
    name = device_name(device)
    if name is not None:
        info["device_name"] = name
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


class Progress:
    """Progress on stderr: ``bar`` (tqdm, else :class:`TextBar`) redraws one line, for a terminal;
    ``lines`` prints one line per finished step (for logs and CI, where ``\\r`` makes one endless line);
    ``off`` prints nothing. ``auto``: ``bar`` when the stream is a TTY, else ``lines``."""

    def __init__(self, total: int, mode: str = "auto", stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", None)
            mode = "bar" if isatty is not None and isatty() else "lines"
        self.mode, self.total, self.n = mode, total, 0
        self.t0 = time.perf_counter()
        self.bar: Any = None
        if mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:
                self.bar = TextBar(total, stream=self.stream)
            else:
                self.bar = tqdm(total=total, unit="fig", dynamic_ncols=True, file=self.stream)

    def start(self, desc: str) -> None:
        """Step ``desc`` begins (shown by the bar)."""
        if self.bar is not None:
            self.bar.set_description(desc)

    def done(self, desc: str, detail: str = "") -> None:
        """Step ``desc`` finished: advance the bar, or print its line."""
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.mode == "lines":
            width = len(str(self.total))
            elapsed = time.perf_counter() - self.t0
            line = f"[{self.n:>{width}}/{self.total} {elapsed:6.1f}s] {desc}" + (f": {detail}" if detail else "")
            print(line[:200], file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar."""
        if self.bar is not None:
            self.bar.close()


def figure_detail(fig: dict[str, Any]) -> str:
    """One figure in a few words, for the progress lines."""
    if fig.get("status") == "ok":
        inner = f" × {fig['inner']}" if fig.get("inner", 1) > 1 else ""
        return f"{fmt_time(fig['median_s'])} (n={fig['n']}{inner})"
    return f"{fig.get('status')}: {fig.get('reason', '')}"


# --------------------------------------------------------------------------- main loop


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> argparse.Namespace:
    """The command line (see ``bench/README.md``)."""
    p = argparse.ArgumentParser(
        prog=prog or default_prog(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu", help="where params and state live")
    p.add_argument("--scales", default=None, help=f"LxE list (default {DEFAULT_SCALES}; --quick: {QUICK_SCALES})")
    p.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="comma list of: layer (one group per layer), param (one group per parameter)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed repeats after one warm-up (default 5; --quick: {QUICK_REPEATS})",
    )
    p.add_argument("--quick", action="store_true", help="small scales, few repeats: < 2 min on 2 cores")
    p.add_argument(
        "--out",
        default=None,
        help=f"output directory (default: bench/out in a checkout, ./{INSTALLED_OUT} for an installed wheel)",
    )
    p.add_argument("--hidden", type=int, default=0, help="realistic tensors: (N, N) weights (default: tiny (2,))")
    p.add_argument("--no-state-fraction", type=float, default=0.5, help="fraction of experts without state")
    p.add_argument(
        "--dsd-max-params",
        type=int,
        default=None,
        help=f"skip DSD get/set above this many params (default: no limit; --quick: {QUICK_DSD_MAX_PARAMS})",
    )
    p.add_argument(
        "--dcp-max-items",
        type=int,
        default=None,
        help=f"skip DCP save/load of dicts with more entries (default {DEFAULT_DCP_MAX_ITEMS:,}; "
        f"--quick: {QUICK_DCP_MAX_ITEMS:,}; 0: no limit)",
    )
    p.add_argument(
        "--floor-load-max-groups",
        type=int,
        default=0,
        help="skip the floor optimizer.load_state_dict() above this many param groups: torch's own "
        "load is O(params x groups): one call at 47 275 groups ran > 10 min on 2 cores (default 0: no limit)",
    )
    p.add_argument(
        "--floor-load-max-params",
        type=int,
        default=0,
        help="skip the floor optimizer.load_state_dict() above this many params (whatever the groups): "
        "with one group per layer it is O(params^2) (20 s at 47 275 params here) (default 0: no limit)",
    )
    p.add_argument(
        "--dsd-set-max-groups",
        type=int,
        default=0,
        help="skip DSD set_optimizer_state_dict above this many param groups: it calls torch's "
        "load_state_dict, O(params x groups) (default 0: no limit)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds per method and run: fewer repeats when exceeded (default {DEFAULT_BUDGET_S:g}; "
        f"--quick: {QUICK_BUDGET_S:g})",
    )
    p.add_argument(
        "--state-init",
        choices=STATE_INITS,
        default="fill",
        help="fill: write AdamW state directly (default); step: one real optimizer step",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="only methods whose id starts with one of these comma prefixes "
        "(e.g. sparse/,floor/); the others are recorded as skipped",
    )
    p.add_argument(
        "--names",
        choices=tuple(NAME_STYLES),
        default="bench",
        help="module names: bench (layers.0.attn.q_proj.weight, default) or deepseek (DeepSeek-V3's, one "
        "module deeper: model.layers.0.self_attn.q_proj.weight)",
    )
    p.add_argument("--gc", action="store_true", help="keep the garbage collector enabled while timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None, help="directory for DCP checkpoints (default: system temp)")
    p.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="progress on stderr: bar (redrawn line), lines (one per finished figure), off; "
        "auto (default): bar on a terminal, lines otherwise",
    )
    p.add_argument("--no-progress", action="store_true", help="same as --progress off")
    p.add_argument(
        "--report",
        metavar="RESULTS_JSON",
        default=None,
        help="measure nothing: re-render results.md and the figures (into --out) from a results.json",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = default_out()
    args.out = os.path.abspath(args.out)
    if args.no_progress:
        args.progress = "off"
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


# Methods that end in torch's Optimizer.load_state_dict, O(params x groups): (option, what it counts,
# reason). With one group per parameter the group count is the limit that bites; with one group per
# layer the parameter count (torch's load is also O(params^2) there: 1.2 s at 24x128, 20 s at 61x256).
GROUP_LIMITS = {
    ("floor", "load_state_dict"): (
        ("--floor-load-max-groups", "n_groups", "torch's load_state_dict is O(params x groups)"),
        ("--floor-load-max-params", "n_params", "torch's load_state_dict is O(params x groups), O(params^2) here"),
    ),
    ("dsd", "set"): (("--dsd-set-max-groups", "n_groups", "it calls torch's load_state_dict, O(params x groups)"),),
}
LIMIT_UNITS = {"n_groups": "groups", "n_params": "params"}


def skip_reason(m: Method, ctx: FixtureContext, args: argparse.Namespace, backends: dict[str, Any]) -> dict | None:
    """``{"status": "skipped"|"unavailable", "reason": ...}`` or ``None`` to measure."""
    if m.backend is not None and isinstance(backends.get(m.backend), str):
        return {"status": "unavailable", "reason": backends[m.backend]}
    if args.methods and not m.id.startswith(tuple(x for x in args.methods.split(",") if x)):
        return {"status": "skipped", "reason": f"not selected by --methods {args.methods}"}
    n_params = ctx.fx.info["n_params"]
    if m.family == "dsd" and args.dsd_max_params and n_params > args.dsd_max_params:
        return {"status": "skipped", "reason": f"{n_params:,} params > --dsd-max-params {args.dsd_max_params:,}"}
    for option, what, why in GROUP_LIMITS.get((m.family, m.op), ()):
        limit = getattr(args, option.removeprefix("--").replace("-", "_"))
        count = ctx.fx.info[what]
        if limit and count > limit:
            return {"status": "skipped", "reason": f"{count:,} {LIMIT_UNITS[what]} > {option} {limit:,} ({why})"}
    if m.family in ("dcp", "export") and args.dcp_max_items:
        n_items = ctx.dcp_entries(m.fmt or "packed", m.part or "all")
        if n_items > args.dcp_max_items:
            return {"status": "skipped", "reason": f"{n_items:,} entries > --dcp-max-items {args.dcp_max_items:,}"}
    return None


def new_results(args: argparse.Namespace, backends: dict[str, Any], methods: list[Method]) -> dict[str, Any]:
    """The results dict before anything is measured: command, machine, configuration."""
    return {
        "schema": "sparse_ckpt-bench/1",
        "command": " ".join(
            [
                getattr(args, "prog", None) or default_prog(),
                *(shlex.quote(a) for a in (getattr(args, "argv", None) or [])),
            ]
        ),
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
            "floor_load_max_params": args.floor_load_max_params or None,
            "dsd_set_max_groups": args.dsd_set_max_groups or None,
            "budget_s": args.budget,
            "state_init": args.state_init,
            "names": getattr(args, "names", "bench"),
            "gc": args.gc,
            "seed": args.seed,
            "methods": [m.id for m in methods],
        },
        "runs": [],
        "notes": {},
    }


def run_bench(
    args: argparse.Namespace, partial_path: str | None = None, results: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Measure everything ``args`` asks for; return the results dict (without targets).

    ``results``: the dict from :func:`new_results` to fill (default: a new one). With
    ``partial_path``, the results so far are written there after every (scale, layout).
    """
    silence_known_warnings()
    backends = backend_modules()
    methods = plan_methods()
    if results is None:
        results = new_results(args, backends, methods)
    cache = FixtureCache(
        hidden=args.hidden,
        device=args.device,
        no_state_fraction=args.no_state_fraction,
        state_init=args.state_init,
        seed=args.seed,
        names=getattr(args, "names", "bench"),
    )
    sync = functools.partial(synchronize, args.device)
    probe = FixtureCache(device=args.device).get(Scale(2, 4), "layer")
    results["notes"]["dsd_sparse_roundtrip"] = (
        "DSD set_optimizer_state_dict on a fresh optimizer, given DSD get_optimizer_state_dict of an optimizer "
        f"where some params have no state (2x4 probe): {dsd_sparse_roundtrip_probe(probe)}. dsd/set is therefore "
        "timed with DSD get of a twin optimizer that has state on every parameter."
    )
    total = len(args.scale_list) * len(args.layout_list) * (len(methods) + 1)
    progress = Progress(total, getattr(args, "progress", "auto"))
    tmp_root = tempfile.mkdtemp(prefix="sparse_ckpt_bench_", dir=args.tmp)
    try:
        for scale in args.scale_list:
            big = scale.n_params >= FREEZE_MIN_PARAMS
            for layout in args.layout_list:
                desc = f"{scale.label} {layout}"
                progress.start(f"{desc}: building fixture")
                t0 = time.perf_counter()
                fx = cache.get(scale, layout)
                if big and not args.gc:
                    freeze_heap()  # built with the collector paused; its little garbage is frozen along
                progress.done(
                    f"{desc} fixture",
                    f"{fx.n_params:,} params, {len(fx.optimizer.param_groups):,} groups "
                    f"({time.perf_counter() - t0:.1f} s)",
                )
                run: dict[str, Any] = {
                    "scale": scale.label,
                    "layers": scale.layers,
                    "experts": scale.experts,
                    "layout": layout,
                    **fx.info,
                    "figures": {},
                }
                ctx = FixtureContext(fx, tmp_root, args.device)
                try:
                    for m in methods:
                        progress.start(f"{desc}: {m.id}")
                        fig = run["figures"][m.id] = measure_one(m, ctx, args, backends, sync)
                        progress.done(f"{desc} {m.id}", figure_detail(fig))
                finally:
                    ctx.close()
                    del ctx, fx
                    cache.drop(scale, layout)  # the model stays for the next layout
                    if big:
                        thaw_heap()
                results["runs"].append(run)
                if partial_path:
                    os.makedirs(os.path.dirname(partial_path) or ".", exist_ok=True)
                    with open(partial_path, "w", encoding="utf-8") as f:
                        json.dump(results, f, indent=1, default=str)
            cache.drop_scale(scale)
            if big:
                thaw_heap()
    finally:
        progress.close()
        shutil.rmtree(tmp_root, ignore_errors=True)
    return results


def freeze_heap(young_only: bool = False) -> None:
    """Move every live object (the fixture, prepared inputs) out of the collector's reach
    (``gc.freeze``), so that collections between samples scan only new objects; with ``young_only``,
    first collect the garbage made since the last freeze (e.g. reference cycles of earlier samples).

    Without it, at ``200x1024`` every full collection walks millions of fixture objects (seconds each)
    in the untimed gaps; the timed calls run with the collector off either way (``--gc`` keeps it on
    and does not freeze). :func:`thaw_heap` undoes it when a fixture is dropped.
    """
    if young_only:
        gc.collect()  # after a freeze, only the objects made since then are tracked
    gc.freeze()


def thaw_heap() -> None:
    """Undo :func:`freeze_heap` and collect (frees what dropped fixtures left in reference cycles)."""
    gc.unfreeze()
    gc.collect()


def measure_one(
    m: Method, ctx: FixtureContext, args: argparse.Namespace, backends: dict[str, Any], sync: Any
) -> dict[str, Any]:
    """One figure: measured, or skipped/unavailable/error with the reason."""
    meta = {"family": m.family, "op": m.op, "backend": m.backend, "format": m.fmt, "part": m.part, "label": m.label}
    skip = skip_reason(m, ctx, args, backends)
    if skip is not None:
        return {**meta, **skip}
    module = backends.get(m.backend) if m.backend else None
    try:
        with use_backend(m.backend, module) if m.backend is not None else nullcontext():  # type: ignore[arg-type]
            with gc_paused():  # untimed: the runner prepares the fixture's inputs on first use
                runner = runner_for(m, ctx, module)
            if not args.gc and ctx.fx.info["n_params"] >= FREEZE_MIN_PARAMS:
                freeze_heap(young_only=True)
            fig = time_method(runner, repeats=args.repeats, budget_s=args.budget, sync=sync, gc_off=not args.gc)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, the bench goes on
        return {**meta, "status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    if m.family == "dcp" and m.op == "save":
        path = ctx.saved_dir(f"{m.fmt}_{m.part}")
        if path is not None:
            fig.update(dcp_stats(path))
    if m.id == EXPORT_SAVE:
        path = ctx.saved_dir("export")
        if path is not None:
            fig["bytes"] = dir_bytes(path)
    return {**meta, **fig}


# --------------------------------------------------------------------------- stdout


RULE = "=" * 100


def _limit(value: Any) -> str:
    return f"{value:,}" if value else "none"


def header_lines(results: dict[str, Any], out_dir: str, source: str | None = None) -> list[str]:
    """What a person needs to read the numbers: mode, command, machine, software, backends, scales."""
    m, c = results["machine"], results["config"]
    judged, why = targets_mode(results)
    mode = "full run" if not c.get("quick") else "QUICK mode"
    if c.get("quick"):
        mode += f" — targets are INDICATIVE only ({why})"
    elif not judged:
        mode += f" — targets whose scale is not run are INDICATIVE ({why})"
    device = m["device"] + (f" ({m['device_name']})" if m.get("device_name") else "")
    backends = ", ".join(f"{k} {v}" for k, v in m["backends"].items())
    scales = ", ".join(f"{label} ({parse_scales(label)[0].n_params:,} params)" for label in c["scales"])
    lines = [
        RULE,
        f"sparse_ckpt bench: {mode}",
        f"command   {results['command']}",
        (
            f"machine   {m['cpu_model']}, {m['cores']} cores ({m.get('torch_threads', '?')} torch threads); "
            f"{m['platform']}"
        ),
        f"software  python {m['python']}, torch {m['torch']}, sparse_ckpt {m['sparse_ckpt']}",
        f"backends  {backends}; default {m['default_backend']}",
        f"device    {device}",
        f"scales    {scales}; layouts {', '.join(c['layouts'])} (one group per layer / per parameter)",
        (
            f"timing    {c['repeats']} repeats after 1 warm-up, budget {c['budget_s']:g} s per figure, gc "
            f"{'on' if c['gc'] else 'off'}; skip limits: DSD params {_limit(c['dsd_max_params'])}, DCP items "
            f"{_limit(c['dcp_max_items'])}, floor-load groups {_limit(c['floor_load_max_groups'])} / params "
            f"{_limit(c.get('floor_load_max_params'))}, DSD-set groups {_limit(c['dsd_set_max_groups'])}"
        ),
        f"output    {out_dir}",
    ]
    if source:
        lines.append(f"re-render of {source}")
    return [*lines, RULE]


def print_header(
    results: dict[str, Any], out_dir: str, source: str | None = None, stream: TextIO | None = None
) -> None:
    """The header, flushed at once (the progress goes to stderr meanwhile)."""
    stream = sys.stdout if stream is None else stream
    for line in header_lines(results, out_dir, source):
        print(line, file=stream)
    stream.flush()


def print_summary(results: dict[str, Any], paths: dict[str, Any], stream: TextIO | None = None) -> None:
    """The per-run tables, the targets table and the files written, on stdout."""
    stream = sys.stdout if stream is None else stream
    for line in _summary_lines(results):
        print(line, file=stream)
    print(file=stream)
    print(f"wrote {paths['json']}", file=stream)
    print(f"wrote {paths['md']}", file=stream)
    for png in paths["pngs"]:
        print(f"wrote {png}", file=stream)
    if paths["plot_message"]:
        print(f"note: {paths['plot_message']}", file=stream)
    if "elapsed_s" in results:
        print(f"elapsed {results['elapsed_s']:.0f} s", file=stream)


def _summary_lines(results: dict[str, Any]) -> Iterator[str]:
    for run in results["runs"]:
        yield ""
        yield from report_markdown.run_markdown(run)
    yield ""
    yield "## Targets"
    banner = report_markdown.indicative_banner(results)
    if banner:
        yield ""
        yield f"*** {banner} ***"
        yield ""
    yield from report_markdown.targets_markdown(results["targets"])
    if results.get("info"):
        yield ""
        yield "## Information (no targets)"
        yield ""
        yield from report_markdown.info_markdown(results["info"])


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the bench; return the process exit code (2: bad arguments or device unavailable)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or default_prog()
    args = parse_args(argv, prog)
    args.argv, args.prog = argv, prog
    if args.report:
        with open(args.report, encoding="utf-8") as f:
            results = json.load(f)
        print_header(results, args.out, source=os.path.abspath(args.report))
        print_summary(results, report.write_all(results, args.out))
        return 0
    try:
        check_device(args.device)
    except DeviceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    silence_known_warnings()
    results = new_results(args, backend_modules(), plan_methods())
    print_header(results, args.out)
    partial = os.path.join(args.out, "results.partial.json")
    results = run_bench(args, partial, results)
    results["elapsed_s"] = time.perf_counter() - t0
    results["provenance"] = provenance.record()
    paths = report.write_all(results, args.out)
    if os.path.exists(partial):
        os.remove(partial)
    print_summary(results, paths)
    return 0


def console_main() -> int:
    """The ``sparse-ckpt-bench`` console script."""
    return main(prog=CONSOLE_SCRIPT)


if __name__ == "__main__":
    raise SystemExit(main())
