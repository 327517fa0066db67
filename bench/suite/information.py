"""Ratios of the bench without a verdict (information), and the growth table of every figure.

Ratios that used to be targets, the core functions' python / cpp ratios, DCP bytes and the export
against DCP: at :data:`~.verdicts.TARGET_SCALE` or, where a figure was skipped there, at the largest
scale of each layout where both sides were measured. The growth table gives, for every torch floor,
sparse_ckpt and core figure, how its time grows between two scales.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .methods import (
    DCP_NAIVE_SAVE,
    DCP_STATEFUL_LOAD,
    DCP_STATEFUL_SAVE,
    DSD_GET,
    DSD_SET,
    EXPORT_LOAD,
    EXPORT_SAVE,
    FIRST_CALL,
    FLOOR_LOAD_STATE_DICT,
    SPARSE_FAMILIES,
    core_id,
    dcp_id,
    method_id,
)
from .units import fmt_bytes, fmt_time
from .verdicts import (
    DCP_TARGET_SCALE,
    GROWTH_FROM,
    GROWTH_TO,
    LOAD,
    OK,
    SAVE,
    TARGET_BACKEND,
    TARGET_FORMAT,
    TARGET_LAYOUT,
    TARGET_SCALE,
    check_method_ids,
    find_run,
    median,
    missing_reason,
    per_param_growth,
    ratio,
    runs_of,
    sum_medians,
)

SAVE_FIRST = method_id("sparse", "save", TARGET_BACKEND, TARGET_FORMAT, FIRST_CALL)
LOAD_FIRST = method_id("sparse", "load", TARGET_BACKEND, TARGET_FORMAT, FIRST_CALL)
DCP_GROUP_IDS = (
    dcp_id("save", "packed", "groups"),
    dcp_id("load", "packed", "groups"),
    dcp_id("save", "flat", "groups"),
    dcp_id("load", "flat", "groups"),
)
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


def info_method_ids() -> list[str]:
    """Every method id the information rows divide (beyond the targets')."""
    return [
        *DCP_GROUP_IDS,
        EXPORT_SAVE,
        EXPORT_LOAD,
        SAVE_FIRST,
        LOAD_FIRST,
        *(core_id(fn, b) for fn in INFO_CORE_FUNCTIONS for b in ("python", "cpp")),
    ]


def _info(name: str, backend: str, value: float | None, where: str, why: str = "", detail: str = "") -> dict:
    return {
        "name": name,
        "backend": backend,
        "value": value,
        "where": where,
        "reason": why if value is None else "",
        "detail": detail,
    }


def _largest_with(
    results: dict[str, Any], layout: str, ok: Callable[[dict[str, Any]], bool], prefer: str = TARGET_SCALE
) -> dict[str, Any] | None:
    """The run of ``layout`` at ``prefer`` if ``ok``, else the largest one that is ``ok``."""
    run = find_run(results, prefer, layout)
    if run is not None and ok(run):
        return run
    done = [r for r in results["runs"] if r["layout"] == layout and ok(r)]
    return max(done, key=lambda r: r["n_params"]) if done else None


def compute_info(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Ratios that are not targets (some were, before): at :data:`TARGET_SCALE` or, where a figure was
    skipped there (torch's quadratic baselines, DCP of flat dicts), at the largest scale of each layout
    where both sides were measured (named in ``where``)."""
    check_method_ids(info_method_ids())
    rows: list[dict[str, Any]] = []
    pairs = (
        (INFO_FIRST_SAVE, SAVE_FIRST, SAVE),
        (INFO_FIRST_LOAD, LOAD_FIRST, LOAD),
        (INFO_DSD_SET, DSD_SET, LOAD),
        (INFO_LOAD_VS_TORCH_LOAD, LOAD, FLOOR_LOAD_STATE_DICT),
        (INFO_DSD_GET, DSD_GET, SAVE),
    )
    for name, num, den in pairs:
        for layout in (TARGET_LAYOUT, "layer"):
            run = _largest_with(results, layout, lambda r, n=num, d=den: ratio(median(r, n), median(r, d)) is not None)
            if run is None:
                rows.append(_info(name, TARGET_BACKEND, None, f"one group per {layout}", "not measured at any scale"))
                continue
            rows.append(
                _info(
                    name,
                    TARGET_BACKEND,
                    ratio(median(run, num), median(run, den)),
                    f"{run['scale']}, {layout}",
                    detail=f"{fmt_time(median(run, num))} vs {fmt_time(median(run, den))}",
                )
            )
    for fn in INFO_CORE_FUNCTIONS:
        py, cpp = core_id(fn, "python"), core_id(fn, "cpp")
        run = _largest_with(
            results, TARGET_LAYOUT, lambda r, a=py, b=cpp: ratio(median(r, a), median(r, b)) is not None
        )
        rows.append(
            _info(
                f"core.{fn}: python / cpp",
                "python ÷ cpp",
                ratio(median(run, py), median(run, cpp)) if run else None,
                f"{run['scale']}, {TARGET_LAYOUT}" if run else "—",
                "not measured at any scale",
            )
        )
    run = _largest_with(results, TARGET_LAYOUT, lambda r: all(median(r, i) is not None for i in DCP_GROUP_IDS))
    save_p, load_p, save_f, load_f = DCP_GROUP_IDS
    if run is None:
        for name in (INFO_DCP_GROUPS_TIME, INFO_DCP_GROUPS_BYTES):
            rows.append(_info(name, "—", None, "—", "flat DCP not measured at any scale"))
    else:
        where = f"{run['scale']}, {TARGET_LAYOUT}"
        rows.append(
            _info(
                INFO_DCP_GROUPS_TIME,
                "—",
                ratio(sum_medians(run, save_f, load_f), sum_medians(run, save_p, load_p)),
                where,
            )
        )
        rows.append(
            _info(
                INFO_DCP_GROUPS_BYTES,
                "—",
                ratio(run["figures"][save_f].get("bytes"), run["figures"][save_p].get("bytes")),
                where,
            )
        )
    for layout in (TARGET_LAYOUT, "layer"):
        run = _largest_with(
            results,
            layout,
            lambda r: all(r["figures"].get(i, {}).get("bytes") for i in (DCP_NAIVE_SAVE, DCP_STATEFUL_SAVE)),
            DCP_TARGET_SCALE,
        )
        value = (
            None
            if run is None
            else ratio(run["figures"][DCP_NAIVE_SAVE]["bytes"], run["figures"][DCP_STATEFUL_SAVE]["bytes"])
        )
        rows.append(
            _info(
                INFO_DCP_NAIVE_BYTES,
                "—",
                value,
                f"{run['scale']}, {layout}" if run else "—",
                "not measured at any scale",
            )
        )
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
            for run in runs_of(results, layout):
                a, b = _field(run, num, field), _field(run, den, field)
                if a is not None and b is not None:
                    found.append(
                        _info(
                            name, "—", a / b, f"{run['scale']}, {layout}", detail=f"{fmt[field](a)} vs {fmt[field](b)}"
                        )
                    )
        rows += found or [_info(name, "—", None, "—", f"{num} and {den} not both measured at any scale")]
    return rows


def growth_pair(results: dict[str, Any], layout: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The runs the growth table compares: :data:`GROWTH_FROM` and :data:`GROWTH_TO` when both ran,
    else the two largest scales of ``layout``."""
    small, big = find_run(results, GROWTH_FROM, layout), find_run(results, GROWTH_TO, layout)
    if small is not None and big is not None:
        return small, big
    ordered = runs_of(results, layout)
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
            time_ratio = ratio(median(big, mid), median(small, mid))
            rows.append(
                {
                    "figure": mid,
                    "backend": fig.get("backend") or "—",
                    "time_ratio": time_ratio,
                    "per_param": per_param_growth(small, big, mid),
                    "where": where,
                    "reason": ""
                    if time_ratio is not None
                    else missing_reason(results, big, mid) or missing_reason(results, small, mid),
                }
            )
    return rows
