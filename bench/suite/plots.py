"""The bench's figures: ``headline.png`` (sparse_ckpt vs the floor and DSD, DCP in time, bytes and
items), ``scaling.png`` (every save/load/DSD/DCP figure, per layout) and ``core.png`` (the core
functions, cpp solid and python dashed in the same colour). matplotlib is optional
(``pip install 'sparse_ckpt[bench]'``): without it :func:`write_plots` says so and writes nothing.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .methods import (
    BACKENDS,
    CORE_FUNCTIONS,
    DCP_VARIANTS,
    DSD_GET,
    DSD_SET,
    FLOOR_LOAD_STATE_DICT,
    FLOOR_STATE_DICT,
    NAIVE,
    STATEFUL,
    core_id,
    dcp_id,
    sparse_id,
)
from .report_markdown import machine_line
from .verdicts import OK, TARGET_LAYOUT, check_method_ids, runs_of, targets_mode

# One colour per kind of method, the same in every figure; cpp solid, python dashed.
C_FLOOR, C_DSD = "#222222", "tab:red"
C_SPARSE = {"packed": "tab:blue", "flat": "tab:purple"}
BACKEND_STYLE = {"cpp": "-", "python": "--"}
# DCP series, (format, part) -> (legend name, colour, line style, marker)
DCP_STYLE = {
    ("packed", "all"): ("packed, whole dict", "tab:green", "-", "o"),
    ("packed", "groups"): ("packed, param groups only", "tab:green", ":", "s"),
    ("packed", STATEFUL): ("SparseOptimizerState + SparseLoadPlanner", "tab:cyan", "-.", "^"),
    ("flat", "all"): ("flat, whole dict", "tab:orange", "-", "o"),
    ("flat", "groups"): ("flat, param groups only", "tab:orange", ":", "s"),
    (NAIVE, "all"): ("naive layout (fqn-keyed optimizer.state_dict())", "tab:brown", "-", "D"),
}
CORE_PANELS = (
    (
        "core functions: save side",
        ("pack_optimizer", "remap_to_fqns", "flatten_state", "flatten_groups", "encode_table"),
    ),
    (
        "core functions: load side",
        ("decode_table", "unflatten.packed", "unflatten.flat", "match_groups", "assign_state_ids"),
    ),
)
FIGURE_NAMES = ("headline.png", "scaling.png", "core.png")
SAVEFIG = {"dpi": 100, "bbox_inches": "tight", "pad_inches": 0.15}
"""How every figure is saved. The layout keeps every legend inside the figure (a test checks it);
``bbox_inches="tight"`` is the safety net that would keep anything reaching past an edge in the image."""
MISSING_NOTE = "a line ends where its figure was not measured (over one of the bench's limits; results.md says why)"
COINCIDE_WITHIN = 0.10
"""A series of the DCP bytes / items panels within this fraction of another one at every scale where
it was measured is not drawn there (on a log axis spanning decades the two are one line); the legend says so."""
DCP_COINCIDING = (
    (("packed", "all"), ("packed", STATEFUL)),
    (("flat", "all"), (NAIVE, "all")),
)
"""``(not drawn, kept)`` candidates of those panels: the packed dict and the whole optimizer differ by
the leaf's item; the flat dict and the naive layout write about the same tensors."""


@dataclass(frozen=True)
class Series:
    """One line of a plot: ``value(run)`` (``None`` where not measured) against the parameter count."""

    label: str
    ids: tuple[str, ...]
    """The figures it is made of (a sum of medians, or one figure's ``field``)."""
    color: str
    style: str = "-"
    field: str = "median_s"
    """``median_s`` (summed over ``ids``), or ``bytes`` / ``items`` of ``ids[0]``."""
    marker: str = "o"
    key: str = ""
    """The entry of a legend shared by panels that draw related series in the same style (the save and
    the load side); ``label`` when empty."""

    def value(self, run: dict[str, Any]) -> float | None:
        figs = [run["figures"].get(i, {}) for i in self.ids]
        if any(f.get("status") != OK for f in figs):
            return None
        if self.field == "median_s":
            v = sum(float(f["median_s"]) for f in figs)
        else:
            v = figs[0].get(self.field)
        return float(v) if v is not None and v > 0 else None


def _sparse_series(op: str, formats: tuple[str, ...] = ("packed",)) -> list[Series]:
    name = "sparse_state_dict" if op == "save" else "load_sparse_state_dict"
    return [
        Series(
            f"{name} ({fmt}), {b}" if len(formats) > 1 else f"{name}, {b}",
            (sparse_id(op, b, fmt),),
            C_SPARSE[fmt],
            BACKEND_STYLE[b],
            key=f"sparse_ckpt ({fmt}), {b} core" if len(formats) > 1 else f"sparse_ckpt, {b} core",
        )
        for fmt in formats
        for b in BACKENDS
    ]


FLOOR_KEY = "torch floor: optimizer.state_dict() / load_state_dict()"
DSD_KEY = "DSD get / set_optimizer_state_dict"


def _save_series(formats: tuple[str, ...] = ("packed",)) -> list[Series]:
    return [
        Series("optimizer.state_dict() (floor)", (FLOOR_STATE_DICT,), C_FLOOR, key=FLOOR_KEY),
        *_sparse_series("save", formats),
        Series("DSD get_optimizer_state_dict", (DSD_GET,), C_DSD, key=DSD_KEY),
    ]


def _load_series(formats: tuple[str, ...] = ("packed",)) -> list[Series]:
    return [
        Series("optimizer.load_state_dict() (floor)", (FLOOR_LOAD_STATE_DICT,), C_FLOOR, key=FLOOR_KEY),
        *_sparse_series("load", formats),
        Series("DSD set_optimizer_state_dict", (DSD_SET,), C_DSD, key=DSD_KEY),
    ]


def _dcp_series(ops: tuple[str, ...], field: str = "median_s") -> dict[tuple[str, str], Series]:
    """One series per DCP variant (:data:`DCP_VARIANTS`), keyed by ``(format, part)``."""
    out = {}
    for variant in DCP_VARIANTS:
        name, color, style, marker = DCP_STYLE[variant]
        out[variant] = Series(name, tuple(dcp_id(op, *variant) for op in ops), color, style, field, marker)
    return out


def _core_series(functions: Iterable[str], colors: dict[str, str]) -> list[Series]:
    return [Series(f"{fn}, {b}", (core_id(fn, b),), colors[fn], BACKEND_STYLE[b]) for fn in functions for b in BACKENDS]


def plot_method_ids() -> list[str]:
    """Every method id a plot series refers to (checked like the targets')."""
    series = [
        *_save_series(("packed", "flat")),
        *_load_series(("packed", "flat")),
        *_dcp_series(("save", "load")).values(),
        *_core_series(CORE_FUNCTIONS, dict.fromkeys(CORE_FUNCTIONS, "")),
    ]
    return [i for s in series for i in s.ids]


def coverage(series: Series, runs: list[dict[str, Any]]) -> str:
    """Legend suffix saying where ``series`` was measured over ``runs`` (sorted by size): ``""``
    (everywhere), `` (up to 24x128)``, `` (only 8x64, 61x256)`` or `` (not measured)``."""
    measured = [r["scale"] for r in runs if series.value(r) is not None]
    if len(measured) == len(runs):
        return ""
    if not measured:
        return " (not measured)"
    if measured == [r["scale"] for r in runs[: len(measured)]]:
        return f" (up to {measured[-1]})"
    return f" (only {', '.join(measured)})"


def coinciding(series: Series, other: Series, runs: list[dict[str, Any]]) -> float | None:
    """The largest ``|series / other - 1|`` over ``runs`` when ``series`` was measured only where ``other``
    was too (and somewhere); ``None`` otherwise."""
    pairs = [(series.value(r), other.value(r)) for r in runs]
    pairs = [(a, b) for a, b in pairs if a is not None]
    if not pairs or any(b is None for _a, b in pairs):
        return None
    return max(abs(a / b - 1) for a, b in pairs)  # type: ignore[operator]


def _style(s: Series) -> dict[str, Any]:
    return {
        "linestyle": s.style,
        "color": s.color,
        "marker": s.marker,
        "markersize": 5 if s.marker == "o" else 4.5,
        "linewidth": 1.6,
    }


def _draw(
    ax: Any, runs: list[dict[str, Any]], series: list[Series], ylabel: str, title: str, annotate_missing: bool = True
) -> list[Any]:
    """Plot ``series`` over ``runs`` on log-log axes; return the legend handles (one per series, its label
    with :func:`coverage` when ``annotate_missing``; greyed when not measured at all)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter, NullLocator

    handles = []
    for s in series:
        pts = [(r["n_params"], s.value(r)) for r in runs]
        pts = [(x, y) for x, y in pts if y is not None]
        label = s.label + (coverage(s, runs) if annotate_missing else "")
        if pts:
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **_style(s))
            handles.append(line)
        else:
            handles.append(Line2D([], [], alpha=0.35, label=label, **_style(s)))
    if not any(len(h.get_xdata()) for h in handles):
        ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted({r["n_params"] for r in runs})
    if ticks:
        names = {r["n_params"]: r["scale"] for r in runs}
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{names[t]}\n{t:,}" for t in ticks], fontsize=8)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(ticks[0] / 1.5, ticks[-1] * 1.5)  # points off the frame
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("scale (LxE) / parameters", fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    return handles


def _key_handles(series: Iterable[Series], runs: list[dict[str, Any]]) -> list[Any]:
    """One legend entry per :attr:`Series.key` (in the style of its first series), for a legend shared by
    panels; greyed and marked "not measured" when no series of the key has a value in any of ``runs``."""
    from matplotlib.lines import Line2D

    keys: dict[str, list[Series]] = {}
    for s in series:
        keys.setdefault(s.key or s.label, []).append(s)
    handles = []
    for key, group in keys.items():
        measured = any(s.value(r) is not None for s in group for r in runs)
        handles.append(
            Line2D(
                [],
                [],
                alpha=1.0 if measured else 0.35,
                **_style(group[0]),
                label=key if measured else f"{key} (not measured)",
            )
        )
    return handles


def ratio_note(runs: list[dict[str, Any]], pairs: Iterable[tuple[str, Series, Series]], sep: str = "; ") -> str:
    """``name: 1.3× at 4x16; ...``: ``num / den`` at the largest run where both were measured."""
    parts = []
    for name, num, den in pairs:
        done = [r for r in runs if num.value(r) is not None and den.value(r) is not None]
        if done:
            r = max(done, key=lambda r: r["n_params"])
            value = num.value(r) / den.value(r)  # type: ignore[operator]
            digits = 0 if value >= 100 else 1 if value >= 1 else 2
            parts.append(f"{name}: {value:,.{digits}f}× at {r['scale']}")
    return sep.join(parts)


def _legend_below(ax: Any, handles: list[Any], ncol: int = 1) -> None:
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22),
        ncol=ncol,
        fontsize=8,
        frameon=False,
        handlelength=3,
    )


def _figure_legend(fig: Any, handles: list[Any], title: str, ncol: int = 3) -> None:
    """A legend below the whole (sub)figure, inside it (constrained layout makes room)."""
    legend = fig.legend(
        handles=handles,
        title=title,
        loc="outside lower center",
        ncol=ncol,
        fontsize=8,
        title_fontsize=8,
        frameon=False,
        handlelength=3,
    )
    legend.get_title().set_multialignment("center")


def _suptitle(fig: Any, results: dict[str, Any], what: str) -> None:
    judged, why = targets_mode(results)
    mode = "" if judged else f"\nINDICATIVE — {why}"
    fig.suptitle(f"sparse_ckpt bench: {what}{mode}\n{machine_line(results['machine'])}", fontsize=10)


def _title(title: str, note: str) -> str:
    return f"{title}\n{note}" if note else title


def _drop_coinciding(
    series: dict[tuple[str, str], Series],
    runs: list[dict[str, Any]],
    dropped: dict[tuple[str, str], list[tuple[str, float]]],
    panel: str,
) -> list[Series]:
    """``series`` without those of :data:`DCP_COINCIDING` that lie within :data:`COINCIDE_WITHIN` of
    their partner; each one left out is recorded in ``dropped[(its label, partner's label)]``."""
    out = dict(series)
    for gone, kept in DCP_COINCIDING:
        dev = coinciding(series[gone], series[kept], runs)
        if dev is not None and dev < COINCIDE_WITHIN:
            del out[gone]
            dropped.setdefault((series[gone].label, series[kept].label), []).append((panel, dev))
    return list(out.values())


def _dropped_note(dropped: dict[tuple[str, str], list[tuple[str, float]]]) -> str:
    """``not drawn where it coincides with another line: A ≈ B in the bytes and items panels (within 4%)``."""
    parts = []
    for (gone, kept), where in dropped.items():
        panels = " and ".join(p for p, _dev in where)
        parts.append(
            f"{gone} ≈ {kept} in the {panels} panel{'s' if len(where) > 1 else ''} "
            f"(within {math.ceil(100 * max(d for _p, d in where))}%): not drawn there"
        )
    return "\n".join(parts)


def plot_headline(results: dict[str, Any], path: str, plt: Any) -> None:
    """Save and load time vs the floor and DSD; DCP packed vs flat in time, bytes and items."""
    layouts = list(results["config"]["layouts"])
    layout = TARGET_LAYOUT if TARGET_LAYOUT in layouts else layouts[0]
    runs = runs_of(results, layout)
    fig = plt.figure(figsize=(15, 11), layout="constrained")
    gs = fig.add_gridspec(2, 6)
    ax_save, ax_load = fig.add_subplot(gs[0, 0:3]), fig.add_subplot(gs[0, 3:6])
    ax_t, ax_b, ax_i = fig.add_subplot(gs[1, 0:2]), fig.add_subplot(gs[1, 2:4]), fig.add_subplot(gs[1, 4:6])
    save, load = _save_series(), _load_series()
    floor_s, cpp_s, dsd_s = save[0], save[1], save[-1]
    floor_l, cpp_l, dsd_l = load[0], load[1], load[-1]
    note_s = ratio_note(runs, [("cpp / floor", cpp_s, floor_s), ("DSD get / cpp", dsd_s, cpp_s)])
    note_l = ratio_note(runs, [("cpp / floor", cpp_l, floor_l), ("DSD set / cpp", dsd_l, cpp_l)])
    for ax, series, title in (
        (ax_save, save, _title(f"save: optimizer → dict (one group per {layout})", note_s)),
        (ax_load, load, _title(f"load: dict → fresh optimizer (one group per {layout})", note_l)),
    ):
        _legend_below(ax, _draw(ax, runs, series, "seconds (median)", title), ncol=2)
    panels = (
        (ax_t, _dcp_series(("save", "load")), "seconds (median save + load)", "DCP save + load", "time"),
        (ax_b, _dcp_series(("save",), "bytes"), "bytes on disk", "DCP checkpoint size", "bytes"),
        (ax_i, _dcp_series(("save",), "items"), "items in the DCP metadata", "DCP items", "items"),
    )
    dropped: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for ax, series, ylabel, title, what in panels:
        note = ratio_note(
            runs,
            [
                ("naive layout / SparseOptimizerState", series[(NAIVE, "all")], series[("packed", STATEFUL)]),
                ("param groups alone, flat / packed", series[("flat", "groups")], series[("packed", "groups")]),
            ],
            sep="\n",
        )
        drawn = list(series.values()) if ax is ax_t else _drop_coinciding(series, runs, dropped, what)
        handles = _draw(ax, runs, drawn, ylabel, _title(f"{title} (one group per {layout})", note), ax is ax_t)
        if ax is ax_t:
            legend = handles
    title = "DCP (bottom row)" + (f"\n{_dropped_note(dropped)}" if dropped else "")
    _figure_legend(fig, legend, title)
    _suptitle(fig, results, "sparse_ckpt vs optimizer.state_dict() and DSD; DCP of sparse_ckpt vs the naive layout")
    fig.savefig(path, **SAVEFIG)


def plot_scaling(results: dict[str, Any], path: str, plt: Any) -> None:
    """Every save/load/DSD/DCP figure, both formats and both backends: the save / load panels above
    (one row per layout), the DCP panels below, each block with one legend."""
    layouts = list(results["config"]["layouts"])
    blocks = (
        (
            (
                "sparse_ckpt vs torch's floor and DSD (sparse_ckpt: packed blue, flat purple; "
                "cpp core solid, python dashed)"
            ),
            (("save side", _save_series(("packed", "flat"))), ("load side", _load_series(("packed", "flat")))),
            (
                "save panels: optimizer.state_dict(), sparse_state_dict, DSD get; load panels: "
                "optimizer.load_state_dict(), "
                "load_sparse_state_dict, DSD set"
            ),
        ),
        (
            "DCP: dcp.save and dcp.load of each dict",
            (("dcp.save", list(_dcp_series(("save",)).values())), ("dcp.load", list(_dcp_series(("load",)).values()))),
            "",
        ),
    )
    fig = plt.figure(figsize=(14, 6.8 * len(layouts) + 4), layout="constrained")
    for sub, (title, panels, about) in zip(fig.subfigures(2, 1), blocks):
        axes = sub.subplots(len(layouts), len(panels), squeeze=False)
        for row, layout in enumerate(layouts):
            runs = runs_of(results, layout)
            for col, (name, series) in enumerate(panels):
                _draw(
                    axes[row][col],
                    runs,
                    series,
                    "seconds (median)",
                    f"{name} — one group per {layout}",
                    annotate_missing=False,
                )
        handles = _key_handles([s for _name, series in panels for s in series], results["runs"])
        _figure_legend(sub, handles, "\n".join(x for x in (about, MISSING_NOTE) if x))
        sub.suptitle(title, fontsize=10)
    _suptitle(fig, results, "every save / load / DSD / DCP figure")
    fig.savefig(path, **SAVEFIG)


def plot_core(results: dict[str, Any], path: str, plt: Any) -> None:
    """The core functions alone: one colour per function, cpp solid and python dashed."""
    from matplotlib.lines import Line2D

    layouts = list(results["config"]["layouts"])
    palette = plt.get_cmap("tab10")
    colors = {fn: palette(i % 10) for i, fn in enumerate(CORE_FUNCTIONS)}
    fig, axes = plt.subplots(
        len(layouts),
        len(CORE_PANELS),
        figsize=(7 * len(CORE_PANELS), 3.8 * len(layouts) + 2.4),
        squeeze=False,
        layout="constrained",
    )
    style_key = [Line2D([], [], color="grey", linestyle=BACKEND_STYLE[b], label=f"{b} core") for b in BACKENDS]
    for row, layout in enumerate(layouts):
        runs = runs_of(results, layout)
        for col, (title, functions) in enumerate(CORE_PANELS):
            ax = axes[row][col]
            _draw(ax, runs, _core_series(functions, colors), "seconds (median)", f"{title} — one group per {layout}")
            if row == len(layouts) - 1:
                fn_key = [Line2D([], [], color=colors[fn], linewidth=2.5, label=f"core.{fn}") for fn in functions]
                _legend_below(ax, fn_key + style_key, ncol=3)
    _suptitle(fig, results, "core functions alone (cpp solid, python dashed, same colour)")
    fig.savefig(path, **SAVEFIG)


def write_plots(results: dict[str, Any], out_dir: str) -> tuple[list[str], str | None]:
    """``headline.png``, ``scaling.png``, ``core.png`` into ``out_dir``: ``(paths, None)``, or
    ``([], message)`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], (
            "matplotlib is not installed (pip install 'sparse_ckpt[bench]'); "
            f"{', '.join(FIGURE_NAMES)} were not written"
        )
    check_method_ids(plot_method_ids())
    paths = []
    for name, plot in zip(FIGURE_NAMES, (plot_headline, plot_scaling, plot_core)):
        path = os.path.join(out_dir, name)
        try:
            with warnings.catch_warnings():  # cosmetic; the figure is still written
                warnings.filterwarnings("ignore", message="constrained_layout not applied")
                plot(results, path, plt)
        finally:
            plt.close("all")
        paths.append(path)
    return paths, None
