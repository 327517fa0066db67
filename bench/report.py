"""Turn the bench's results into ``results.json``, ``results.md`` and the figures.

The targets (issue 5) are computed here as ratios; they are a report, never an assertion. Target
scale: ``61x256`` with one group per parameter when it was run, otherwise the largest scale run (the
table says which). Only a full run at the target scale gets a verdict (PASS/MISS); otherwise (quick
mode, toy scales) every ratio is ``INDICATIVE``: torch's baselines grow quadratically and
sparse_ckpt linearly, so a ratio measured on a toy scale says little about the target.

Figures: ``headline.png`` (sparse_ckpt vs the floor and DSD, DCP packed vs flat in time, bytes and
items), ``scaling.png`` (every save/load/DSD/DCP figure, per layout) and ``core.png`` (the core
functions, cpp solid and python dashed in the same colour).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .measure import (
    BACKENDS,
    CORE_FUNCTIONS,
    DSD_GET,
    DSD_SET,
    FLOOR_LOAD_STATE_DICT,
    FLOOR_STATE_DICT,
    SPARSE_FAMILIES,
    core_id,
    dcp_id,
    planned_ids,
    sparse_id,
)

TARGET_SCALE = "61x256"
TARGET_LAYOUT = "param"
TARGET_FORMAT = "packed"
GROWTH_PAIR = ("24x128", "61x256")
GROWTH_LIMIT = 6.0
"""time(61x256) / time(24x128) limit for every sparse_ckpt figure (1.19 x their parameter ratio)."""
GROWTH_SLACK = 1.2
"""With other scales: the limit is this times the parameter ratio of the two largest scales."""
OK = "ok"
PASS, MISS, NA, INDICATIVE = "PASS", "MISS", "N/A", "INDICATIVE"


@dataclass(frozen=True)
class Target:
    """One target: ``name`` (the row's title) ``op`` (``<=`` / ``>=``) ``threshold``."""

    name: str
    op: str
    threshold: float


SAVE_COST = Target("sparse_state_dict / floor state_dict()", "<=", 2.0)
LOAD_VS_DSD = Target("DSD set_optimizer_state_dict / load_sparse_state_dict", ">=", 100.0)
LOAD_COST = Target("load_sparse_state_dict / floor load_state_dict()", "<=", 3.0)
CORE_SPEEDUP = 3.0
"""python core / cpp core time, at least, for each of :data:`CORE_TARGET_FUNCTIONS`."""
CORE_TARGET_FUNCTIONS = ("pack_optimizer", "remap_to_fqns", "encode_table")
DCP_TIME = Target("DCP save+load of param groups: flat time / packed time", ">=", 50.0)
DCP_BYTES = Target("DCP param groups: flat bytes / packed bytes", ">=", 50.0)
GROWTH_NAME = "growth of every sparse_ckpt figure"

DCP_GROUP_IDS = (dcp_id("save", "packed", "groups"), dcp_id("load", "packed", "groups"),
                 dcp_id("save", "flat", "groups"), dcp_id("load", "flat", "groups"))


def core_target(function: str) -> Target:
    """The core target of one function."""
    return Target(f"core.{function}: python / cpp", ">=", CORE_SPEEDUP)


def target_method_ids() -> list[str]:
    """Every method id the targets divide."""
    ids = [FLOOR_STATE_DICT, FLOOR_LOAD_STATE_DICT, DSD_SET, *DCP_GROUP_IDS]
    for b in BACKENDS:
        ids += [sparse_id("save", b, TARGET_FORMAT), sparse_id("load", b, TARGET_FORMAT)]
    ids += [core_id(fn, b) for fn in CORE_TARGET_FUNCTIONS for b in ("python", "cpp")]
    return ids


def check_method_ids(extra: Iterable[str] = ()) -> None:
    """Fail loudly when a target (or a plot series, ``extra``) names a method the bench does not plan.

    Without this, renaming a method would silently turn its target into N/A ("absent").
    """
    missing = sorted(set(target_method_ids()).union(extra) - planned_ids())
    if missing:
        raise RuntimeError(f"bench targets refer to method ids that plan_methods() does not produce: {missing}")


def fmt_time(seconds: float | None) -> str:
    """``1.23 ms``-style time (µs, ms or s)."""
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: int) -> str:
    """``12.3 KiB``-style size."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def fmt_cell(fig: dict[str, Any]) -> str:
    """``median (min–max)`` or the status and reason of a figure that was not measured."""
    if fig.get("status") != OK:
        return f"{fig.get('status', '?')}: {fig.get('reason', '')}".strip()
    return f"{fmt_time(fig['median_s'])} ({fmt_time(fig['min_s'])}–{fmt_time(fig['max_s'])})"


# --------------------------------------------------------------------------- targets


def _find_run(results: dict[str, Any], scale: str, layout: str) -> dict[str, Any] | None:
    for run in results["runs"]:
        if run["scale"] == scale and run["layout"] == layout:
            return run
    return None


def _median(run: dict[str, Any] | None, method_id: str) -> float | None:
    if run is None:
        return None
    fig = run["figures"].get(method_id)
    if not fig or fig.get("status") != OK:
        return None
    return float(fig["median_s"])


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _row(target: str, backend: str, value: float | None, op: str, threshold: float, where: str, why: str = "") -> dict:
    if value is None:
        status = NA
    else:
        status = PASS if (value <= threshold if op == "<=" else value >= threshold) else MISS
    return {
        "target": target,
        "backend": backend,
        "value": value,
        "op": op,
        "threshold": threshold,
        "status": status,
        "verdict": status,
        "where": where,
        "reason": why if value is None else "",
    }


def _trow(t: Target, backend: str, value: float | None, where: str, why: str = "") -> dict:
    return _row(t.name, backend, value, t.op, t.threshold, where, why)


def _largest_scale(results: dict[str, Any], layout: str) -> str | None:
    runs = [r for r in results["runs"] if r["layout"] == layout]
    if not runs:
        return None
    return max(runs, key=lambda r: r["n_params"])["scale"]


def targets_mode(results: dict[str, Any]) -> tuple[bool, str]:
    """``(judged, why)``: whether the targets get a verdict (a full run at the target scale)."""
    scales = results["config"].get("scales") or sorted({r["scale"] for r in results["runs"]})
    if results["config"].get("quick"):
        return False, f"quick mode: toy scales {', '.join(scales)}"
    if _find_run(results, TARGET_SCALE, TARGET_LAYOUT) is None:
        return False, f"{TARGET_SCALE} with one group per {TARGET_LAYOUT} was not run (scales {', '.join(scales)})"
    return True, f"{TARGET_SCALE}, one group per {TARGET_LAYOUT}"


def mark_indicative(rows: list[dict[str, Any]], judged: bool) -> list[dict[str, Any]]:
    """Unless ``judged``: every measured row's ``status`` becomes INDICATIVE (``verdict`` keeps PASS/MISS)."""
    for r in rows:
        r.setdefault("verdict", r["status"])
        r["status"] = r["verdict"] if judged or r["verdict"] == NA else INDICATIVE
    return rows


def compute_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets table rows (both backends; the targets are stated for ``cpp``).

    Each row has ``verdict`` (PASS / MISS / N/A, from the numbers) and ``status``: the verdict for a
    full run at the target scale, else INDICATIVE (see :func:`targets_mode`).
    """
    check_method_ids()
    scale = TARGET_SCALE if _find_run(results, TARGET_SCALE, TARGET_LAYOUT) else _largest_scale(results, TARGET_LAYOUT)
    run = _find_run(results, scale, TARGET_LAYOUT) if scale else None
    where = f"{scale}, {TARGET_LAYOUT}" if scale else f"no '{TARGET_LAYOUT}' layout run"
    if scale and scale != TARGET_SCALE:
        where += f" (not {TARGET_SCALE})"
    rows: list[dict[str, Any]] = []
    unavailable = {b: r for b, r in results["machine"]["backends"].items() if r != "available"}

    def why(backend: str, *ids: str) -> str:
        if backend in unavailable:
            return f"{backend} backend {unavailable[backend]}"
        missing = [i for i in ids if _median(run, i) is None]
        if run is None:
            return "not run"
        reasons = [f"{i}: {run['figures'].get(i, {}).get('status', 'absent')}" for i in missing]
        return "; ".join(reasons)

    for b in BACKENDS:
        save, load = sparse_id("save", b, TARGET_FORMAT), sparse_id("load", b, TARGET_FORMAT)
        rows.append(_trow(SAVE_COST, b, _ratio(_median(run, save), _median(run, FLOOR_STATE_DICT)), where,
                          why(b, save, FLOOR_STATE_DICT)))
        rows.append(_trow(LOAD_VS_DSD, b, _ratio(_median(run, DSD_SET), _median(run, load)), where,
                          why(b, load, DSD_SET)))
        rows.extend(_largest_measured_rows(results, run, LOAD_VS_DSD, b, DSD_SET, load))
        rows.append(_trow(LOAD_COST, b, _ratio(_median(run, load), _median(run, FLOOR_LOAD_STATE_DICT)), where,
                          why(b, load, FLOOR_LOAD_STATE_DICT)))
        rows.extend(_largest_measured_rows(results, run, LOAD_COST, b, load, FLOOR_LOAD_STATE_DICT))
    for fn in CORE_TARGET_FUNCTIONS:
        py, cpp = core_id(fn, "python"), core_id(fn, "cpp")
        rows.append(_trow(core_target(fn), "cpp", _ratio(_median(run, py), _median(run, cpp)), where,
                          why("cpp", py, cpp)))
    rows.extend(dcp_rows(results, run, where))
    rows.extend(growth_summary(results))
    return mark_indicative(rows, targets_mode(results)[0])


def _largest_measured_rows(
    results: dict[str, Any], target_run: dict[str, Any] | None, target: Target, backend: str, num: str, den: str,
) -> list[dict[str, Any]]:
    """When the target run lacks ``num``/``den`` (a quadratic torch baseline was skipped), the same
    ratio at the largest scale of each layout where both were measured, marked as such."""
    if _ratio(_median(target_run, num), _median(target_run, den)) is not None:
        return []
    rows = []
    for layout in ("param", "layer"):
        done = [r for r in results["runs"] if r["layout"] == layout and r is not target_run
                and _ratio(_median(r, num), _median(r, den)) is not None]
        if done:
            src = max(done, key=lambda r: r["n_params"])
            rows.append(_trow(target, backend, _ratio(_median(src, num), _median(src, den)),
                              f"{src['scale']}, {layout} (largest scale where both were measured)"))
    return rows


def dcp_rows(results: dict[str, Any], run: dict[str, Any] | None, where: str) -> list[dict[str, Any]]:
    """DCP of the param-group metadata alone, flat vs packed: time and bytes ratios.

    When the target run skipped the flat DCP figures (``--dcp-max-items``), the largest run of the
    same layout that has all four is used instead (the ratio grows with the parameter count, so a
    smaller scale understates it); ``where`` says so.
    """
    save_p, load_p, save_f, load_f = DCP_GROUP_IDS
    src = run
    if src is None or any(_median(src, i) is None for i in DCP_GROUP_IDS):
        layout = run["layout"] if run else TARGET_LAYOUT
        done = [r for r in results["runs"] if r["layout"] == layout and all(_median(r, i) is not None
                                                                            for i in DCP_GROUP_IDS)]
        if done:
            src = max(done, key=lambda r: r["n_params"])
            skipped = run["figures"].get(save_f, {}).get("reason", "") if run else ""
            where = f"{src['scale']}, {layout} (largest scale with flat DCP measured; {where}: {skipped or 'not run'})"
    med = {i: _median(src, i) for i in DCP_GROUP_IDS}
    packed_t = None if None in (med[save_p], med[load_p]) else med[save_p] + med[load_p]
    flat_t = None if None in (med[save_f], med[load_f]) else med[save_f] + med[load_f]
    why = "; ".join(f"{i}: {src['figures'].get(i, {}).get('status', 'absent')}" for i in DCP_GROUP_IDS
                    if med[i] is None) if src else "not run"
    fig_f = src["figures"].get(save_f, {}) if src else {}
    fig_p = src["figures"].get(save_p, {}) if src else {}
    return [
        _trow(DCP_TIME, "—", _ratio(flat_t, packed_t), where, why),
        _trow(DCP_BYTES, "—", _ratio(fig_f.get("bytes"), fig_p.get("bytes")), where, why),
    ]


def growth_pair(results: dict[str, Any], layout: str) -> tuple[str, str, float] | None:
    """``(small, big, limit)``: the pair of scales for the growth target and its threshold.

    ``24x128`` -> ``61x256`` with limit 6 when both ran; otherwise the two largest scales with
    limit ``1.2 x`` their parameter-count ratio (6 is 1.19 x 47 275 / 9 384).
    """
    runs = {r["scale"]: r for r in results["runs"] if r["layout"] == layout}
    if all(s in runs for s in GROWTH_PAIR):
        return GROWTH_PAIR[0], GROWTH_PAIR[1], GROWTH_LIMIT
    ordered = sorted(runs.values(), key=lambda r: r["n_params"])
    if len(ordered) < 2:
        return None
    small, big = ordered[-2], ordered[-1]
    return small["scale"], big["scale"], round(GROWTH_SLACK * big["n_params"] / small["n_params"], 2)


def growth_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per sparse_ckpt figure (families ``sparse`` and ``core``): time(big) / time(small); torch's
    floor figures are listed too, for reference (backend ``—``, not counted by the summary)."""
    rows: list[dict[str, Any]] = []
    for layout in results["config"]["layouts"]:
        pair = growth_pair(results, layout)
        if pair is None:
            continue
        small, big, limit = pair
        r_small, r_big = _find_run(results, small, layout), _find_run(results, big, layout)
        assert r_small is not None and r_big is not None
        for mid, fig in r_big["figures"].items():
            family = fig.get("family")
            if family not in SPARSE_FAMILIES and family != "floor":
                continue
            ratio = _ratio(_median(r_big, mid), _median(r_small, mid))
            # torch's own figures are a reference (backend "—"), not part of the target
            name = f"growth {mid}" if family != "floor" else f"growth {mid} (torch, for reference)"
            rows.append(_row(name, fig.get("backend") or "—", ratio, "<=", limit,
                             f"{big} / {small}, {layout}", fig.get("status", "") if ratio is None else ""))
    return rows


def growth_summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One targets row per backend: every growth ratio within its limit?"""
    rows = growth_rows(results)
    out = []
    for b in BACKENDS:
        mine = [r for r in rows if r["backend"] == b and r["value"] is not None]
        if not mine:
            out.append(_row(GROWTH_NAME, b, None, "<=", GROWTH_LIMIT, "—",
                            "needs two scales with both backends measured"))
            continue
        worst = max(mine, key=lambda r: r["value"] / r["threshold"])
        row = _row(f"{GROWTH_NAME} (worst)", b, worst["value"], "<=", worst["threshold"],
                   f"{worst['where']}: {worst['target'].removeprefix('growth ')}")
        misses = sum(1 for r in mine if r["verdict"] == MISS)
        row["detail"] = f"{len(mine) - misses}/{len(mine)} within the limit"
        out.append(row)
    return out


# --------------------------------------------------------------------------- markdown


def _fmt_value(row: dict[str, Any]) -> str:
    v = row["value"]
    if v is None:
        return "—"
    return f"{v:.2f}×" if v < 100 else f"{v:.0f}×"


def fmt_status(row: dict[str, Any]) -> str:
    """PASS / MISS / N/A (reason), or for an indicative row ``indicative: within`` / ``outside``."""
    status = row["status"]
    if status == INDICATIVE:
        status = "indicative: " + ("within" if row.get("verdict") == PASS else "outside")
    return status + (f" ({row['reason']})" if row.get("reason") else "")


def indicative_banner(results: dict[str, Any]) -> str | None:
    """The warning printed above the targets when they get no verdict, else ``None``."""
    judged, why = targets_mode(results)
    if judged:
        return None
    return (f"INDICATIVE ONLY ({why}): the targets are stated at {TARGET_SCALE} with one group per "
            f"{TARGET_LAYOUT}, where torch's baselines grow quadratically and sparse_ckpt linearly; on smaller "
            "scales a ratio 'outside' its target is not a failure. Run the full bench (without --quick) to judge them.")


def targets_markdown(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The targets table."""
    lines = ["| target | backend | measured | required | status | where |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        where = r["where"] + (f" — {r['detail']}" if r.get("detail") else "")
        lines.append(f"| {r['target']} | {r['backend']} | {_fmt_value(r)} | {r['op']} {r['threshold']:g}× "
                     f"| {fmt_status(r)} | {where} |")
    return lines


def run_markdown(run: dict[str, Any]) -> list[str]:
    """One table for one ``(scale, layout)`` run."""
    head = (f"### {run['scale']}, one group per {run['layout']} — {run['n_params']:,} params, "
            f"{run['n_stateful']:,} with state, {run['n_groups']:,} groups")
    lines = [head, "", "| method | backend | format | median (min–max) | n | note |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mid, fig in run["figures"].items():
        fmt = fig.get("format") or ""
        if fig.get("part") == "groups":
            fmt += " (groups)"
        note = fig.get("note", "")
        if "items" in fig:
            note = f"{fig['items']:,} items, {fmt_bytes(fig['bytes'])}" + (f"; {note}" if note else "")
        n = fig.get("n", "")
        if n and fig.get("inner", 1) > 1:
            n = f"{n} × {fig['inner']}"
        lines.append(f"| {fig.get('label', mid)} | {fig.get('backend') or '—'} | {fmt or '—'} | {fmt_cell(fig)} "
                     f"| {n} | {note} |")
    return lines


def machine_line(m: dict[str, Any]) -> str:
    """``CPU, N cores; Python; torch; device; backends`` in one line."""
    device = m["device"] + (f" ({m['device_name']})" if m.get("device_name") else "")
    return (f"{m['cpu_model']}, {m['cores']} cores; Python {m['python']}; torch {m['torch']}; device {device}; "
            "backends: " + ", ".join(f"{k} {v}" for k, v in m["backends"].items()))


def render_markdown(results: dict[str, Any]) -> str:
    """The whole ``results.md``."""
    m = results["machine"]
    c = results["config"]
    judged, _ = targets_mode(results)
    banner = indicative_banner(results)
    lines = [
        "# sparse_ckpt bench results",
        "",
        f"Machine: {machine_line(m)}.",
        "",
        (f"Command: `{results['command']}` — repeats {c['repeats']} (warm-up excluded), budget {c['budget_s']:g} s "
        f"per method, hidden {c['hidden'] or 'tiny (2,)'}, {c['no_state_fraction']:.0%} of experts without state, "
        f"state via `{c['state_init']}`, gc {'enabled' if c['gc'] else 'disabled while timing'}."),
        "",
        "## Targets",
        "",
        *([f"> **{banner}**", ""] if banner else []),
        *targets_markdown(results["targets"]),
        "",
    ]
    growth = mark_indicative(growth_rows(results), judged)
    if growth:
        lines += ["## Growth of every sparse_ckpt figure", "", *targets_markdown(growth), ""]
    lines += ["## Timings", ""]
    for run in results["runs"]:
        lines += run_markdown(run) + [""]
    notes = results.get("notes") or {}
    if notes:
        lines += ["## Notes", ""] + [f"- {k}: {v}" for k, v in notes.items()] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plots

# One colour per kind of method, the same in every figure; cpp solid, python dashed.
C_FLOOR, C_DSD = "#222222", "tab:red"
C_SPARSE = {"packed": "tab:blue", "flat": "tab:purple"}
C_DCP = {"packed": "tab:green", "flat": "tab:orange"}
BACKEND_STYLE = {"cpp": "-", "python": "--"}
DCP_PART_STYLE = {"all": "-", "groups": ":"}
DCP_PART_MARKER = {"all": "o", "groups": "s"}
DCP_PART_NAME = {"all": "whole dict", "groups": "param groups only"}
CORE_PANELS = (
    ("core functions: save side", ("pack_optimizer", "remap_to_fqns", "flatten_state", "flatten_groups",
                                   "encode_table")),
    ("core functions: load side", ("decode_table", "unflatten.packed", "unflatten.flat", "match_groups",
                                   "assign_state_ids")),
)
FIGURE_NAMES = ("headline.png", "scaling.png", "core.png")


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
    return [Series(f"{name} ({fmt}), {b}" if len(formats) > 1 else f"{name}, {b}",
                   (sparse_id(op, b, fmt),), C_SPARSE[fmt], BACKEND_STYLE[b])
            for fmt in formats for b in BACKENDS]


def _save_series(formats: tuple[str, ...] = ("packed",)) -> list[Series]:
    return [Series("optimizer.state_dict() (floor)", (FLOOR_STATE_DICT,), C_FLOOR), *_sparse_series("save", formats),
            Series("DSD get_optimizer_state_dict", (DSD_GET,), C_DSD)]


def _load_series(formats: tuple[str, ...] = ("packed",)) -> list[Series]:
    return [Series("optimizer.load_state_dict() (floor)", (FLOOR_LOAD_STATE_DICT,), C_FLOOR),
            *_sparse_series("load", formats), Series("DSD set_optimizer_state_dict", (DSD_SET,), C_DSD)]


def _dcp_series(ops: tuple[str, ...], field: str = "median_s") -> list[Series]:
    return [Series(f"{fmt}, {DCP_PART_NAME[part]}", tuple(dcp_id(op, fmt, part) for op in ops), C_DCP[fmt],
                   DCP_PART_STYLE[part], field, DCP_PART_MARKER[part])
            for fmt in ("packed", "flat") for part in ("all", "groups")]


def _core_series(functions: Iterable[str], colors: dict[str, str]) -> list[Series]:
    return [Series(f"{fn}, {b}", (core_id(fn, b),), colors[fn], BACKEND_STYLE[b])
            for fn in functions for b in BACKENDS]


def plot_method_ids() -> list[str]:
    """Every method id a plot series refers to (checked like the targets')."""
    series = [*_save_series(("packed", "flat")), *_load_series(("packed", "flat")),
              *_dcp_series(("save", "load")), *_core_series(CORE_FUNCTIONS, dict.fromkeys(CORE_FUNCTIONS, ""))]
    return [i for s in series for i in s.ids]


def _not_measured(series: Series, runs: list[dict[str, Any]]) -> str:
    missing = [r["scale"] for r in runs if series.value(r) is None]
    if not missing:
        return ""
    if len(missing) == len(runs):
        return " — not measured"
    return f" — not measured at {', '.join(missing)}"


def _draw(ax: Any, runs: list[dict[str, Any]], series: list[Series], ylabel: str, title: str,
          annotate_missing: bool = True) -> list[Any]:
    """Plot ``series`` over ``runs`` on log-log axes; return the legend handles (one per series)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter, NullLocator

    handles = []
    for s in series:
        pts = [(r["n_params"], s.value(r)) for r in runs]
        pts = [(x, y) for x, y in pts if y is not None]
        label = s.label + (_not_measured(s, runs) if annotate_missing else "")
        if pts:
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], s.style, color=s.color, marker=s.marker,
                              markersize=5 if s.marker == "o" else 4.5, linewidth=1.6, label=label)
            handles.append(line)
        else:
            handles.append(Line2D([], [], linestyle=s.style, color=s.color, marker=s.marker, alpha=0.35,
                                  label=label))
    if not any(h.get_xdata() is not None and len(h.get_xdata()) for h in handles):
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


def ratio_note(runs: list[dict[str, Any]], pairs: Iterable[tuple[str, Series, Series]]) -> str:
    """``at 4x16: name 1.3×, ...``: ``num / den`` at the largest run where both were measured."""
    parts = []
    for name, num, den in pairs:
        done = [r for r in runs if num.value(r) is not None and den.value(r) is not None]
        if done:
            r = max(done, key=lambda r: r["n_params"])
            value = num.value(r) / den.value(r)  # type: ignore[operator]
            digits = 0 if value >= 100 else 1 if value >= 1 else 2
            parts.append(f"{name} {value:.{digits}f}× ({r['scale']})")
    return "; ".join(parts)


def _legend_below(ax: Any, handles: list[Any], ncol: int = 1) -> None:
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=ncol, fontsize=8,
              frameon=False, handlelength=3)


def _runs_of(results: dict[str, Any], layout: str) -> list[dict[str, Any]]:
    return sorted((r for r in results["runs"] if r["layout"] == layout), key=lambda r: r["n_params"])


def _suptitle(fig: Any, results: dict[str, Any], what: str) -> None:
    judged, why = targets_mode(results)
    mode = "" if judged else f"\nINDICATIVE — {why}: not the target scale"
    fig.suptitle(f"sparse_ckpt bench: {what}{mode}\n{machine_line(results['machine'])}", fontsize=10)


def _title(title: str, note: str) -> str:
    return f"{title}\n{note}" if note else title


def plot_headline(results: dict[str, Any], path: str, plt: Any) -> None:
    """Save and load time vs the floor and DSD; DCP packed vs flat in time, bytes and items."""
    layouts = list(results["config"]["layouts"])
    layout = TARGET_LAYOUT if TARGET_LAYOUT in layouts else layouts[0]
    runs = _runs_of(results, layout)
    fig = plt.figure(figsize=(15, 10.5), layout="constrained")
    gs = fig.add_gridspec(2, 6)
    ax_save, ax_load = fig.add_subplot(gs[0, 0:3]), fig.add_subplot(gs[0, 3:6])
    ax_t, ax_b, ax_i = fig.add_subplot(gs[1, 0:2]), fig.add_subplot(gs[1, 2:4]), fig.add_subplot(gs[1, 4:6])
    save, load = _save_series(), _load_series()
    floor_s, cpp_s, dsd_s = save[0], save[1], save[-1]
    floor_l, cpp_l, dsd_l = load[0], load[1], load[-1]
    note_s = ratio_note(runs, [("cpp / floor", cpp_s, floor_s), ("DSD get / cpp", dsd_s, cpp_s)])
    note_l = ratio_note(runs, [("cpp / floor", cpp_l, floor_l), ("DSD set / cpp", dsd_l, cpp_l)])
    for ax, series, title in ((ax_save, save, _title(f"save: optimizer → dict (one group per {layout})", note_s)),
                              (ax_load, load, _title(f"load: dict → fresh optimizer (one group per {layout})", note_l))):
        handles = _draw(ax, runs, series, "seconds (median)", title)
        long = max(len(h.get_label()) for h in handles) > 32
        _legend_below(ax, handles, ncol=1 if long else 2)
    panels = ((ax_t, _dcp_series(("save", "load")), "seconds (median save + load)", "DCP save + load", "time"),
              (ax_b, _dcp_series(("save",), "bytes"), "bytes on disk", "DCP checkpoint size", "bytes"),
              (ax_i, _dcp_series(("save",), "items"), "items in the DCP metadata", "DCP items", "items"))
    for ax, series, ylabel, title, what in panels:
        packed_groups, flat_groups = series[1], series[3]
        note = ratio_note(runs, [(f"flat / packed {what}, groups", flat_groups, packed_groups)])
        handles = _draw(ax, runs, series, ylabel, _title(f"{title} (one group per {layout})", note), ax is ax_t)
        if ax is ax_t:
            legend = handles
    fig.legend(handles=legend, title="DCP of the sparse dict (bottom row)", loc="outside lower center", ncol=4,
               fontsize=8, title_fontsize=8, frameon=False, handlelength=3)
    _suptitle(fig, results, "sparse_ckpt vs optimizer.state_dict() and DSD; DCP of packed vs flat dicts")
    fig.savefig(path, dpi=100)


def plot_scaling(results: dict[str, Any], path: str, plt: Any) -> None:
    """Every save/load/DSD/DCP figure, one row per layout, both formats and both backends."""
    layouts = list(results["config"]["layouts"])
    panels = (
        ("save side", lambda: _save_series(("packed", "flat")), "seconds (median)"),
        ("load side", lambda: _load_series(("packed", "flat")), "seconds (median)"),
        ("dcp.save", lambda: _dcp_series(("save",)), "seconds (median)"),
        ("dcp.load", lambda: _dcp_series(("load",)), "seconds (median)"),
    )
    fig, axes = plt.subplots(len(layouts), len(panels), figsize=(5 * len(panels), 3.8 * len(layouts) + 2.2),
                             squeeze=False, layout="constrained")
    for row, layout in enumerate(layouts):
        runs = _runs_of(results, layout)
        for col, (title, make, ylabel) in enumerate(panels):
            handles = _draw(axes[row][col], runs, make(), ylabel, f"{title} — one group per {layout}",
                            annotate_missing=row == len(layouts) - 1)
            if row == len(layouts) - 1:
                _legend_below(axes[row][col], handles)
    _suptitle(fig, results, "every save / load / DSD / DCP figure (cpp solid, python dashed)")
    fig.savefig(path, dpi=100)


def plot_core(results: dict[str, Any], path: str, plt: Any) -> None:
    """The core functions alone: one colour per function, cpp solid and python dashed."""
    from matplotlib.lines import Line2D

    layouts = list(results["config"]["layouts"])
    palette = plt.get_cmap("tab10")
    colors = {fn: palette(i % 10) for i, fn in enumerate(CORE_FUNCTIONS)}
    fig, axes = plt.subplots(len(layouts), len(CORE_PANELS), figsize=(7 * len(CORE_PANELS),
                             3.8 * len(layouts) + 2.4), squeeze=False, layout="constrained")
    style_key = [Line2D([], [], color="grey", linestyle=BACKEND_STYLE[b], label=f"{b} core") for b in BACKENDS]
    for row, layout in enumerate(layouts):
        runs = _runs_of(results, layout)
        for col, (title, functions) in enumerate(CORE_PANELS):
            ax = axes[row][col]
            _draw(ax, runs, _core_series(functions, colors), "seconds (median)", f"{title} — one group per {layout}")
            if row == len(layouts) - 1:
                fn_key = [Line2D([], [], color=colors[fn], linewidth=2.5, label=f"core.{fn}") for fn in functions]
                _legend_below(ax, fn_key + style_key, ncol=3)
    _suptitle(fig, results, "core functions alone (cpp solid, python dashed, same colour)")
    fig.savefig(path, dpi=100)


def write_plots(results: dict[str, Any], out_dir: str) -> tuple[list[str], str | None]:
    """``headline.png``, ``scaling.png``, ``core.png`` into ``out_dir``: ``(paths, None)``, or
    ``([], message)`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], ("matplotlib is not installed (pip install 'sparse_ckpt[bench]'); "
                    f"{', '.join(FIGURE_NAMES)} were not written")
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


def write_all(results: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Write results.json, results.md and the figures; return ``{"json", "md", "pngs", "plot_message"}``."""
    os.makedirs(out_dir, exist_ok=True)
    results["targets"] = compute_targets(results)
    judged, why = targets_mode(results)
    results["targets_mode"] = {"judged": judged, "why": why}
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
        f.write("\n")
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(render_markdown(results))
    pngs, msg = write_plots(results, out_dir)
    return {"json": json_path, "md": md_path, "pngs": pngs, "plot_message": msg}
