"""The targets of the bench and their verdicts, computed from ``results.json`` as ratios.

The targets are a report, never an assertion. Each target has its own scale and layout
(:class:`Target`): the save/load cost and backend targets at ``61x256`` (DeepSeek-V3 shaped), the
DCP targets at ``24x128``, the growth targets from ``61x256`` to ``200x1024``. A row gets a verdict
(PASS / MISS) only in a full run that measured its scale; otherwise it is computed at the largest
scale of its layout that was measured and reported as ``INDICATIVE`` (torch's baselines grow
quadratically and sparse_ckpt linearly, so a ratio measured on a toy scale says little about the
target), or ``N/A`` with the reason (the growth targets need both of their scales).

Also here: the lookups into the results every part of the report uses (:func:`find_run`,
:func:`median`, :func:`ratio`, :func:`missing_reason`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

from .methods import (
    DCP_NAIVE_LOAD,
    DCP_NAIVE_SAVE,
    DCP_PACKED_GROUPS_SAVE,
    DCP_PACKED_SAVE,
    DCP_STATEFUL_LOAD,
    DCP_STATEFUL_SAVE,
    DSD_GET,
    DSD_SET,
    FLOOR_LOAD_STATE_DICT,
    FLOOR_STATE_DICT,
    planned_ids,
    sparse_id,
)
from .units import fmt_time

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


SAVE_COST_PARAM = Target(
    "save cost: sparse_state_dict / optimizer.state_dict(), one group per param",
    "<=",
    SAVE_COST_PARAM_MAX,
    TARGET_SCALE,
    "param",
)
SAVE_COST_LAYER = Target(
    "save cost: sparse_state_dict / optimizer.state_dict(), one group per layer",
    "<=",
    SAVE_COST_LAYER_MAX,
    TARGET_SCALE,
    "layer",
)
LOAD_COST_PARAM = Target(
    "load cost: load_sparse_state_dict / optimizer.state_dict(), one group per param",
    "<=",
    LOAD_COST_PARAM_MAX,
    TARGET_SCALE,
    "param",
)
LOAD_COST_LAYER = Target(
    "load cost: load_sparse_state_dict / optimizer.state_dict(), one group per layer",
    "<=",
    LOAD_COST_LAYER_MAX,
    TARGET_SCALE,
    "layer",
)
BACKEND_SPEEDUP = Target(
    "backend: python / cpp on sparse_state_dict + load_sparse_state_dict",
    ">=",
    BACKEND_SPEEDUP_MIN,
    TARGET_SCALE,
    "param",
)
DCP_VS_NAIVE_PARAM = Target(
    "DCP time: whole optimizer (SparseOptimizerState + planner) / naive layout, one group per param",
    "<=",
    DCP_VS_NAIVE_MAX,
    DCP_TARGET_SCALE,
    "param",
)
DCP_VS_NAIVE_LAYER = Target(
    "DCP time: whole optimizer (SparseOptimizerState + planner) / naive layout, one group per layer",
    "<=",
    DCP_VS_NAIVE_MAX,
    DCP_TARGET_SCALE,
    "layer",
)
DCP_ITEMS_PARAM = Target(
    "DCP items: packed / (param-shaped state tensors + leaves + tables), one group per param",
    "<=",
    DCP_ITEMS_MAX,
    DCP_TARGET_SCALE,
    "param",
)
DCP_ITEMS_LAYER = Target(
    "DCP items: packed / (param-shaped state tensors + leaves + tables), one group per layer",
    "<=",
    DCP_ITEMS_MAX,
    DCP_TARGET_SCALE,
    "layer",
)
GROWTH_SAVE_PARAM = Target(
    f"growth {GROWTH_FROM} → {GROWTH_TO} per param: sparse_state_dict / optimizer.state_dict(), one group per param",
    "<=",
    GROWTH_VS_TORCH_MAX,
    GROWTH_TO,
    "param",
)
GROWTH_SAVE_LAYER = Target(
    f"growth {GROWTH_FROM} → {GROWTH_TO} per param: sparse_state_dict / optimizer.state_dict(), one group per layer",
    "<=",
    GROWTH_VS_TORCH_MAX,
    GROWTH_TO,
    "layer",
)
GROWTH_LOAD_PARAM = Target(
    f"growth {GROWTH_FROM} → {GROWTH_TO} per param: load_sparse_state_dict / "
    "optimizer.state_dict(), one group per param",
    "<=",
    GROWTH_VS_TORCH_MAX,
    GROWTH_TO,
    "param",
)
GROWTH_LOAD_LAYER = Target(
    f"growth {GROWTH_FROM} → {GROWTH_TO} per param: load_sparse_state_dict / "
    "optimizer.state_dict(), one group per layer",
    "<=",
    GROWTH_VS_TORCH_MAX,
    GROWTH_TO,
    "layer",
)
TARGETS = (
    SAVE_COST_PARAM,
    SAVE_COST_LAYER,
    LOAD_COST_PARAM,
    LOAD_COST_LAYER,
    BACKEND_SPEEDUP,
    DCP_VS_NAIVE_PARAM,
    DCP_VS_NAIVE_LAYER,
    DCP_ITEMS_PARAM,
    DCP_ITEMS_LAYER,
    GROWTH_SAVE_PARAM,
    GROWTH_SAVE_LAYER,
    GROWTH_LOAD_PARAM,
    GROWTH_LOAD_LAYER,
)
"""Every target, in table order."""

SAVE = sparse_id("save", TARGET_BACKEND, TARGET_FORMAT)
LOAD = sparse_id("load", TARGET_BACKEND, TARGET_FORMAT)
SAVE_PY = sparse_id("save", "python", TARGET_FORMAT)
LOAD_PY = sparse_id("load", "python", TARGET_FORMAT)


def target_method_ids() -> list[str]:
    """Every method id the targets divide."""
    return [
        FLOOR_STATE_DICT,
        FLOOR_LOAD_STATE_DICT,
        DSD_GET,
        DSD_SET,
        SAVE,
        LOAD,
        SAVE_PY,
        LOAD_PY,
        DCP_STATEFUL_SAVE,
        DCP_STATEFUL_LOAD,
        DCP_NAIVE_SAVE,
        DCP_NAIVE_LOAD,
        DCP_PACKED_SAVE,
        DCP_PACKED_GROUPS_SAVE,
    ]


def check_method_ids(extra: Iterable[str] = ()) -> None:
    """Fail loudly when a target (or an information row or a plot series, ``extra``) names a method
    the bench does not plan.

    Without this, renaming a method would silently turn its target into N/A ("absent").
    """
    missing = sorted(set(target_method_ids()).union(extra) - planned_ids())
    if missing:
        raise RuntimeError(f"bench targets refer to method ids that plan_methods() does not produce: {missing}")


# --------------------------------------------------------------------------- lookups into the results


def find_run(results: dict[str, Any], scale: str, layout: str) -> dict[str, Any] | None:
    """The run of ``scale`` with one group per ``layout``, or ``None`` where it was not run."""
    for run in results["runs"]:
        if run["scale"] == scale and run["layout"] == layout:
            return run
    return None


def median(run: dict[str, Any] | None, method_id: str) -> float | None:
    """The median time of a measured figure of ``run``, else ``None``."""
    if run is None:
        return None
    fig = run["figures"].get(method_id)
    if not fig or fig.get("status") != OK:
        return None
    return float(fig["median_s"])


def sum_medians(run: dict[str, Any] | None, *ids: str) -> float | None:
    """The sum of the medians of ``ids`` in ``run``; ``None`` where one of them was not measured."""
    values = [median(run, i) for i in ids]
    return None if None in values else sum(values)  # type: ignore[arg-type]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; ``None`` where either is missing or ``b`` is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def missing_reason(results: dict[str, Any], run: dict[str, Any] | None, *ids: str) -> str:
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


def runs_of(results: dict[str, Any], layout: str) -> list[dict[str, Any]]:
    """The runs of ``layout``, smallest first."""
    return sorted((r for r in results["runs"] if r["layout"] == layout), key=lambda r: r["n_params"])


# --------------------------------------------------------------------------- targets


def _row(
    name: str,
    backend: str,
    value: float | None,
    op: str,
    threshold: float,
    where: str,
    why: str = "",
    judged: bool = False,
    detail: str = "",
) -> dict[str, Any]:
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
    if find_run(results, TARGET_SCALE, TARGET_LAYOUT) is None:
        layouts = results["config"].get("layouts") or []
        if not results["runs"] and TARGET_SCALE in scales and TARGET_LAYOUT in layouts:  # the header, before any run
            return True, f"{TARGET_SCALE}, one group per {TARGET_LAYOUT} (in this run's scales)"
        return False, f"{TARGET_SCALE} with one group per {TARGET_LAYOUT} was not run (scales {', '.join(scales)})"
    return True, f"{TARGET_SCALE}, one group per {TARGET_LAYOUT}"


Measure = Callable[
    [dict[str, Any]], tuple[Optional[float], str, str]
]  # Optional, not "| None": evaluated on import (3.9)
"""``run -> (value, why it is missing, detail)``."""


def _at_scale(results: dict[str, Any], target: Target, backend: str, measure: Measure) -> dict[str, Any]:
    """``target`` at its scale; when that scale was not run (or its figures are missing there), at the
    largest scale of the layout where ``measure`` has a value, as INDICATIVE, with the scale named."""
    full = not results["config"].get("quick")
    run = find_run(results, target.scale, target.layout)
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
        value = ratio(median(run, num), median(run, den))
        if value is None:
            return None, missing_reason(results, run, num, den), ""
        return value, "", f"{fmt_time(median(run, num))} vs {fmt_time(median(run, den))}"

    return measure


def _speedup(results: dict[str, Any]) -> Measure:
    def measure(run: dict[str, Any]) -> tuple[float | None, str, str]:
        py, cpp = sum_medians(run, SAVE_PY, LOAD_PY), sum_medians(run, SAVE, LOAD)
        value = ratio(py, cpp)
        if value is None:
            return None, missing_reason(results, run, SAVE_PY, LOAD_PY, SAVE, LOAD), ""
        return value, "", f"python {fmt_time(py)} vs cpp {fmt_time(cpp)} (save + load)"

    return measure


def _dcp_vs_naive(results: dict[str, Any]) -> Measure:
    ids = (DCP_STATEFUL_SAVE, DCP_STATEFUL_LOAD, DCP_NAIVE_SAVE, DCP_NAIVE_LOAD)

    def measure(run: dict[str, Any]) -> tuple[float | None, str, str]:
        packed, naive = sum_medians(run, *ids[:2]), sum_medians(run, *ids[2:])
        value = ratio(packed, naive)
        if value is None:
            return None, missing_reason(results, run, *ids), ""
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
            return None, missing_reason(results, run, DCP_PACKED_SAVE, DCP_PACKED_GROUPS_SAVE), ""
        if shaped is None or leaves is None:
            return None, "the run does not record n_param_shaped_state / n_leaves", ""
        bound = shaped + leaves + tables
        return (
            items / bound,
            "",
            (
                f"{items:,} items; bound {bound:,} = {shaped:,} param-shaped state tensors + "
                f"{leaves} leaf + {tables} table item{'s' if tables != 1 else ''}"
            ),
        )

    return measure


def per_param_growth(small: dict[str, Any], big: dict[str, Any], method_id: str) -> float | None:
    """``(t_big / P_big) / (t_small / P_small)``: how the cost per parameter grows from ``small`` to ``big``."""
    t_small, t_big = median(small, method_id), median(big, method_id)
    if t_small is None or t_big is None or t_small <= 0:
        return None
    return (t_big / big["n_params"]) / (t_small / small["n_params"])


def _growth_row(results: dict[str, Any], target: Target, method_id: str) -> dict[str, Any]:
    """Per-parameter growth of ``method_id`` from :data:`GROWTH_FROM` to :data:`GROWTH_TO`, divided by
    that of ``optimizer.state_dict()``; N/A (no fallback) when either scale was not run."""
    small, big = find_run(results, GROWTH_FROM, target.layout), find_run(results, GROWTH_TO, target.layout)
    where = f"{GROWTH_TO} / {GROWTH_FROM}, {target.layout}"
    args = (target.name, TARGET_BACKEND)
    if small is None or big is None:
        absent = [s for s, r in ((GROWTH_FROM, small), (GROWTH_TO, big)) if r is None]
        return _row(
            *args,
            None,
            target.op,
            target.threshold,
            where,
            f"{' and '.join(absent)} with one group per {target.layout} not run",
        )
    mine, torch_ = per_param_growth(small, big, method_id), per_param_growth(small, big, FLOOR_STATE_DICT)
    value = ratio(mine, torch_)
    if value is None:
        why = "; ".join(
            x
            for x in (
                missing_reason(results, small, method_id, FLOOR_STATE_DICT),
                missing_reason(results, big, method_id, FLOOR_STATE_DICT),
            )
            if x
        )
        return _row(*args, None, target.op, target.threshold, where, why)
    return _row(
        *args,
        value,
        target.op,
        target.threshold,
        where,
        judged=not results["config"].get("quick"),
        detail=f"per-param growth: sparse_ckpt {mine:.2f}×, torch {torch_:.2f}×",
    )


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
