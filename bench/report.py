"""Turn the bench's results into ``results.json``, ``results.md`` and the figures.

The targets are computed here as ratios; they are a report, never an assertion. Each target has
its own scale and layout (:class:`Target`): the save/load cost and backend targets at ``61x256``
(DeepSeek-V3 shaped), the DCP targets at ``24x128``, the growth targets from ``61x256`` to
``200x1024``. A row gets a verdict (PASS / MISS) only in a full run that measured its scale;
otherwise it is computed at the largest scale of its layout that was measured and reported as
``INDICATIVE`` (torch's baselines grow quadratically and sparse_ckpt linearly, so a ratio measured
on a toy scale says little about the target), or ``N/A`` with the reason (the growth targets need
both of their scales). Ratios that used to be targets are kept as information (``info``), with a
growth table of every figure.

Figures: ``headline.png`` (sparse_ckpt vs the floor and DSD, DCP in time, bytes and items),
``scaling.png`` (every save/load/DSD/DCP figure, per layout) and ``core.png`` (the core functions,
cpp solid and python dashed in the same colour).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

from .measure import (
    BACKENDS,
    CORE_FUNCTIONS,
    DCP_NAIVE_LOAD,
    DCP_NAIVE_SAVE,
    DCP_PACKED_GROUPS_SAVE,
    DCP_PACKED_SAVE,
    DCP_STATEFUL_LOAD,
    DCP_STATEFUL_SAVE,
    DCP_VARIANTS,
    DSD_GET,
    DSD_SET,
    EXPORT_LOAD,
    EXPORT_SAVE,
    FIRST_CALL,
    FLOOR_LOAD_STATE_DICT,
    FLOOR_STATE_DICT,
    NAIVE,
    SPARSE_FAMILIES,
    STATEFUL,
    core_id,
    dcp_id,
    method_id,
    planned_ids,
    sparse_id,
)

TARGET_SCALE = "61x256"
"""Scale of the save/load cost and backend targets (47 275 params); a full run that measured it
with one group per parameter gets verdicts (:func:`targets_mode`)."""
TARGET_LAYOUT = "param"
TARGET_FORMAT = "packed"
TARGET_BACKEND = "cpp"
"""The targets are stated for the C++ core (the python core is measured alongside)."""
DCP_TARGET_SCALE = "24x128"
"""Scale of the DCP targets (9 384 params): DCP writes one item per state tensor, so a DCP figure
at 61x256 already takes a minute; the naive layout with one group per parameter, 127 000 items."""
GROWTH_FROM = "61x256"
GROWTH_TO = "200x1024"
"""The growth targets compare the per-parameter cost at these two scales (47 275 and 615 800 params)."""

SAVE_COST_PARAM_MAX = 1.5
"""sparse_state_dict / optimizer.state_dict(), one group per parameter, at most."""
SAVE_COST_LAYER_MAX = 2.5
"""sparse_state_dict / optimizer.state_dict(), one group per layer, at most."""
LOAD_COST_PARAM_MAX = 2.5
"""load_sparse_state_dict / optimizer.state_dict() (the save floor, not load_state_dict), one group per parameter."""
LOAD_COST_LAYER_MAX = 6.0
"""load_sparse_state_dict / optimizer.state_dict(), one group per layer."""
BACKEND_SPEEDUP_MIN = 3.0
"""(python save + load) / (cpp save + load), at least."""
DCP_VS_NAIVE_MAX = 0.75
"""dcp.save + dcp.load of the whole optimizer (SparseOptimizerState + planner) / the naive layout, at most."""
DCP_ITEMS_MAX = 1.0
"""DCP items of the packed dict / (param-shaped state tensors + leaves + table items), at most."""
GROWTH_VS_TORCH_MAX = 1.3
"""per-parameter growth of sparse save (load) / that of optimizer.state_dict(), at most."""

OK = "ok"
PASS, MISS, NA, INDICATIVE = "PASS", "MISS", "N/A", "INDICATIVE"


@dataclass(frozen=True)
class Target:
    """One target: ``name`` (the row's title) ``op`` (``<=`` / ``>=``) ``threshold``, at ``scale`` / ``layout``."""

    name: str
    op: str
    threshold: float
    scale: str
    layout: str


SAVE_COST_PARAM = Target("save cost: sparse_state_dict / optimizer.state_dict(), one group per param", "<=",
                         SAVE_COST_PARAM_MAX, TARGET_SCALE, "param")
SAVE_COST_LAYER = Target("save cost: sparse_state_dict / optimizer.state_dict(), one group per layer", "<=",
                         SAVE_COST_LAYER_MAX, TARGET_SCALE, "layer")
LOAD_COST_PARAM = Target("load cost: load_sparse_state_dict / optimizer.state_dict(), one group per param", "<=",
                         LOAD_COST_PARAM_MAX, TARGET_SCALE, "param")
LOAD_COST_LAYER = Target("load cost: load_sparse_state_dict / optimizer.state_dict(), one group per layer", "<=",
                         LOAD_COST_LAYER_MAX, TARGET_SCALE, "layer")
BACKEND_SPEEDUP = Target("backend: python / cpp on sparse_state_dict + load_sparse_state_dict", ">=",
                         BACKEND_SPEEDUP_MIN, TARGET_SCALE, "param")
DCP_VS_NAIVE_PARAM = Target("DCP time: whole optimizer (SparseOptimizerState + planner) / naive layout, "
                            "one group per param", "<=", DCP_VS_NAIVE_MAX, DCP_TARGET_SCALE, "param")
DCP_VS_NAIVE_LAYER = Target("DCP time: whole optimizer (SparseOptimizerState + planner) / naive layout, "
                            "one group per layer", "<=", DCP_VS_NAIVE_MAX, DCP_TARGET_SCALE, "layer")
DCP_ITEMS_PARAM = Target("DCP items: packed / (param-shaped state tensors + leaves + tables), one group per param",
                         "<=", DCP_ITEMS_MAX, DCP_TARGET_SCALE, "param")
DCP_ITEMS_LAYER = Target("DCP items: packed / (param-shaped state tensors + leaves + tables), one group per layer",
                         "<=", DCP_ITEMS_MAX, DCP_TARGET_SCALE, "layer")
GROWTH_SAVE_PARAM = Target(f"growth {GROWTH_FROM} → {GROWTH_TO} per param: sparse_state_dict / "
                           "optimizer.state_dict(), one group per param", "<=", GROWTH_VS_TORCH_MAX, GROWTH_TO, "param")
GROWTH_SAVE_LAYER = Target(f"growth {GROWTH_FROM} → {GROWTH_TO} per param: sparse_state_dict / "
                           "optimizer.state_dict(), one group per layer", "<=", GROWTH_VS_TORCH_MAX, GROWTH_TO, "layer")
GROWTH_LOAD_PARAM = Target(f"growth {GROWTH_FROM} → {GROWTH_TO} per param: load_sparse_state_dict / "
                           "optimizer.state_dict(), one group per param", "<=", GROWTH_VS_TORCH_MAX, GROWTH_TO, "param")
GROWTH_LOAD_LAYER = Target(f"growth {GROWTH_FROM} → {GROWTH_TO} per param: load_sparse_state_dict / "
                           "optimizer.state_dict(), one group per layer", "<=", GROWTH_VS_TORCH_MAX, GROWTH_TO, "layer")
TARGETS = (SAVE_COST_PARAM, SAVE_COST_LAYER, LOAD_COST_PARAM, LOAD_COST_LAYER, BACKEND_SPEEDUP, DCP_VS_NAIVE_PARAM,
           DCP_VS_NAIVE_LAYER, DCP_ITEMS_PARAM, DCP_ITEMS_LAYER, GROWTH_SAVE_PARAM, GROWTH_SAVE_LAYER,
           GROWTH_LOAD_PARAM, GROWTH_LOAD_LAYER)
"""Every target, in table order."""

SAVE = sparse_id("save", TARGET_BACKEND, TARGET_FORMAT)
LOAD = sparse_id("load", TARGET_BACKEND, TARGET_FORMAT)
SAVE_PY = sparse_id("save", "python", TARGET_FORMAT)
SAVE_FIRST = method_id("sparse", "save", TARGET_BACKEND, TARGET_FORMAT, FIRST_CALL)
LOAD_FIRST = method_id("sparse", "load", TARGET_BACKEND, TARGET_FORMAT, FIRST_CALL)
LOAD_PY = sparse_id("load", "python", TARGET_FORMAT)
DCP_GROUP_IDS = (dcp_id("save", "packed", "groups"), dcp_id("load", "packed", "groups"),
                 dcp_id("save", "flat", "groups"), dcp_id("load", "flat", "groups"))
INFO_CORE_FUNCTIONS = ("pack_optimizer", "remap_to_fqns", "encode_table")
"""Core functions whose python / cpp ratio is listed as information."""
INFO_FIRST_SAVE = "sparse_state_dict: first call (FQN map built) / later calls (kept map checked)"
INFO_FIRST_LOAD = "load_sparse_state_dict: first call (FQN map built) / later calls (kept map checked)"
INFO_DSD_SET = "DSD set_optimizer_state_dict / load_sparse_state_dict"
INFO_LOAD_VS_TORCH_LOAD = "load_sparse_state_dict / optimizer.load_state_dict()"
INFO_DSD_GET = "DSD get_optimizer_state_dict / sparse_state_dict"
INFO_DCP_GROUPS_TIME = "DCP save+load of param groups: flat / packed time"
INFO_DCP_GROUPS_BYTES = "DCP param groups: flat / packed bytes"
INFO_DCP_NAIVE_BYTES = "DCP bytes: naive layout / whole optimizer (SparseOptimizerState)"
INFO_EXPORT_BYTES = "export dir bytes / DCP dir bytes (export_checkpoint vs dcp.save of SparseOptimizerState)"
INFO_EXPORT_SAVE = "export_checkpoint / dcp.save time (SparseOptimizerState)"
INFO_EXPORT_LOAD = "load_export / dcp.load time (SparseOptimizerState + SparseLoadPlanner)"
EXPORT_INFO = (
    (INFO_EXPORT_BYTES, EXPORT_SAVE, DCP_STATEFUL_SAVE, "bytes"),
    (INFO_EXPORT_SAVE, EXPORT_SAVE, DCP_STATEFUL_SAVE, "median_s"),
    (INFO_EXPORT_LOAD, EXPORT_LOAD, DCP_STATEFUL_LOAD, "median_s"),
)
"""``(name, export figure, DCP figure, field)`` of the export rows: the pickle-free export (made from the
``dcp/save/packed/stateful`` checkpoint) against that DCP checkpoint, at every scale and layout where
both were measured."""


def target_method_ids() -> list[str]:
    """Every method id the targets and the information rows divide."""
    ids = [FLOOR_STATE_DICT, FLOOR_LOAD_STATE_DICT, DSD_GET, DSD_SET, SAVE, LOAD, SAVE_PY, LOAD_PY,
           DCP_STATEFUL_SAVE, DCP_STATEFUL_LOAD, DCP_NAIVE_SAVE, DCP_NAIVE_LOAD, DCP_PACKED_SAVE,
           DCP_PACKED_GROUPS_SAVE, *DCP_GROUP_IDS, EXPORT_SAVE, EXPORT_LOAD, SAVE_FIRST, LOAD_FIRST]
    ids += [core_id(fn, b) for fn in INFO_CORE_FUNCTIONS for b in ("python", "cpp")]
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


def _sum(run: dict[str, Any] | None, *ids: str) -> float | None:
    values = [_median(run, i) for i in ids]
    return None if None in values else sum(values)  # type: ignore[arg-type]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _missing(results: dict[str, Any], run: dict[str, Any] | None, *ids: str) -> str:
    """Why some of ``ids`` have no median in ``run`` (status and reason of each), or ``""``."""
    if run is None:
        return "not run"
    unavailable = {b: r for b, r in results["machine"]["backends"].items() if r != "available"}
    out = []
    for i in ids:
        fig = run["figures"].get(i, {})
        if fig.get("status") == OK:
            continue
        backend = fig.get("backend") or next((b for b in unavailable if f"/{b}/" in f"/{i}/"), None)
        if backend in unavailable:
            out.append(f"{backend} backend {unavailable[backend]}")
        else:
            out.append(f"{i}: {fig.get('status', 'absent')}" + (f" ({fig['reason']})" if fig.get("reason") else ""))
    return "; ".join(dict.fromkeys(out))


def _row(name: str, backend: str, value: float | None, op: str, threshold: float, where: str, why: str = "",
         judged: bool = False, detail: str = "") -> dict[str, Any]:
    """A targets row: ``verdict`` from the numbers; ``status`` the verdict, or INDICATIVE unless ``judged``."""
    if value is None:
        verdict = NA
    else:
        verdict = PASS if (value <= threshold if op == "<=" else value >= threshold) else MISS
    return {
        "target": name,
        "backend": backend,
        "value": value,
        "op": op,
        "threshold": threshold,
        "verdict": verdict,
        "status": verdict if judged or verdict == NA else INDICATIVE,
        "where": where,
        "reason": why if value is None else "",
        "detail": detail,
    }


def targets_mode(results: dict[str, Any]) -> tuple[bool, str]:
    """``(judged, why)``: whether the targets get verdicts at all (a full run that measured
    :data:`TARGET_SCALE` with one group per :data:`TARGET_LAYOUT`). Each row is judged only at its own scale."""
    scales = results["config"].get("scales") or sorted({r["scale"] for r in results["runs"]})
    if results["config"].get("quick"):
        return False, f"quick mode: toy scales {', '.join(scales)}"
    if _find_run(results, TARGET_SCALE, TARGET_LAYOUT) is None:
        layouts = results["config"].get("layouts") or []
        if not results["runs"] and TARGET_SCALE in scales and TARGET_LAYOUT in layouts:  # the header, before any run
            return True, f"{TARGET_SCALE}, one group per {TARGET_LAYOUT} (in this run's scales)"
        return False, f"{TARGET_SCALE} with one group per {TARGET_LAYOUT} was not run (scales {', '.join(scales)})"
    return True, f"{TARGET_SCALE}, one group per {TARGET_LAYOUT}"


Measure = Callable[[dict[str, Any]], tuple[Optional[float], str, str]]  # Optional, not "| None": evaluated on import (3.9)
"""``run -> (value, why it is missing, detail)``."""


def _at_scale(results: dict[str, Any], target: Target, backend: str, measure: Measure) -> dict[str, Any]:
    """``target`` at its scale; when that scale was not run (or its figures are missing there), at the
    largest scale of the layout where ``measure`` has a value, as INDICATIVE, with the scale named."""
    full = not results["config"].get("quick")
    run = _find_run(results, target.scale, target.layout)
    where = f"{target.scale}, {target.layout}"
    value, why, detail = measure(run) if run is not None else (None, "not run", "")
    if value is not None:
        return _row(target.name, backend, value, target.op, target.threshold, where, judged=full, detail=detail)
    done = [(r, measure(r)) for r in results["runs"] if r["layout"] == target.layout and r is not run]
    done = [(r, m) for r, m in done if m[0] is not None]
    if not done:
        return _row(target.name, backend, None, target.op, target.threshold, where, why)
    src, (value, _why, detail) = max(done, key=lambda rm: rm[0]["n_params"])
    note = f"{src['scale']}, {target.layout} (largest measured; {target.scale}: {why})"
    return _row(target.name, backend, value, target.op, target.threshold, note, detail=detail)


def _cost(num: str, den: str, results: dict[str, Any]) -> Measure:
    def measure(run: dict[str, Any]) -> tuple[float | None, str, str]:
        value = _ratio(_median(run, num), _median(run, den))
        if value is None:
            return None, _missing(results, run, num, den), ""
        return value, "", f"{fmt_time(_median(run, num))} vs {fmt_time(_median(run, den))}"
    return measure


def _speedup(results: dict[str, Any]) -> Measure:
    def measure(run: dict[str, Any]) -> tuple[float | None, str, str]:
        py, cpp = _sum(run, SAVE_PY, LOAD_PY), _sum(run, SAVE, LOAD)
        value = _ratio(py, cpp)
        if value is None:
            return None, _missing(results, run, SAVE_PY, LOAD_PY, SAVE, LOAD), ""
        return value, "", f"python {fmt_time(py)} vs cpp {fmt_time(cpp)} (save + load)"
    return measure


def _dcp_vs_naive(results: dict[str, Any]) -> Measure:
    ids = (DCP_STATEFUL_SAVE, DCP_STATEFUL_LOAD, DCP_NAIVE_SAVE, DCP_NAIVE_LOAD)

    def measure(run: dict[str, Any]) -> tuple[float | None, str, str]:
        packed, naive = _sum(run, *ids[:2]), _sum(run, *ids[2:])
        value = _ratio(packed, naive)
        if value is None:
            return None, _missing(results, run, *ids), ""
        items = [run["figures"][i].get("items") for i in (DCP_STATEFUL_SAVE, DCP_NAIVE_SAVE)]
        detail = f"{fmt_time(packed)} vs {fmt_time(naive)} (save + load)"
        if None not in items:
            detail += f"; {items[0]:,} vs {items[1]:,} items"
        return value, "", detail
    return measure


def _dcp_items(results: dict[str, Any]) -> Measure:
    def measure(run: dict[str, Any]) -> tuple[float | None, str, str]:
        figs = run["figures"]
        items = figs.get(DCP_PACKED_SAVE, {}).get("items")
        tables = figs.get(DCP_PACKED_GROUPS_SAVE, {}).get("items")
        shaped, leaves = run.get("n_param_shaped_state"), run.get("n_leaves")
        if items is None or tables is None:
            return None, _missing(results, run, DCP_PACKED_SAVE, DCP_PACKED_GROUPS_SAVE), ""
        if shaped is None or leaves is None:
            return None, "the run does not record n_param_shaped_state / n_leaves", ""
        bound = shaped + leaves + tables
        return items / bound, "", (f"{items:,} items; bound {bound:,} = {shaped:,} param-shaped state tensors + "
                                   f"{leaves} leaf + {tables} table item{'s' if tables != 1 else ''}")
    return measure


def per_param_growth(small: dict[str, Any], big: dict[str, Any], method_id: str) -> float | None:
    """``(t_big / P_big) / (t_small / P_small)``: how the cost per parameter grows from ``small`` to ``big``."""
    t_small, t_big = _median(small, method_id), _median(big, method_id)
    if t_small is None or t_big is None or t_small <= 0:
        return None
    return (t_big / big["n_params"]) / (t_small / small["n_params"])


def _growth_row(results: dict[str, Any], target: Target, method_id: str) -> dict[str, Any]:
    """Per-parameter growth of ``method_id`` from :data:`GROWTH_FROM` to :data:`GROWTH_TO`, divided by
    that of ``optimizer.state_dict()``; N/A (no fallback) when either scale was not run."""
    small, big = _find_run(results, GROWTH_FROM, target.layout), _find_run(results, GROWTH_TO, target.layout)
    where = f"{GROWTH_TO} / {GROWTH_FROM}, {target.layout}"
    args = (target.name, TARGET_BACKEND)
    if small is None or big is None:
        absent = [s for s, r in ((GROWTH_FROM, small), (GROWTH_TO, big)) if r is None]
        return _row(*args, None, target.op, target.threshold, where,
                    f"{' and '.join(absent)} with one group per {target.layout} not run")
    mine, torch_ = per_param_growth(small, big, method_id), per_param_growth(small, big, FLOOR_STATE_DICT)
    value = _ratio(mine, torch_)
    if value is None:
        why = "; ".join(x for x in (_missing(results, small, method_id, FLOOR_STATE_DICT),
                                    _missing(results, big, method_id, FLOOR_STATE_DICT)) if x)
        return _row(*args, None, target.op, target.threshold, where, why)
    return _row(*args, value, target.op, target.threshold, where, judged=not results["config"].get("quick"),
                detail=f"per-param growth: sparse_ckpt {mine:.2f}×, torch {torch_:.2f}×")


def compute_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets table rows (see :data:`TARGETS`), each with ``verdict`` (PASS / MISS / N/A, from the
    numbers) and ``status`` (the verdict where the row's own scale was measured in a full run, else
    INDICATIVE; N/A stays N/A, with the ``reason``)."""
    check_method_ids()
    rows = [
        _at_scale(results, SAVE_COST_PARAM, TARGET_BACKEND, _cost(SAVE, FLOOR_STATE_DICT, results)),
        _at_scale(results, SAVE_COST_LAYER, TARGET_BACKEND, _cost(SAVE, FLOOR_STATE_DICT, results)),
        _at_scale(results, LOAD_COST_PARAM, TARGET_BACKEND, _cost(LOAD, FLOOR_STATE_DICT, results)),
        _at_scale(results, LOAD_COST_LAYER, TARGET_BACKEND, _cost(LOAD, FLOOR_STATE_DICT, results)),
        _at_scale(results, BACKEND_SPEEDUP, "python ÷ cpp", _speedup(results)),
        _at_scale(results, DCP_VS_NAIVE_PARAM, TARGET_BACKEND, _dcp_vs_naive(results)),
        _at_scale(results, DCP_VS_NAIVE_LAYER, TARGET_BACKEND, _dcp_vs_naive(results)),
        _at_scale(results, DCP_ITEMS_PARAM, "—", _dcp_items(results)),
        _at_scale(results, DCP_ITEMS_LAYER, "—", _dcp_items(results)),
        _growth_row(results, GROWTH_SAVE_PARAM, SAVE),
        _growth_row(results, GROWTH_SAVE_LAYER, SAVE),
        _growth_row(results, GROWTH_LOAD_PARAM, LOAD),
        _growth_row(results, GROWTH_LOAD_LAYER, LOAD),
    ]
    assert [r["target"] for r in rows] == [t.name for t in TARGETS]
    return rows


# --------------------------------------------------------------------------- information


def _info(name: str, backend: str, value: float | None, where: str, why: str = "", detail: str = "") -> dict:
    return {"name": name, "backend": backend, "value": value, "where": where, "reason": why if value is None else "",
            "detail": detail}


def _largest_with(results: dict[str, Any], layout: str, ok: Callable[[dict[str, Any]], bool],
                  prefer: str = TARGET_SCALE) -> dict[str, Any] | None:
    """The run of ``layout`` at ``prefer`` if ``ok``, else the largest one that is ``ok``."""
    run = _find_run(results, prefer, layout)
    if run is not None and ok(run):
        return run
    done = [r for r in results["runs"] if r["layout"] == layout and ok(r)]
    return max(done, key=lambda r: r["n_params"]) if done else None


def compute_info(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Ratios that are not targets (some were, before): at :data:`TARGET_SCALE` or, where a figure was
    skipped there (torch's quadratic baselines, DCP of flat dicts), at the largest scale of each layout
    where both sides were measured (named in ``where``)."""
    rows: list[dict[str, Any]] = []
    pairs = ((INFO_FIRST_SAVE, SAVE_FIRST, SAVE), (INFO_FIRST_LOAD, LOAD_FIRST, LOAD),
             (INFO_DSD_SET, DSD_SET, LOAD), (INFO_LOAD_VS_TORCH_LOAD, LOAD, FLOOR_LOAD_STATE_DICT),
             (INFO_DSD_GET, DSD_GET, SAVE))
    for name, num, den in pairs:
        for layout in (TARGET_LAYOUT, "layer"):
            run = _largest_with(results, layout, lambda r, n=num, d=den: _ratio(_median(r, n), _median(r, d)) is not None)
            if run is None:
                rows.append(_info(name, TARGET_BACKEND, None, f"one group per {layout}", "not measured at any scale"))
                continue
            rows.append(_info(name, TARGET_BACKEND, _ratio(_median(run, num), _median(run, den)),
                              f"{run['scale']}, {layout}", detail=f"{fmt_time(_median(run, num))} vs "
                              f"{fmt_time(_median(run, den))}"))
    for fn in INFO_CORE_FUNCTIONS:
        py, cpp = core_id(fn, "python"), core_id(fn, "cpp")
        run = _largest_with(results, TARGET_LAYOUT, lambda r, a=py, b=cpp: _ratio(_median(r, a), _median(r, b)) is not None)
        rows.append(_info(f"core.{fn}: python / cpp", "python ÷ cpp",
                          _ratio(_median(run, py), _median(run, cpp)) if run else None,
                          f"{run['scale']}, {TARGET_LAYOUT}" if run else "—", "not measured at any scale"))
    run = _largest_with(results, TARGET_LAYOUT, lambda r: all(_median(r, i) is not None for i in DCP_GROUP_IDS))
    save_p, load_p, save_f, load_f = DCP_GROUP_IDS
    if run is None:
        for name in (INFO_DCP_GROUPS_TIME, INFO_DCP_GROUPS_BYTES):
            rows.append(_info(name, "—", None, "—", "flat DCP not measured at any scale"))
    else:
        where = f"{run['scale']}, {TARGET_LAYOUT}"
        rows.append(_info(INFO_DCP_GROUPS_TIME, "—", _ratio(_sum(run, save_f, load_f), _sum(run, save_p, load_p)), where))
        rows.append(_info(INFO_DCP_GROUPS_BYTES, "—", _ratio(run["figures"][save_f].get("bytes"),
                                                            run["figures"][save_p].get("bytes")), where))
    for layout in (TARGET_LAYOUT, "layer"):
        run = _largest_with(results, layout, lambda r: all(r["figures"].get(i, {}).get("bytes") for i in
                                                           (DCP_NAIVE_SAVE, DCP_STATEFUL_SAVE)), DCP_TARGET_SCALE)
        value = None if run is None else _ratio(run["figures"][DCP_NAIVE_SAVE]["bytes"],
                                                run["figures"][DCP_STATEFUL_SAVE]["bytes"])
        rows.append(_info(INFO_DCP_NAIVE_BYTES, "—", value, f"{run['scale']}, {layout}" if run else "—",
                          "not measured at any scale"))
    return rows + export_info(results)


def _field(run: dict[str, Any], method_id: str, field: str) -> float | None:
    """``median_s`` (or ``bytes``, > 0) of a measured figure, else ``None``."""
    fig = run["figures"].get(method_id, {})
    if fig.get("status") != OK or not fig.get(field):
        return None
    return float(fig[field])


def export_info(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The export rows (:data:`EXPORT_INFO`): export ÷ DCP of the whole optimizer in directory bytes, save
    time and load time, one row per scale and layout where both figures were measured (one group per
    :data:`TARGET_LAYOUT` first); a row with the reason when that is nowhere."""
    layouts = sorted(results["config"]["layouts"], key=lambda lay: lay != TARGET_LAYOUT)
    fmt = {"bytes": lambda v: fmt_bytes(int(v)), "median_s": fmt_time}
    rows: list[dict[str, Any]] = []
    for name, num, den, field in EXPORT_INFO:
        found = []
        for layout in layouts:
            for run in _runs_of(results, layout):
                a, b = _field(run, num, field), _field(run, den, field)
                if a is not None and b is not None:
                    found.append(_info(name, "—", a / b, f"{run['scale']}, {layout}",
                                       detail=f"{fmt[field](a)} vs {fmt[field](b)}"))
        rows += found or [_info(name, "—", None, "—", f"{num} and {den} not both measured at any scale")]
    return rows


def growth_pair(results: dict[str, Any], layout: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The runs the growth table compares: :data:`GROWTH_FROM` and :data:`GROWTH_TO` when both ran,
    else the two largest scales of ``layout``."""
    small, big = _find_run(results, GROWTH_FROM, layout), _find_run(results, GROWTH_TO, layout)
    if small is not None and big is not None:
        return small, big
    ordered = sorted((r for r in results["runs"] if r["layout"] == layout), key=lambda r: r["n_params"])
    return (ordered[-2], ordered[-1]) if len(ordered) >= 2 else None


def growth_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Information: for every torch floor, sparse_ckpt and core figure, ``time(big) / time(small)`` and
    the per-parameter growth (that ratio divided by the parameter ratio; 1 = linear)."""
    rows: list[dict[str, Any]] = []
    for layout in results["config"]["layouts"]:
        pair = growth_pair(results, layout)
        if pair is None:
            continue
        small, big = pair
        where = f"{big['scale']} / {small['scale']}, {layout}"
        for mid, fig in big["figures"].items():
            if (fig.get("family") or mid.partition("/")[0]) not in (*SPARSE_FAMILIES, "floor"):
                continue
            ratio = _ratio(_median(big, mid), _median(small, mid))
            rows.append({"figure": mid, "backend": fig.get("backend") or "—", "time_ratio": ratio,
                         "per_param": per_param_growth(small, big, mid), "where": where,
                         "reason": "" if ratio is not None else _missing(results, big, mid) or
                         _missing(results, small, mid)})
    return rows


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
    """The warning printed above the targets when some (quick mode: all) get no verdict, else ``None``."""
    scales = (f"the targets are stated at {DCP_TARGET_SCALE} (DCP), {TARGET_SCALE} (save / load cost, backends) "
              f"and {GROWTH_FROM} → {GROWTH_TO} (growth), where torch's baselines grow quadratically and sparse_ckpt "
              "linearly; on smaller scales a ratio 'outside' its target is not a failure.")
    if results["config"].get("quick"):
        why = targets_mode(results)[1]
        return f"INDICATIVE ONLY ({why}): {scales} Run the full bench (without --quick) to judge them."
    rows = results.get("targets") or compute_targets(results)
    indicative = [r for r in rows if r["status"] == INDICATIVE]
    if not indicative:
        return None
    return (f"{len(indicative)} of {len(rows)} targets INDICATIVE (measured at a smaller scale than theirs, named "
            f"in 'where'): {scales}")


def targets_markdown(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The targets table."""
    lines = ["| target | backend | measured | required | status | where |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        where = r["where"] + (f" — {r['detail']}" if r.get("detail") else "")
        lines.append(f"| {r['target']} | {r['backend']} | {_fmt_value(r)} | {r['op']} {r['threshold']:g}× "
                     f"| {fmt_status(r)} | {where} |")
    return lines


def info_markdown(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The information table (ratios without a verdict)."""
    lines = ["| ratio | backend | measured | where |", "| --- | --- | --- | --- |"]
    for r in rows:
        where = r["where"] + (f" — {r['detail']}" if r.get("detail") else "")
        value = _fmt_value(r) if r["value"] is not None else f"— ({r['reason']})"
        lines.append(f"| {r['name']} | {r['backend']} | {value} | {where} |")
    return lines


def growth_markdown(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The growth table: time ratio and per-parameter growth of every figure between two scales."""
    lines = ["| figure | backend | time ratio | per-param growth | where |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["time_ratio"] is None:
            lines.append(f"| {r['figure']} | {r['backend']} | — | — ({r['reason']}) | {r['where']} |")
        else:
            lines.append(f"| {r['figure']} | {r['backend']} | {r['time_ratio']:.2f}× | {r['per_param']:.2f}× "
                         f"| {r['where']} |")
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
        elif "bytes" in fig:
            note = fmt_bytes(fig["bytes"]) + (f"; {note}" if note else "")
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
    info = results.get("info")
    if info is None:
        info = compute_info(results)
    lines += ["## Information (no targets)", "", *info_markdown(info), ""]
    growth = growth_rows(results)
    if growth:
        lines += ["## Growth of every figure (information)", "",
                  ("Time at the larger scale ÷ time at the smaller, and per parameter (÷ the parameter ratio; "
                   "1.00× = linear)."), "", *growth_markdown(growth), ""]
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
    ("core functions: save side", ("pack_optimizer", "remap_to_fqns", "flatten_state", "flatten_groups",
                                   "encode_table")),
    ("core functions: load side", ("decode_table", "unflatten.packed", "unflatten.flat", "match_groups",
                                   "assign_state_ids")),
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
    return [Series(f"{name} ({fmt}), {b}" if len(formats) > 1 else f"{name}, {b}",
                   (sparse_id(op, b, fmt),), C_SPARSE[fmt], BACKEND_STYLE[b],
                   key=f"sparse_ckpt ({fmt}), {b} core" if len(formats) > 1 else f"sparse_ckpt, {b} core")
            for fmt in formats for b in BACKENDS]


FLOOR_KEY = "torch floor: optimizer.state_dict() / load_state_dict()"
DSD_KEY = "DSD get / set_optimizer_state_dict"


def _save_series(formats: tuple[str, ...] = ("packed",)) -> list[Series]:
    return [Series("optimizer.state_dict() (floor)", (FLOOR_STATE_DICT,), C_FLOOR, key=FLOOR_KEY),
            *_sparse_series("save", formats), Series("DSD get_optimizer_state_dict", (DSD_GET,), C_DSD, key=DSD_KEY)]


def _load_series(formats: tuple[str, ...] = ("packed",)) -> list[Series]:
    return [Series("optimizer.load_state_dict() (floor)", (FLOOR_LOAD_STATE_DICT,), C_FLOOR, key=FLOOR_KEY),
            *_sparse_series("load", formats), Series("DSD set_optimizer_state_dict", (DSD_SET,), C_DSD, key=DSD_KEY)]


def _dcp_series(ops: tuple[str, ...], field: str = "median_s") -> dict[tuple[str, str], Series]:
    """One series per DCP variant (:data:`DCP_VARIANTS`), keyed by ``(format, part)``."""
    out = {}
    for variant in DCP_VARIANTS:
        name, color, style, marker = DCP_STYLE[variant]
        out[variant] = Series(name, tuple(dcp_id(op, *variant) for op in ops), color, style, field, marker)
    return out


def _core_series(functions: Iterable[str], colors: dict[str, str]) -> list[Series]:
    return [Series(f"{fn}, {b}", (core_id(fn, b),), colors[fn], BACKEND_STYLE[b])
            for fn in functions for b in BACKENDS]


def plot_method_ids() -> list[str]:
    """Every method id a plot series refers to (checked like the targets')."""
    series = [*_save_series(("packed", "flat")), *_load_series(("packed", "flat")),
              *_dcp_series(("save", "load")).values(), *_core_series(CORE_FUNCTIONS, dict.fromkeys(CORE_FUNCTIONS, ""))]
    return [i for s in series for i in s.ids]


def coverage(series: Series, runs: list[dict[str, Any]]) -> str:
    """Legend suffix saying where ``series`` was measured over ``runs`` (sorted by size): ``""``
    (everywhere), `` (up to 24x128)``, `` (only 8x64, 61x256)`` or `` (not measured)``."""
    measured = [r["scale"] for r in runs if series.value(r) is not None]
    if len(measured) == len(runs):
        return ""
    if not measured:
        return " (not measured)"
    if measured == [r["scale"] for r in runs[:len(measured)]]:
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
    return {"linestyle": s.style, "color": s.color, "marker": s.marker, "markersize": 5 if s.marker == "o" else 4.5,
            "linewidth": 1.6}


def _draw(ax: Any, runs: list[dict[str, Any]], series: list[Series], ylabel: str, title: str,
          annotate_missing: bool = True) -> list[Any]:
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
        handles.append(Line2D([], [], alpha=1.0 if measured else 0.35, **_style(group[0]),
                              label=key if measured else f"{key} (not measured)"))
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
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=ncol, fontsize=8,
              frameon=False, handlelength=3)


def _figure_legend(fig: Any, handles: list[Any], title: str, ncol: int = 3) -> None:
    """A legend below the whole (sub)figure, inside it (constrained layout makes room)."""
    legend = fig.legend(handles=handles, title=title, loc="outside lower center", ncol=ncol, fontsize=8,
                        title_fontsize=8, frameon=False, handlelength=3)
    legend.get_title().set_multialignment("center")


def _runs_of(results: dict[str, Any], layout: str) -> list[dict[str, Any]]:
    return sorted((r for r in results["runs"] if r["layout"] == layout), key=lambda r: r["n_params"])


def _suptitle(fig: Any, results: dict[str, Any], what: str) -> None:
    judged, why = targets_mode(results)
    mode = "" if judged else f"\nINDICATIVE — {why}"
    fig.suptitle(f"sparse_ckpt bench: {what}{mode}\n{machine_line(results['machine'])}", fontsize=10)


def _title(title: str, note: str) -> str:
    return f"{title}\n{note}" if note else title


def _drop_coinciding(series: dict[tuple[str, str], Series], runs: list[dict[str, Any]],
                     dropped: dict[tuple[str, str], list[tuple[str, float]]], panel: str) -> list[Series]:
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
        parts.append(f"{gone} ≈ {kept} in the {panels} panel{'s' if len(where) > 1 else ''} "
                     f"(within {math.ceil(100 * max(d for _p, d in where))}%): not drawn there")
    return "\n".join(parts)


def plot_headline(results: dict[str, Any], path: str, plt: Any) -> None:
    """Save and load time vs the floor and DSD; DCP packed vs flat in time, bytes and items."""
    layouts = list(results["config"]["layouts"])
    layout = TARGET_LAYOUT if TARGET_LAYOUT in layouts else layouts[0]
    runs = _runs_of(results, layout)
    fig = plt.figure(figsize=(15, 11), layout="constrained")
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
        _legend_below(ax, _draw(ax, runs, series, "seconds (median)", title), ncol=2)
    panels = ((ax_t, _dcp_series(("save", "load")), "seconds (median save + load)", "DCP save + load", "time"),
              (ax_b, _dcp_series(("save",), "bytes"), "bytes on disk", "DCP checkpoint size", "bytes"),
              (ax_i, _dcp_series(("save",), "items"), "items in the DCP metadata", "DCP items", "items"))
    dropped: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for ax, series, ylabel, title, what in panels:
        note = ratio_note(runs, [("naive layout / SparseOptimizerState", series[(NAIVE, "all")],
                                  series[("packed", STATEFUL)]),
                                 ("param groups alone, flat / packed", series[("flat", "groups")],
                                  series[("packed", "groups")])], sep="\n")
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
        ("sparse_ckpt vs torch's floor and DSD (sparse_ckpt: packed blue, flat purple; cpp core solid, python dashed)",
         (("save side", _save_series(("packed", "flat"))), ("load side", _load_series(("packed", "flat")))),
         ("save panels: optimizer.state_dict(), sparse_state_dict, DSD get; load panels: optimizer.load_state_dict(), "
          "load_sparse_state_dict, DSD set")),
        ("DCP: dcp.save and dcp.load of each dict",
         (("dcp.save", list(_dcp_series(("save",)).values())), ("dcp.load", list(_dcp_series(("load",)).values()))),
         ""),
    )
    fig = plt.figure(figsize=(14, 6.8 * len(layouts) + 4), layout="constrained")
    for sub, (title, panels, about) in zip(fig.subfigures(2, 1), blocks):
        axes = sub.subplots(len(layouts), len(panels), squeeze=False)
        for row, layout in enumerate(layouts):
            runs = _runs_of(results, layout)
            for col, (name, series) in enumerate(panels):
                _draw(axes[row][col], runs, series, "seconds (median)", f"{name} — one group per {layout}",
                      annotate_missing=False)
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
    fig.savefig(path, **SAVEFIG)


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
    results["info"] = compute_info(results)
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
