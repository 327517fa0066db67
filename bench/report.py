"""Turn the bench's results into ``results.json``, ``results.md`` and ``scaling.png``.

The targets (DESIGN §8, issue 5) are computed here as ratios with PASS/MISS; they are a report,
never an assertion. Target scale: ``61x256`` with one group per parameter when it was run,
otherwise the largest scale run (the table says which).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

TARGET_SCALE = "61x256"
TARGET_LAYOUT = "param"
GROWTH_PAIR = ("24x128", "61x256")
GROWTH_LIMIT = 6.0
OK = "ok"


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
        status = "N/A"
    else:
        status = "PASS" if (value <= threshold if op == "<=" else value >= threshold) else "MISS"
    return {
        "target": target,
        "backend": backend,
        "value": value,
        "op": op,
        "threshold": threshold,
        "status": status,
        "where": where,
        "reason": why if value is None else "",
    }


def _largest_scale(results: dict[str, Any], layout: str) -> str | None:
    runs = [r for r in results["runs"] if r["layout"] == layout]
    if not runs:
        return None
    return max(runs, key=lambda r: r["n_params"])["scale"]


def compute_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets table rows (both backends; the targets are stated for ``cpp``)."""
    scale = TARGET_SCALE if _find_run(results, TARGET_SCALE, TARGET_LAYOUT) else _largest_scale(results, TARGET_LAYOUT)
    run = _find_run(results, scale, TARGET_LAYOUT) if scale else None
    where = f"{scale}, {TARGET_LAYOUT}" if scale else "no 'param' layout run"
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

    for b in ("cpp", "python"):
        save, floor = f"sparse/save/{b}/packed", "floor/state_dict"
        rows.append(_row("sparse_state_dict / floor state_dict()", b, _ratio(_median(run, save), _median(run, floor)),
                         "<=", 2.0, where, why(b, save, floor)))
        load, dsd, floor_l = f"sparse/load/{b}/packed", "dsd/set", "floor/load_state_dict"
        rows.append(_row("DSD set_optimizer_state_dict / load_sparse_state_dict", b,
                         _ratio(_median(run, dsd), _median(run, load)), ">=", 100.0, where, why(b, load, dsd)))
        rows.extend(_largest_measured_rows(results, run, "DSD set_optimizer_state_dict / load_sparse_state_dict",
                                           b, dsd, load, ">=", 100.0))
        rows.append(_row("load_sparse_state_dict / floor load_state_dict()", b,
                         _ratio(_median(run, load), _median(run, floor_l)), "<=", 3.0, where, why(b, load, floor_l)))
        rows.extend(_largest_measured_rows(results, run, "load_sparse_state_dict / floor load_state_dict()",
                                           b, load, floor_l, "<=", 3.0))
    for fn in ("pack_optimizer", "remap_to_fqns", "encode_table"):
        py, cpp = f"core/{fn}/python", f"core/{fn}/cpp"
        rows.append(_row(f"core.{fn}: python / cpp", "cpp", _ratio(_median(run, py), _median(run, cpp)),
                         ">=", 3.0, where, why("cpp", py, cpp)))
    rows.extend(dcp_rows(results, run, where))
    rows.extend(growth_summary(results))
    return rows


def _largest_measured_rows(
    results: dict[str, Any], target_run: dict[str, Any] | None, target: str, backend: str, num: str, den: str,
    op: str, threshold: float,
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
            rows.append(_row(target, backend, _ratio(_median(src, num), _median(src, den)), op, threshold,
                             f"{src['scale']}, {layout} (largest scale where both were measured)"))
    return rows


DCP_GROUP_IDS = ("dcp/save/packed/groups", "dcp/load/packed/groups", "dcp/save/flat/groups", "dcp/load/flat/groups")


def dcp_rows(results: dict[str, Any], run: dict[str, Any] | None, where: str) -> list[dict[str, Any]]:
    """DCP of the param-group metadata alone, flat vs packed: time and bytes ratios.

    When the target run skipped the flat DCP figures (``--dcp-max-items``), the largest run of the
    same layout that has all four is used instead (the ratio grows with the parameter count, so a
    smaller scale understates it); ``where`` says so.
    """
    src = run
    if src is None or any(_median(src, i) is None for i in DCP_GROUP_IDS):
        layout = run["layout"] if run else TARGET_LAYOUT
        done = [r for r in results["runs"] if r["layout"] == layout and all(_median(r, i) is not None
                                                                            for i in DCP_GROUP_IDS)]
        if done:
            src = max(done, key=lambda r: r["n_params"])
            skipped = run["figures"].get("dcp/save/flat/groups", {}).get("reason", "") if run else ""
            where = f"{src['scale']}, {layout} (largest scale with flat DCP measured; {where}: {skipped or 'not run'})"
    med = {i: _median(src, i) for i in DCP_GROUP_IDS}
    packed_t = None if None in (med[DCP_GROUP_IDS[0]], med[DCP_GROUP_IDS[1]]) else med[DCP_GROUP_IDS[0]] + med[DCP_GROUP_IDS[1]]
    flat_t = None if None in (med[DCP_GROUP_IDS[2]], med[DCP_GROUP_IDS[3]]) else med[DCP_GROUP_IDS[2]] + med[DCP_GROUP_IDS[3]]
    why = "; ".join(f"{i}: {src['figures'].get(i, {}).get('status', 'absent')}" for i in DCP_GROUP_IDS
                    if med[i] is None) if src else "not run"
    fig_f = src["figures"].get("dcp/save/flat/groups", {}) if src else {}
    fig_p = src["figures"].get("dcp/save/packed/groups", {}) if src else {}
    return [
        _row("DCP save+load of param groups: flat time / packed time", "—", _ratio(flat_t, packed_t), ">=", 50.0,
             where, why),
        _row("DCP param groups: flat bytes / packed bytes", "—", _ratio(fig_f.get("bytes"), fig_p.get("bytes")),
             ">=", 50.0, where, why),
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
    return small["scale"], big["scale"], round(1.2 * big["n_params"] / small["n_params"], 2)


def growth_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per sparse_ckpt figure (families ``sparse`` and ``core``): time(big) / time(small); torch's
    floor figures are listed too, for reference (backend ``—``, not counted by the summary)."""
    from .measure import SPARSE_FAMILIES

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
    for b in ("cpp", "python"):
        mine = [r for r in rows if r["backend"] == b and r["value"] is not None]
        if not mine:
            out.append(_row("growth of every sparse_ckpt figure", b, None, "<=", GROWTH_LIMIT, "—",
                            "needs two scales with both backends measured"))
            continue
        worst = max(mine, key=lambda r: r["value"] / r["threshold"])
        row = _row("growth of every sparse_ckpt figure (worst)", b, worst["value"], "<=", worst["threshold"],
                   f"{worst['where']}: {worst['target'].removeprefix('growth ')}")
        misses = sum(1 for r in mine if r["status"] == "MISS")
        row["detail"] = f"{len(mine) - misses}/{len(mine)} within the limit"
        out.append(row)
    return out


# --------------------------------------------------------------------------- markdown


def _fmt_value(row: dict[str, Any]) -> str:
    v = row["value"]
    if v is None:
        return "—"
    return f"{v:.2f}×" if v < 100 else f"{v:.0f}×"


def targets_markdown(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The targets table."""
    lines = ["| target | backend | measured | required | status | where |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        where = r["where"] + (f" — {r['detail']}" if r.get("detail") else "")
        status = r["status"] + (f" ({r['reason']})" if r.get("reason") else "")
        lines.append(f"| {r['target']} | {r['backend']} | {_fmt_value(r)} | {r['op']} {r['threshold']:g}× "
                     f"| {status} | {where} |")
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


def render_markdown(results: dict[str, Any]) -> str:
    """The whole ``results.md``."""
    m = results["machine"]
    c = results["config"]
    lines = [
        "# sparse_ckpt bench results",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores; Python {m['python']}; torch {m['torch']}; "
        f"device {m['device']}; backends: " + ", ".join(f"{k} {v}" for k, v in m["backends"].items()) + ".",
        "",
        (f"Command: `{results['command']}` — repeats {c['repeats']} (warm-up excluded), budget {c['budget_s']:g} s "
        f"per method, hidden {c['hidden'] or 'tiny (2,)'}, {c['no_state_fraction']:.0%} of experts without state, "
        f"state via `{c['state_init']}`, gc {'enabled' if c['gc'] else 'disabled while timing'}."),
        "",
        "## Targets",
        "",
        *targets_markdown(results["targets"]),
        "",
    ]
    growth = growth_rows(results)
    if growth:
        lines += ["## Growth of every sparse_ckpt figure", "", *targets_markdown(growth), ""]
    lines += ["## Timings", ""]
    for run in results["runs"]:
        lines += run_markdown(run) + [""]
    notes = results.get("notes") or {}
    if notes:
        lines += ["## Notes", ""] + [f"- {k}: {v}" for k, v in notes.items()] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- plot

PLOT_PANELS = (
    ("save side", ("floor/state_dict", "sparse/save", "dsd/get")),
    ("load side", ("floor/load_state_dict", "sparse/load", "dsd/set")),
    ("DCP", ("dcp/",)),
    ("core functions", ("core/",)),
)


def write_plot(results: dict[str, Any], path: str) -> str | None:
    """Log-log time vs parameter count, one line per method; ``None`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'); scaling.png was not written"
    layouts = list(results["config"]["layouts"])
    palette = plt.get_cmap("tab20")
    fig, axes = plt.subplots(len(layouts), len(PLOT_PANELS), figsize=(6 * len(PLOT_PANELS), 4.5 * len(layouts)),
                             squeeze=False)
    for row, layout in enumerate(layouts):
        runs = sorted((r for r in results["runs"] if r["layout"] == layout), key=lambda r: r["n_params"])
        ids: list[str] = []
        for r in runs:
            ids += [i for i in r["figures"] if i not in ids]
        for col, (title, prefixes) in enumerate(PLOT_PANELS):
            ax = axes[row][col]
            for mid in ids:
                if not mid.startswith(prefixes):
                    continue
                pts = [(r["n_params"], r["figures"][mid]["median_s"]) for r in runs
                       if r["figures"].get(mid, {}).get("status") == OK and r["figures"][mid]["median_s"] > 0]
                if not pts:
                    continue
                key = mid.replace("/cpp", "").replace("/python", "")
                color = palette(sorted({i.replace("/cpp", "").replace("/python", "") for i in ids}).index(key) % 20)
                style = ":" if "/python" in mid else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o", markersize=3,
                        label=mid)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{title} — one group per {layout}")
            ax.set_xlabel("parameters")
            ax.set_ylabel("seconds (median)")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_all(results: dict[str, Any], out_dir: str) -> dict[str, str | None]:
    """Write results.json, results.md and scaling.png; return ``{name: path or None}`` and plot message."""
    os.makedirs(out_dir, exist_ok=True)
    results["targets"] = compute_targets(results)
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)
        f.write("\n")
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(render_markdown(results))
    png_path = os.path.join(out_dir, "scaling.png")
    msg = write_plot(results, png_path)
    return {"json": json_path, "md": md_path, "png": None if msg else png_path, "plot_message": msg}
