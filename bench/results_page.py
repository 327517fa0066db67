"""The results page: docs/results.md's tables and plots, made from the committed JSON of bench/results/.

``python -m bench.results_page`` (in a checkout; needs matplotlib for the plots) re-renders every
table of docs/results.md between its ``<!-- results_page: NAME -->`` and ``<!-- /results_page -->``
markers, and writes the plots to docs/img/. ``--check`` renders the tables only and exits 1 when
the page differs from what the JSON gives, or when a JSON file it reads is not current: it lacks the
provenance every bench records (commit, date, machine, load) or predates the package's default state
layout, a format version or ``BENCH_INPUTS_VERSION`` (`bench.provenance`; bench/README.md,
"Refreshing the results"). ``bash bench/refresh_results.sh`` re-measures them all.
Nothing is measured here: every number comes from a file in bench/results/, which names how it was
measured; each plot names that file, the command that made it and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"
IMG = ROOT / "docs" / "img"
COMMAND = "python -m bench.results_page"
BEGIN, END = "<!-- results_page: {name} -->", "<!-- /results_page -->"
MIB = 1024 * 1024
LAYOUTS = ("auto", "buffers", "per_tensor")
NAIVE_SCALES = ("24x128", "61x256")
"""The main bench's scales the plain-DCP table shows (8x64 is in results/results.md)."""
METADATA_RANKS = (8, 64, 256, 1024)
"""The rank counts the `.metadata` table shows (the plot has every one measured)."""

SOURCES = (
    "hot_path.json",
    "dsd_trainer.json",
    "veomni_checkpointer.json",
    "results.json",
    "scale_dcp.json",
    "scale_dcp_spread.json",
    "scale_metadata.json",
    "titan_compare.json",
)
"""The JSON files of bench/results/ the page's tables and plots read (bench/refresh_results.sh makes each)."""
REFRESH = "bash bench/refresh_results.sh"

MACHINES = {
    # where a JSON file measured before provenance was recorded does not name the machine,
    # bench/README.md's account of the run does
    "dsd_trainer.json": None,  # recorded in the file
    "titan_compare.json": "shared 2-core CPU VM, load average ~3-6",
    "veomni_checkpointer.json": "2-core CPU VM, load average ~2",
    "results.json": None,
    "scale_dcp.json": "quiet 2-core CPU VM (load average < 1), 1 torch thread",
    "scale_dcp_4k_pages.json": "quiet 2-core CPU VM (load average < 1), 1 torch thread",
    "scale_metadata.json": "shared 2-core CPU VM (load average 2-6)",
    "hot_path.json": None,  # recorded in the file
    "scale_dcp_spread.json": "quiet 2-core CPU VM (load average < 1), 1 torch thread",
}


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    """One committed JSON file of bench/results/."""
    return json.loads((results / name).read_text(encoding="utf-8"))


def machine(name: str, data: dict[str, Any]) -> str:
    """The machine a JSON file was measured on, in words."""
    prov = data.get("provenance")
    if isinstance(prov, dict) and "machine" in prov:
        m, load_avg = prov["machine"], prov["load_average"]
        loads = [x[0] for x in (load_avg.get("before"), load_avg.get("after")) if x]
        return (
            f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}"
            + (f", load average {min(loads):.1f}-{max(loads):.1f}" if loads else "")
            + f", commit {prov['commit']}, {prov['date'][:10]}"
        )
    if name == "dsd_trainer.json":
        m = data["machine"]
        return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, load average up to {max(m['load_average']):.1f}"
    if name == "hot_path.json":
        return (
            f"{data['cpu_count']}-core CPU VM, load average {max(data['load_average']):.2f}, "
            f"torch {data['torch']}, {data['backend']} core"
        )
    if name == "results.json":
        m = data["machine"]
        return f"{m['cpu_model']}, {m['cores']} cores, torch {m['torch']}"
    torch_version = data.get("torch")
    return MACHINES[name] + (f", torch {torch_version}" if torch_version else "")


def stale(results: Path = RESULTS) -> list[str]:
    """Why the JSON files the page reads are not current (`bench.provenance.problems`), one line each; [] if all are."""
    out = []
    for name in SOURCES:
        path = results / name
        if not path.is_file():
            out.append(f"{name}: missing from {results}; rerun: {REFRESH} {name}")
            continue
        out += provenance.problems(name, load(name, results), f"{REFRESH} {name}")
    return out


def _n(x: float) -> str:
    """An integer with thin-space thousands, as the docs write them."""
    return f"{int(x):,}".replace(",", " ")


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes < 1e7 else f"{nbytes / 1e6:.1f} MB"


def _x(a: float, b: float) -> str:
    """``b`` as a multiple of ``a`` (how many times smaller or faster sparse_ckpt is)."""
    return f"{a / b:.1f}x"


# ---- the stock-vs-sparse_ckpt comparisons -------------------------------------------------------


def stock_rows(results: Path = RESULTS) -> list[dict[str, Any]]:
    """One row per trainer comparison: stock and sparse_ckpt items, bytes, save and load seconds
    (``None`` where the stock load fails), with the JSON file it comes from."""
    rows = []
    dsd = {(r["scenario"], r["method"]): r for r in load("dsd_trainer.json", results)["rows"]}
    for scenario, title in (
        ("fresh", "torch DSD, saved before the first step"),
        ("step3", "torch DSD, saved after step 3"),
    ):
        s, o = dsd[(scenario, "stock")], dsd[(scenario, "install()")]
        rows.append(
            {
                "what": title,
                "source": "dsd_trainer.json",
                "stock": (s["items"], s["bytes"], s["save_s"], None if s["load_error"] else s["load_s"]),
                "sparse": (o["items"], o["bytes"], o["save_s"], o["load_s"]),
            }
        )
    titan = load("titan_compare.json", results)["results"]
    for scenario, title in (
        ("moe", "torchtitan, half the experts routed"),
        ("dense", "torchtitan, every expert routed"),
    ):
        s, o = titan[f"{scenario}/stock"], titan[f"{scenario}/sparse"]
        rows.append(
            {
                "what": title,
                "source": "titan_compare.json",
                "stock": (s["optimizer_items"], s["bytes"], s["save_s"], s["load_s"]),
                "sparse": (o["optimizer_items"], o["bytes"], o["save_s"], o["load_s"]),
                "note": "allow_partial_load=True" if scenario == "moe" else None,
                "label": title + (" (stock load: partial)" if scenario == "moe" else ""),
            }
        )
    ve = load("veomni_checkpointer.json", results)
    rows.append(
        {
            "what": "VeOmni, 24 of 32 experts routed",
            "source": "veomni_checkpointer.json",
            "stock": tuple(
                ve["stock"][k] if k in ("optimizer_items", "bytes") else ve["stock"][k]["median"]
                for k in ("optimizer_items", "bytes", "save_s", "load_s")
            ),
            "sparse": tuple(
                ve["sparse"][k] if k in ("optimizer_items", "bytes") else ve["sparse"][k]["median"]
                for k in ("optimizer_items", "bytes", "save_s", "load_s")
            ),
        }
    )
    return rows


def stock_table(results: Path = RESULTS) -> str:
    """The stock-vs-sparse_ckpt table: items, bytes, save and load, each stock -> sparse_ckpt (ratio)."""
    out = [
        "| comparison (data) | optimizer DCP items | bytes on disk | save | load |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in stock_rows(results):
        (si, sb, ss, sl), (oi, ob, os_, ol) = r["stock"], r["sparse"]
        load_cell = f"fails -> {_t(ol)}" if sl is None else f"{_t(sl)} -> {_t(ol)} ({_x(sl, ol)})"
        if r.get("note"):
            load_cell += f" (stock: {r['note']})"
        out.append(
            f"| {r['what']} ([{r['source']}](../bench/results/{r['source']})) | {_n(si)} -> {_n(oi)} "
            f"({_x(si, oi)}) | {_mb(sb)} -> {_mb(ob)} ({_x(sb, ob)}) | {_t(ss)} -> {_t(os_)} ({_x(ss, os_)}) | "
            f"{load_cell} |"
        )
    return "\n".join(out)


def naive_table(results: Path = RESULTS) -> str:
    """DCP of the whole optimizer, plain (FQN-keyed ``optimizer.state_dict()``) vs SparseOptimizerState,
    from the main bench's committed run, where both were measured."""
    data = load("results.json", results)
    out = [
        (
            "| fixture (results.json) | plain DCP: items, bytes, save / load "
            "| SparseOptimizerState: items, bytes, save / load |"
        ),
        "| --- | --- | --- |",
    ]
    for run in data["runs"]:
        f = run["figures"]
        naive_s, naive_l = f.get("dcp/save/naive/all", {}), f.get("dcp/load/naive/all", {})
        ours_s, ours_l = f.get("dcp/save/packed/stateful", {}), f.get("dcp/load/packed/stateful", {})
        if run["scale"] not in NAIVE_SCALES or not all(
            x.get("status") == "ok" for x in (naive_s, naive_l, ours_s, ours_l)
        ):
            continue
        groups = "one group per parameter" if run["layout"] == "param" else "one group per layer"
        out.append(
            f"| `{run['scale']}`, {_n(run['n_params'])} parameters, {groups} | {_n(naive_s['items'])}, "
            f"{naive_s['bytes'] / MIB:.1f} MiB, {_t(naive_s['median_s'])} / {_t(naive_l['median_s'])} | "
            f"{_n(ours_s['items'])}, {ours_s['bytes'] / MIB:.1f} MiB, {_t(ours_s['median_s'])} / "
            f"{_t(ours_l['median_s'])} |"
        )
    return "\n".join(out)


# ---- .metadata vs ranks, DCP vs the raw-bytes floor ------------------------------------------------


def metadata_table(results: Path = RESULTS) -> str:
    """``.metadata`` size and unpickle time per layout at each rank count."""
    data = load("scale_metadata.json", results)
    rows = {(r["ranks"], r["layout"]): r for r in data["rows"]}
    ranks = [n for n in sorted({r["ranks"] for r in data["rows"]}) if n in METADATA_RANKS]
    out = [
        "| ranks | " + " | ".join(f"`{lay}`: `.metadata`, unpickle" for lay in LAYOUTS) + " |",
        "| --- |" + " --- |" * len(LAYOUTS),
    ]
    for n in ranks:
        cells = []
        for lay in LAYOUTS:
            r = rows[(n, lay)]
            size = f"{r['bytes'] / MIB:.2f} MiB" if r["bytes"] >= MIB else f"{r['bytes'] / 1024:.1f} KiB"
            if r["bytes"] >= 1024**3:
                size = f"{r['bytes'] / 1024**3:.2f} GiB"
            cells.append(f"{size}, {_t(r['unpickle_s'])}" + (f" (×{r['sample']})" if r.get("sample", 1) > 1 else ""))
        out.append(f"| {_n(n)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _fixture_label(run: dict[str, Any]) -> str:
    info = run["info"]
    return f"`{run['fixture']}` ({_n(info['n_param_shaped_state'])} state tensors, {info['state_bytes'] / MIB:.1f} MiB)"


def floor_table(results: Path = RESULTS) -> str:
    """Whole-optimizer ``dcp.save`` / ``dcp.load`` per layout as a multiple of the raw-bytes floor."""
    data = load("scale_dcp.json", results)
    out = [
        "| fixture | layout | items | save ÷ floor (both fsync) | load ÷ floor | save / load |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in data["runs"]:
        rows = {r["layout"]: r for r in run["rows"]}
        for i, lay in enumerate(LAYOUTS):
            r = rows[lay]
            out.append(
                f"| {_fixture_label(run) if i == 0 else ''} | {lay} | {_n(r['items'])} | "
                f"{r['save_vs_floor_synced']:.2f}x | {r['vs_floor'][1]:.2f}x | {_t(r['save_s'])} / {_t(r['load_s'])} |"
            )
        f = rows["floor"]
        out.append(
            f"|  | floor (`torch.save` + fsync / `torch.load`) | 1 | | | "
            f"{_t(f['save_s'] / f['save_vs_floor_synced'])} / {_t(f['load_s'])} |"
        )
    return "\n".join(out)


def spread20_table(results: Path = RESULTS) -> str:
    """``bench.scale dcp --spread``: min / median / max of every layout's saves and loads, huge pages on and off."""
    data = load("scale_dcp_spread.json", results)
    out = [
        "| fixture | layout | huge pages | save: min / median / max | load: min / median / max | n |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in data["runs"]:
        pages = "advised (default)" if run["huge_pages"] == "1" else "`SPARSE_CKPT_HUGE_PAGES=0`"
        for row in run["spread"]:
            lay = "floor (`torch.save` / `torch.load`)" if row["layout"] == "floor" else row["layout"]
            save, load_ = (" / ".join(_t(x) for x in row[k]) for k in ("save", "load"))
            out.append(f"| `{run['fixture']}` | {lay} | {pages} | {save} | {load_} | {row['n']} |")
    return "\n".join(out)


def hot_table(results: Path = RESULTS) -> str:
    """``bench.hot_path``: the floor, save and load alternated; medians and per-round ratio medians."""
    data = load("hot_path.json", results)
    out = [
        "| alternated, `"
        + data["scale"]
        + "` one group per "
        + data["layout"]
        + " | wall: median (min-max) | CPU: median | ÷ floor, wall | ÷ floor, CPU |",
        "| --- | --- | --- | --- | --- |",
    ]
    labels = {
        "floor": "`optimizer.state_dict()` (the floor)",
        "save": "`sparse_state_dict`",
        "load": "`load_sparse_state_dict`",
    }
    for m, label in labels.items():
        w, c = data["samples_s"]["wall"][m], data["samples_s"]["cpu"][m]
        ratio = ("", "") if m == "floor" else tuple(f"{data['ratios'][f'{m}/floor {k}']:.2f}x" for k in ("wall", "cpu"))
        out.append(
            f"| {label} | {_t(statistics.median(w))} ({_t(min(w))}-{_t(max(w))}) | {_t(statistics.median(c))} | "
            f"{ratio[0]} | {ratio[1]} |"
        )
    return "\n".join(out)


def memory_table(results: Path = RESULTS) -> str:
    """The in-memory figures of the main bench's committed run at ``61x256`` (C++ core, packed)."""
    data = load("results.json", results)
    out = ["| `61x256` (47 275 parameters) | one group per parameter | one group per layer |", "| --- | --- | --- |"]
    runs = {r["layout"]: r["figures"] for r in data["runs"] if r["scale"] == "61x256"}
    names = (
        ("floor/state_dict", "`optimizer.state_dict()` (the floor)"),
        ("sparse/save/cpp/packed", "`sparse_state_dict`"),
        ("sparse/load/cpp/packed", "`load_sparse_state_dict`"),
        ("floor/load_state_dict", "`optimizer.load_state_dict()`"),
        ("dsd/get", "DSD `get_optimizer_state_dict`"),
        ("dsd/set", "DSD `set_optimizer_state_dict`"),
    )
    for key, label in names:
        cells = []
        for lay in ("param", "layer"):
            fig = runs[lay].get(key, {})
            cells.append(_t(fig["median_s"]) if fig.get("status") == "ok" else f"{fig.get('status', 'absent')}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


TABLES: dict[str, Callable[[Path], str]] = {
    "stock": stock_table,
    "naive": naive_table,
    "metadata": metadata_table,
    "floor": floor_table,
    "spread20": spread20_table,
    "memory": memory_table,
    "hot": hot_table,
}


def render_page(text: str, results: Path = RESULTS) -> str:
    """``text`` with every marked table re-rendered from the JSON."""
    for name, make in TABLES.items():
        begin = BEGIN.format(name=name)
        if begin not in text:
            continue
        head, rest = text.split(begin, 1)
        _old, tail = rest.split(END, 1)
        text = f"{head}{begin}\n{make(results)}\n{END}{tail}"
    return text


# ---- plots ----------------------------------------------------------------------------------------


def _footer(fig: Any, sources: list[str], results: Path) -> None:
    lines = [f"made by `{COMMAND}` from bench/results/{', '.join(sources)}"]
    lines += [f"{s}: {machine(s, load(s, results))}" for s in sources]
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=7.5, color="#444444", va="bottom", ha="left")


def plot_stock(out: Path, results: Path = RESULTS) -> Path:
    """Four panels (items, bytes, save, load): stock vs sparse_ckpt per comparison, log scale."""
    import matplotlib.pyplot as plt

    rows = stock_rows(results)
    fig, axes = plt.subplots(1, 4, figsize=(15, 5.6))
    titles = ("optimizer DCP items", "bytes on disk (MB)", "save (s)", "load (s)")
    y = list(range(len(rows)))
    for k, (ax, title) in enumerate(zip(axes, titles)):
        scale = 1e-6 if k == 1 else 1.0
        bars = []
        for j, who in enumerate(("stock", "sparse")):
            vals = [None if r[who][k] is None else r[who][k] * scale for r in rows]
            pos = [i + (0.2 if j == 0 else -0.2) for i in y]
            ax.barh(
                pos,
                [v or 0 for v in vals],
                height=0.38,
                color="#b0b0b0" if who == "stock" else "tab:blue",
                label="stock" if who == "stock" else "sparse_ckpt",
            )
            bars += list(zip(pos, vals))
        ax.set_xscale("log")
        present = [v for _p, v in bars if v]
        lo, hi = min(present) / 4, max(present) * 8
        ax.set_xlim(lo, hi)
        for p, v in bars:
            text = "stock load fails" if v is None else (f" {v:,.0f}" if v >= 100 else f" {v:.3g}")
            ax.text(
                v if v else lo * 1.15, p, text, va="center", fontsize=7.5, color="#aa0000" if v is None else "black"
            )
        ax.set_title(title, fontsize=10)
        ax.set_yticks(y)
        ax.set_yticklabels([r.get("label", r["what"]) for r in rows] if k == 0 else [], fontsize=8.5)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[0].legend(loc="lower left", bbox_to_anchor=(0, 1.07), ncol=2, fontsize=9, frameon=False)
    fig.suptitle(
        "Stock trainer checkpointing vs sparse_ckpt, same model and trainer per row (lower is better)", fontsize=11
    )
    _footer(fig, ["dsd_trainer.json", "titan_compare.json", "veomni_checkpointer.json"], results)
    fig.tight_layout(rect=(0, 0.09, 1, 0.97))
    return _save(fig, out / "results-stock.png")


def plot_metadata(out: Path, results: Path = RESULTS) -> Path:
    """``.metadata`` bytes and unpickle time vs ranks, per layout, log-log."""
    import matplotlib.pyplot as plt

    data = load("scale_metadata.json", results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    styles = {"auto": ("tab:blue", "o"), "buffers": ("tab:green", "s"), "per_tensor": ("#888888", "D")}
    for lay in LAYOUTS:
        rows = sorted((r for r in data["rows"] if r["layout"] == lay), key=lambda r: r["ranks"])
        colour, marker = styles[lay]
        axes[0].plot([r["ranks"] for r in rows], [r["bytes"] for r in rows], marker=marker, color=colour, label=lay)
        axes[1].plot(
            [r["ranks"] for r in rows], [r["unpickle_s"] for r in rows], marker=marker, color=colour, label=lay
        )
    for ax, title in zip(axes, ("`.metadata` size (bytes)", "unpickling it, every rank, every load (s)")):
        ax.set_xscale("log", base=2)
        ranks = sorted({r["ranks"] for r in data["rows"]})
        ax.set_xticks(ranks)
        ax.set_xticklabels([str(n) for n in ranks])
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(title="state_layout", fontsize=9)
    fig.suptitle(
        f"DCP `.metadata` vs ranks: optimizer of `{data['fixture']}` ({data['n_param_shaped_state']:,} state tensors), "
        "FSDP2-sharded, one sample per point",
        fontsize=10.5,
    )
    _footer(fig, ["scale_metadata.json"], results)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    return _save(fig, out / "results-metadata.png")


def plot_floor(out: Path, results: Path = RESULTS) -> Path:
    """Whole-optimizer save and load per layout as a multiple of the raw-bytes floor, per fixture."""
    import matplotlib.pyplot as plt

    data = load("scale_dcp.json", results)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    colours = {"auto": "tab:blue", "buffers": "tab:green", "per_tensor": "#888888"}
    fixtures = [run["fixture"] for run in data["runs"]]
    for ax, (title, value) in zip(
        axes,
        (
            ("save ÷ floor (DCP's default writer vs torch.save + fsync)", lambda r: r["save_vs_floor_synced"]),
            ("load ÷ floor (torch.load)", lambda r: r["vs_floor"][1]),
        ),
    ):
        for j, lay in enumerate(LAYOUTS):
            vals = [value(next(r for r in run["rows"] if r["layout"] == lay)) for run in data["runs"]]
            pos = [i + (j - 1) * 0.27 for i in range(len(fixtures))]
            ax.bar(pos, vals, width=0.26, color=colours[lay], label=lay)
            for p, v in zip(pos, vals):
                ax.text(p, v, f"{v:,.0f}" if v >= 10 else f"{v:.2g}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1, color="black", lw=0.8)
        ax.axhline(2, color="black", lw=0.6, ls=":")
        ax.set_yscale("log")
        ax.set_xticks(range(len(fixtures)))
        ax.set_xticklabels(fixtures, fontsize=8.5)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("× the raw-bytes floor (1 = as fast; dotted: 2×)")
    axes[0].legend(title="state_layout", fontsize=9)
    fig.suptitle(
        "dcp.save / dcp.load of the whole optimizer (SparseOptimizerState) vs torch.save / torch.load of "
        "the same bytes, medians of 11",
        fontsize=10.5,
    )
    _footer(fig, ["scale_dcp.json"], results)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    return _save(fig, out / "results-floor.png")


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


PLOTS = (plot_stock, plot_metadata, plot_floor)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON files (default: bench/results/)")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page whose marked tables are re-rendered")
    parser.add_argument("--img", type=Path, default=IMG, help="where the plots go (default: docs/img/)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="tables only: exit 1 if the page is not what the JSON gives or a JSON file is not current",
    )
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    rendered = render_page(text, args.results)
    if args.check:
        problems = stale(args.results)
        for line in problems:
            print(f"not current: {line}", file=sys.stderr)
        if rendered != text:
            print(f"{args.page} is out of date with {args.results}: run {COMMAND}", file=sys.stderr)
        return 1 if problems or rendered != text else 0
    if rendered != text:
        args.page.write_text(rendered, encoding="utf-8")
    print(f"wrote {args.page}")
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is not installed: plots skipped (pip install 'sparse_ckpt[bench]')")
        return 0
    for plot in PLOTS:
        print(f"wrote {plot(args.img, args.results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
