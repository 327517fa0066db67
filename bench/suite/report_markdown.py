"""``results.md``: the targets, information and growth tables and one timings table per run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .information import compute_info, growth_rows
from .units import fmt_bytes, fmt_time
from .verdicts import (
    DCP_TARGET_SCALE,
    GROWTH_FROM,
    GROWTH_TO,
    INDICATIVE,
    OK,
    PASS,
    TARGET_SCALE,
    compute_targets,
    targets_mode,
)


def fmt_cell(fig: dict[str, Any]) -> str:
    """``median (min–max)`` or the status and reason of a figure that was not measured."""
    if fig.get("status") != OK:
        return f"{fig.get('status', '?')}: {fig.get('reason', '')}".strip()
    return f"{fmt_time(fig['median_s'])} ({fmt_time(fig['min_s'])}–{fmt_time(fig['max_s'])})"


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
    scales = (
        f"the targets are stated at {DCP_TARGET_SCALE} (DCP), {TARGET_SCALE} (save / load cost, backends) "
        f"and {GROWTH_FROM} → {GROWTH_TO} (growth), where torch's baselines grow quadratically and sparse_ckpt "
        "linearly; on smaller scales a ratio 'outside' its target is not a failure."
    )
    if results["config"].get("quick"):
        why = targets_mode(results)[1]
        return f"INDICATIVE ONLY ({why}): {scales} Run the full bench (without --quick) to judge them."
    rows = results.get("targets") or compute_targets(results)
    indicative = [r for r in rows if r["status"] == INDICATIVE]
    if not indicative:
        return None
    return (
        f"{len(indicative)} of {len(rows)} targets INDICATIVE (measured at a smaller scale than theirs, named "
        f"in 'where'): {scales}"
    )


def targets_markdown(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The targets table."""
    lines = ["| target | backend | measured | required | status | where |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        where = r["where"] + (f" — {r['detail']}" if r.get("detail") else "")
        lines.append(
            f"| {r['target']} | {r['backend']} | {_fmt_value(r)} | {r['op']} {r['threshold']:g}× "
            f"| {fmt_status(r)} | {where} |"
        )
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
            lines.append(
                f"| {r['figure']} | {r['backend']} | {r['time_ratio']:.2f}× | {r['per_param']:.2f}× | {r['where']} |"
            )
    return lines


def run_markdown(run: dict[str, Any]) -> list[str]:
    """One table for one ``(scale, layout)`` run."""
    head = (
        f"### {run['scale']}, one group per {run['layout']} — {run['n_params']:,} params, "
        f"{run['n_stateful']:,} with state, {run['n_groups']:,} groups"
    )
    lines = [
        head,
        "",
        "| method | backend | format | median (min–max) | n | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
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
        lines.append(
            f"| {fig.get('label', mid)} | {fig.get('backend') or '—'} | {fmt or '—'} | {fmt_cell(fig)} | {n} | {note} |"
        )
    return lines


def machine_line(m: dict[str, Any]) -> str:
    """``CPU, N cores; Python; torch; device; backends`` in one line."""
    device = m["device"] + (f" ({m['device_name']})" if m.get("device_name") else "")
    return (
        f"{m['cpu_model']}, {m['cores']} cores; Python {m['python']}; torch {m['torch']}; device {device}; "
        "backends: " + ", ".join(f"{k} {v}" for k, v in m["backends"].items())
    )


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
        (
            f"Command: `{results['command']}` — repeats {c['repeats']} (warm-up excluded), budget {c['budget_s']:g} s "
            f"per method, hidden {c['hidden'] or 'tiny (2,)'}, {c['no_state_fraction']:.0%} of experts without state, "
            f"state via `{c['state_init']}`, gc {'enabled' if c['gc'] else 'disabled while timing'}."
        ),
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
        lines += [
            "## Growth of every figure (information)",
            "",
            (
                "Time at the larger scale ÷ time at the smaller, and per parameter (÷ the parameter ratio; "
                "1.00× = linear)."
            ),
            "",
            *growth_markdown(growth),
            "",
        ]
    lines += ["## Timings", ""]
    for run in results["runs"]:
        lines += run_markdown(run) + [""]
    notes = results.get("notes") or {}
    if notes:
        lines += ["## Notes", ""] + [f"- {k}: {v}" for k, v in notes.items()] + [""]
    return "\n".join(lines)
