"""``bench.scale`` mode ``report``: bench/README.md's Scale tables (markdown) and its plot (an SVG written
by hand: matplotlib is an optional extra, and the plot is two small panels) from the JSON files of the
``dcp``, ``metadata``, ``threshold`` and ``async`` modes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from .scale_dcp import FLOOR, size_label

COLORS = {"per_tensor": "#1f77b4", "buffers": "#ff7f0e", "auto": "#2ca02c", FLOOR: "#222222"}
"""One colour per layout, the same in both panels (tab10's first three)."""
EXTRA_COLORS = ("#9467bd", "#8c564b", "#e377c2")


def color(layout: str, order: Sequence[str]) -> str:
    """The layout's colour (a fixed one for the known layouts, else by position)."""
    return COLORS.get(layout) or EXTRA_COLORS[order.index(layout) % len(EXTRA_COLORS)]


def seconds(s: float) -> str:
    """``0.0004`` -> ``"0.4 ms"``, ``1.234`` -> ``"1.23 s"``."""
    if s < 0.001:
        return f"{s * 1e3:.2f} ms"
    if s < 0.1:
        return f"{s * 1e3:.1f} ms"
    if s < 100:
        return f"{s:.3g} s" if s >= 1 else f"{s:.3f} s"
    return f"{s:,.0f} s"


def nbytes(n: float) -> str:
    """Bytes in KiB / MiB / GiB, three significant digits."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n:.0f} B"


def ratio(x: float | None) -> str:
    """``1.234`` -> ``"1.23×"``."""
    if x is None:
        return "–"
    return f"{x:.3g}×" if x < 100 else f"{x:,.0f}×"


def dcp_table(res: dict[str, Any]) -> str:
    """Fixtures × layouts: save / load medians, the ratios to the floor and to the faster of per_tensor /
    buffers, items and bytes on disk."""
    lines = [
        (
            "| fixture | layout | save | load | × floor (save / load) | × faster of per_tensor, buffers "
            "| items | on disk |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in res["runs"]:
        info = run["info"]
        fixture = f"`{run['fixture']}` ({info['n_param_shaped_state']:,} state tensors, {nbytes(info['state_bytes'])})"
        for r in run["rows"]:
            vf, vb = r.get("vs_floor"), r.get("vs_best")
            synced = r.get("save_vs_floor_synced")
            unsynced = r.get("save_unsynced_vs_floor")
            save = seconds(r["save_s"]) + (
                f" ({seconds(r['save_synced_s'])} with fsync)" if "save_synced_s" in r else ""
            )
            save += f" ({seconds(r['save_unsynced_s'])} without fsync)" if "save_unsynced_s" in r else ""
            like = "; ".join(
                part
                for part in (
                    None if synced is None else f"both fsync: {ratio(synced)}",
                    None if unsynced is None else f"neither: {ratio(unsynced)}",
                )
                if part
            )
            lines.append(
                f"| {fixture} | {r['layout'] if r['layout'] != FLOOR else 'floor (torch.save/load)'} | "
                f"{save} | {seconds(r['load_s'])} | "
                f"{'' if r['layout'] == FLOOR or vf is None else f'{ratio(vf[0])} / {ratio(vf[1])}'}"
                f"{'' if r['layout'] == FLOOR or not like else f' (save {like})'} | "
                f"{'' if r['layout'] == FLOOR or vb is None else f'{ratio(vb[0])} / {ratio(vb[1])}'} | "
                f"{r['items']:,} | {nbytes(r['disk_bytes'])} |"
            )
            fixture = ""
    return "\n".join(lines)


def metadata_table(res: dict[str, Any]) -> str:
    """Ranks × layouts: chunk records, ``.metadata`` bytes, (un)pickle seconds, ratio to per_tensor."""
    lines = [
        "| ranks | layout | chunk records | `.metadata` | pickle | unpickle | ÷ per_tensor (records / bytes) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    last = None
    for r in res["rows"]:
        v = r.get("vs_per_tensor")
        ranks = "" if r["ranks"] == last else f"{r['ranks']:,}"
        scaled = f" (×{r['sample']})" if r["sample"] > 1 else ""
        vs = "" if v is None or r["layout"] == "per_tensor" else f"{v['chunk_records']:.3%} / {v['bytes']:.3%}"
        lines.append(
            f"| {ranks} | {r['layout']} | {r['chunk_records']:,}{scaled} | {nbytes(r['bytes'])} | "
            f"{seconds(r['pickle_s'])} | {seconds(r['unpickle_s'])} | {vs} |"
        )
        last = r["ranks"]
    return "\n".join(lines)


def size_or_none(size: int | None) -> str:
    """A crossover size as a label, or that the sweep had none."""
    return size_label(size) if size else "none in the sweep"


def threshold_table(res: dict[str, Any]) -> str:
    """Chunk sizes: per layout save / load medians and the per_tensor / buffers ratios; the crossovers."""
    layouts = [r["layout"] for r in res["points"][0]["rows"]]
    head = " | ".join(f"{lay} save / load" for lay in layouts)
    lines = [
        f"| chunk | state tensors (total) | {head} | per_tensor ÷ buffers: save / load / save + load |",
        "| --- | --- | " + " | ".join("---" for _ in layouts) + " | --- |",
    ]
    for p in res["points"]:
        cells = " | ".join(f"{seconds(r['save_s'])} / {seconds(r['load_s'])}" for r in p["rows"])
        rt = p.get("ratio")
        lines.append(
            f"| {size_label(p['chunk_bytes'])} | {p['n_state_tensors']:,} ({nbytes(p['state_bytes'])}) | {cells} | "
            f"{'' if rt is None else ' / '.join(f'{x:.2f}' for x in rt)} |"
        )

    def cross(key: str) -> str:
        return size_or_none(res.get(key))

    lines.append("")
    lines.append(
        f"Crossover (one item per tensor at least as fast as buffers at this size and every larger one): "
        f"save and load **{cross('crossover_bytes')}**, save {cross('crossover_save_bytes')}, "
        f"load {cross('crossover_load_bytes')}, save + load {cross('crossover_sum_bytes')}; the first size "
        f"where save and load both hold: {cross('first_bytes')}."
    )
    return "\n".join(lines)


def async_threshold_table(res: dict[str, Any]) -> str:
    """Chunk sizes: how long ``dcp.async_save`` blocks per layout, the ratio and the crossover."""
    lines = [
        "| chunk | state tensors | per_tensor blocked | buffers blocked | per_tensor ÷ buffers |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in res["points"]:
        by = {r["variant"]: r for r in p["rows"]}
        lines.append(
            f"| {size_label(p['chunk_bytes'])} | {p['n_state_tensors']:,} | {seconds(by['per_tensor']['blocked_s'])} | "
            f"{seconds(by['buffers']['blocked_s'])} | {p['blocked_ratio']:.2f} |"
        )
    lines.append("")
    lines.append(
        "Crossover (one item per tensor blocks no longer than buffers at this size and every larger one): "
        f"**{size_or_none(res.get('crossover_blocked_bytes'))}**."
    )
    return "\n".join(lines)


def async_table(res: dict[str, Any]) -> str:
    """Fixtures × variants: blocked (state_dict part), × the copy floor (where measured), total,
    ratios to stock."""
    lines = [
        (
            "| fixture | variant | blocked (of which `state_dict()`) | × copy floor | total until the future is done "
            "| × stock (blocked / total) |"
        ),
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in res["runs"]:
        floor = run.get("copy_floor_s")
        fixture = f"`{run['fixture']}`" + (f" (copy floor {seconds(floor)})" if floor else "")
        for r in run["rows"]:
            v = r.get("vs_stock")
            vf = r.get("vs_floor")
            name = "stock DCP (DSD)" if r["variant"].startswith("stock") else f"SparseOptimizerState {r['variant']}"
            lines.append(
                f"| {fixture} | {name} | {seconds(r['blocked_s'])} ({seconds(r['state_dict_s'])}) | "
                f"{'' if vf is None else ratio(vf)} | {seconds(r['total_s'])} | "
                f"{'' if v is None or r['variant'].startswith('stock') else f'{ratio(v[0])} / {ratio(v[1])}'} |"
            )
            fixture = ""
    return "\n".join(lines)


# --------------------------------------------------------------------------- SVG


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class Panel:
    """A log-y (optionally log-x) plot area inside an SVG: maps data to pixels, draws axes and grid."""

    def __init__(self, x0: float, y0: float, w: float, h: float, ylo: float, yhi: float) -> None:
        self.x0, self.y0, self.w, self.h = x0, y0, w, h
        self.ylo, self.yhi = math.floor(math.log10(ylo)), math.ceil(math.log10(yhi))
        if self.yhi == self.ylo:
            self.yhi += 1
        self.out: list[str] = []

    def y(self, v: float) -> float:
        return self.y0 + self.h * (1 - (math.log10(v) - self.ylo) / (self.yhi - self.ylo))

    def axes(self, title: str, ylabel: str, fmt: Any = None, base: int = 10) -> None:
        """Frame, title, y label and a grid line per power of ``base`` inside the axis range."""
        o = self.out
        o.append(f'<rect x="{self.x0}" y="{self.y0}" width="{self.w}" height="{self.h}" fill="none" stroke="#888"/>')
        lo, hi = 10.0**self.ylo, 10.0**self.yhi
        ticks = [float(base) ** k for k in range(math.floor(math.log(lo, base)), math.ceil(math.log(hi, base)) + 1)]
        for tick in (t for t in ticks if lo <= t <= hi * (1 + 1e-9)):
            yy = self.y(tick)
            o.append(f'<line x1="{self.x0}" x2="{self.x0 + self.w}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#ddd"/>')
            label = fmt(tick) if fmt else f"{tick:g}"
            o.append(f'<text x="{self.x0 - 4}" y="{yy + 4:.1f}" text-anchor="end" font-size="10">{_esc(label)}</text>')
        o.append(
            f'<text x="{self.x0 + self.w / 2}" y="{self.y0 - 8}" text-anchor="middle" font-size="12" '
            f'font-weight="bold">{_esc(title)}</text>'
        )
        o.append(
            f'<text transform="translate({self.x0 - 52},{self.y0 + self.h / 2}) rotate(-90)" text-anchor="middle" '
            f'font-size="11">{_esc(ylabel)}</text>'
        )


def _legend(out: list[str], x: float, y: float, layouts: Sequence[str], order: Sequence[str]) -> None:
    for i, lay in enumerate(layouts):
        out.append(f'<rect x="{x + i * 110}" y="{y}" width="12" height="12" fill="{color(lay, order)}"/>')
        out.append(f'<text x="{x + i * 110 + 16}" y="{y + 10}" font-size="11">{_esc(lay)}</text>')


def svg_plot(dcp: dict[str, Any] | None, metadata: dict[str, Any] | None, title: str) -> str:
    """Left: ``dcp.save`` (solid) and ``dcp.load`` (hatched lighter) time ÷ the floor, per fixture and
    layout; right: ``.metadata`` bytes vs ranks per layout (log-log)."""
    width, height = 1000, 430
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">{_esc(title)}</text>',
    ]
    if dcp is not None:
        layouts = [lay for lay in dcp["layouts"]]
        vals = [v for run in dcp["runs"] for r in run["rows"] if r["layout"] != FLOOR for v in r["vs_floor"]]
        p = Panel(80, 60, 420, 280, min(min(vals), 1.0), max(vals))
        p.axes("dcp.save (solid) / dcp.load (light) ÷ floor", "time ÷ raw-bytes floor", lambda v: f"{v:g}×")
        y1 = p.y(1.0)
        p.out.append(
            f'<line x1="{p.x0}" x2="{p.x0 + p.w}" y1="{y1:.1f}" y2="{y1:.1f}" stroke="#222" stroke-dasharray="4 3"/>'
        )
        n = len(dcp["runs"])
        gw = p.w / n
        bw = gw * 0.8 / (2 * len(layouts))
        for i, run in enumerate(dcp["runs"]):
            by = {r["layout"]: r for r in run["rows"]}
            for j, lay in enumerate(layouts):
                for k, v in enumerate(by[lay]["vs_floor"]):
                    x = p.x0 + i * gw + gw * 0.1 + (2 * j + k) * bw
                    top, base = p.y(v), p.y(10.0**p.ylo)
                    p.out.append(
                        f'<rect x="{x:.1f}" y="{top:.1f}" width="{bw - 1:.1f}" height="{base - top:.1f}" '
                        f'fill="{color(lay, layouts)}" fill-opacity="{1.0 if k == 0 else 0.45}"/>'
                    )
            head, _, tail = run["fixture"].partition(":")  # "8x64" over "h64:e32768x64"
            for line, text in enumerate((head, tail)):
                p.out.append(
                    f'<text x="{p.x0 + (i + 0.5) * gw:.1f}" y="{p.y0 + p.h + 14 + 12 * line}" '
                    f'text-anchor="middle" font-size="10">{_esc(text)}</text>'
                )
        out += p.out
        _legend(out, 80, 380, layouts, layouts)
        out.append(
            f'<text x="80" y="410" font-size="10">dashed: the floor (torch.save / torch.load of the state as '
            f"one tensor per dtype); medians of {dcp.get('repeats', '?')}, torch threads: "
            f"{dcp.get('torch_threads', '?')}</text>"
        )
    if metadata is not None:
        layouts = list(metadata["layouts"])
        rows = metadata["rows"]
        ranks = sorted({r["ranks"] for r in rows})
        p = Panel(620, 60, 340, 280, min(r["bytes"] for r in rows), max(r["bytes"] for r in rows))
        p.axes(".metadata bytes vs ranks", "pickled .metadata", nbytes, base=1024)
        lx0, lx1 = math.log2(ranks[0]), math.log2(ranks[-1]) if len(ranks) > 1 else math.log2(ranks[0]) + 1

        def x(n: int) -> float:
            return p.x0 + 10 + (p.w - 20) * (math.log2(n) - lx0) / ((lx1 - lx0) or 1)

        for n in ranks:
            p.out.append(f'<text x="{x(n):.1f}" y="{p.y0 + p.h + 14}" text-anchor="middle" font-size="10">{n}</text>')
        p.out.append(
            f'<text x="{p.x0 + p.w / 2}" y="{p.y0 + p.h + 30}" text-anchor="middle" font-size="11">ranks</text>'
        )
        for lay in layouts:
            pts = [(x(r["ranks"]), p.y(r["bytes"])) for r in rows if r["layout"] == lay]
            c = color(lay, layouts)
            p.out.append(
                f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
                + '"/>'
            )
            p.out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{c}"/>' for a, b in pts]
        out += p.out
        _legend(out, 620, 380, layouts, layouts)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def report(paths: Sequence[str], svg: str | None) -> str:
    """The markdown of every JSON in ``paths`` (by its mode, in the order given), and the SVG plot at
    ``svg`` (from the first ``dcp`` and the first ``metadata`` file)."""
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    render = {"dcp": dcp_table, "metadata": metadata_table, "threshold": threshold_table, "async": async_table}
    parts = [
        f"<!-- {res['command']} (torch threads: {res.get('torch_threads', '?')}) -->\n"
        f"{(async_threshold_table if res.get('async') else render[res['mode']])(res)}"
        for res in results
    ]
    if svg:
        first = results[0]
        title = (
            f"sparse_ckpt state layouts (torch {first['torch']}, {first['backend']} core, {first['cpu_count']} CPUs)"
        )
        by_mode = {}
        for res in results:
            by_mode.setdefault(res["mode"], res)
        with open(svg, "w") as f:
            f.write(svg_plot(by_mode.get("dcp"), by_mode.get("metadata"), title))
    return "\n\n".join(parts) + "\n"
