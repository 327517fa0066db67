"""``bench.scale`` modes ``dcp`` and ``threshold``: ``dcp.save``/``dcp.load`` of the whole optimizer
(``SparseOptimizerState`` + ``SparseLoadPlanner``) in every state layout of
``sparse_ckpt._layouts.STATE_LAYOUTS``, against the raw-bytes floor (``dcp``), and per state-chunk
size with one item per tensor vs bucketed (``threshold``: what picks the size from which a chunk
keeps an item of its own).

Samples are taken round-robin (sample ``i`` of every layout, then sample ``i + 1``), so a noisy
shared machine slows all layouts alike; each checkpoint is saved, loaded once and deleted.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

import sparse_ckpt as sc
from sparse_ckpt._layouts import STATE_LAYOUTS

from ..suite.devices import synchronize
from ..suite.fixtures import ADAMW_KWARGS, Fixture, FixtureCache, FixtureSpec, build_adamw, uniform_fixture

LEAF = "optim"
FLOOR = "floor"
"""The raw-bytes floor's name in rows: ``torch.save`` / ``torch.load(weights_only=True)`` of the same
state as one tensor per dtype (concatenated beforehand, untimed)."""
PAIR = ("per_tensor", "buffers")
"""The two original layouts; every row's ``vs_best`` divides by the faster of them."""


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def disk_bytes(path: str) -> int:
    """Bytes of a checkpoint folder or file."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def dcp_items(path: str) -> int:
    """Items in a DCP checkpoint's ``.metadata``."""
    import torch.distributed.checkpoint as dcp

    return len(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def rotated(names: Sequence[str], i: int) -> list[str]:
    """The variants in the order of round ``i`` of the round-robin: shuffled with seed ``i`` (the
    same every run), so no variant always runs right after the same other one. A fixed order
    charged what one sample leaves behind to the next: the layout right after the floor's
    ``torch.save``/``torch.load`` saved 2-2.5x slower in every round (0.49-0.69 s vs 0.22 s at
    ``24x128:h64``), though it wrote exactly what ``buffers`` wrote."""
    out = list(names)
    random.Random(i).shuffle(out)
    return out


def settle() -> None:
    """Flush the file system between samples (untimed): what an earlier sample wrote without
    ``fsync`` (the floor's ``torch.save``) and the blocks of the checkpoints just deleted (discarded
    at the next journal commit on this project's ext4, mounted with ``discard``) are otherwise paid
    by the next sample's ``fsync``: the first layout after the floor took 1.5-3x as long."""
    if hasattr(os, "sync"):
        os.sync()


def save_synced(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` and ``fsync`` it: the floor with the durability of DCP's default
    ``FileSystemWriter(sync_files=True)``."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def floor_state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's tensor state as one CPU tensor per dtype (what the floor writes)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                by_dtype.setdefault(v.dtype, []).append(v.reshape(-1))
    return {str(dtype): torch.cat([p.cpu() for p in parts]) for dtype, parts in by_dtype.items()}


def layout_rows(
    fx: Fixture, layouts: Sequence[str], repeats: int, root: str, device: str = "cpu", floor: bool = True
) -> list[dict[str, Any]]:
    """Per layout (and the floor): save and load samples, their medians, items and bytes on disk."""
    import torch.distributed.checkpoint as dcp

    sync = functools.partial(synchronize, torch.device(device).type)
    names = [*layouts, *([FLOOR] if floor else [])]
    samples: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    synced: list[float] = []  # the floor's save with fsync, as DCP's FileSystemWriter syncs by default
    unsynced: dict[str, list[float]] = {
        n: [] for n in layouts
    }  # each layout saved by FileSystemWriter(sync_files=False)
    info: dict[str, tuple[int, int]] = {}
    flat = floor_state(fx.optimizer) if floor else {}
    for i in range(repeats):
        for name in rotated(names, i):
            path = os.path.join(root, f"{name}{i}")
            if name == FLOOR:
                path += ".pt"
                save_s = timed(lambda path=path: torch.save(flat, path))
                load_s = timed(lambda path=path: torch.load(path, weights_only=True))
                items = len(flat)
                synced.append(timed(lambda path=path: save_synced(flat, path + ".sync")))
                os.remove(path + ".sync")
            else:
                state = sc.SparseOptimizerState(fx.model, fx.optimizer, state_layout=name)
                save_s = timed(lambda path=path, state=state: (dcp.save({LEAF: state}, checkpoint_id=path), sync()))
                unsynced[name].append(
                    timed(
                        lambda path=path, state=state: (
                            dcp.save(
                                {LEAF: state}, storage_writer=dcp.FileSystemWriter(path + ".nosync", sync_files=False)
                            ),
                            sync(),
                        )
                    )
                )
                shutil.rmtree(path + ".nosync", ignore_errors=True)
                settle()
                fresh = build_adamw(fx.specs, **ADAMW_KWARGS)
                target = sc.SparseOptimizerState(fx.model, fresh)
                load_s = timed(
                    lambda path=path, target=target: (
                        dcp.load({LEAF: target}, checkpoint_id=path, planner=sc.SparseLoadPlanner()),
                        sync(),
                    )
                )
                if len(fresh.state) != len(fx.optimizer.state):
                    raise AssertionError(
                        f"{name}: loaded state of {len(fresh.state)} params, saved {len(fx.optimizer.state)}"
                    )
                del fresh, target, state  # the loaded copy is not kept into the next sample (untimed)
                items = dcp_items(path)
            info[name] = (items, disk_bytes(path))
            samples[name][0].append(save_s)
            samples[name][1].append(load_s)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            settle()
    rows = []
    for name in names:
        save, load = samples[name]
        rows.append(
            {
                "layout": name,
                "save_s": statistics.median(save),
                "load_s": statistics.median(load),
                "items": info[name][0],
                "disk_bytes": info[name][1],
                "samples_s": [save, load],
            }
        )
        if name == FLOOR and synced:
            rows[-1]["save_synced_s"] = statistics.median(synced)
            rows[-1]["save_synced_samples_s"] = synced
        if unsynced.get(name):
            rows[-1]["save_unsynced_s"] = statistics.median(unsynced[name])
            rows[-1]["save_unsynced_samples_s"] = unsynced[name]
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_floor`` and ``vs_best`` (the faster of per_tensor / buffers) ``[save, load]`` on every row
    where the reference was measured."""
    by = {r["layout"]: r for r in rows}
    for r in rows:
        if FLOOR in by:
            r["vs_floor"] = [r["save_s"] / by[FLOOR]["save_s"], r["load_s"] / by[FLOOR]["load_s"]]
            if "save_synced_s" in by[FLOOR]:
                r["save_vs_floor_synced"] = r["save_s"] / by[FLOOR]["save_synced_s"]
            if "save_unsynced_s" in r:  # like for like the other way: neither syncs
                r["save_unsynced_vs_floor"] = r["save_unsynced_s"] / by[FLOOR]["save_s"]
        if all(p in by for p in PAIR):
            best = [min(by[p]["save_s"] for p in PAIR), min(by[p]["load_s"] for p in PAIR)]
            r["vs_best"] = [r["save_s"] / best[0], r["load_s"] / best[1]]


def run_dcp(
    specs: Sequence[FixtureSpec], group_layout: str, repeats: int, device: str, layouts: Sequence[str] = STATE_LAYOUTS
) -> list[dict[str, Any]]:
    """Mode ``dcp``: :func:`layout_rows` of every fixture, printed as they come."""
    out = []
    for spec in specs:
        fx = FixtureCache(hidden=spec.hidden, device=device, embed=spec.embed).get(spec.scale, group_layout)
        info = {**fx.info, "state_bytes": state_bytes(fx.optimizer)}
        root = tempfile.mkdtemp(prefix="sc_scale_")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows = layout_rows(fx, layouts, repeats, root, device)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for row in rows:
            print(
                f"{spec.label:<20} {row['layout']:<11} save {row['save_s']:>8.3f} s  load {row['load_s']:>8.3f} s  "
                f"items {row['items']:>7,}  {row['disk_bytes'] / 2**20:>8.1f} MiB  "
                f"x floor {_pair(row.get('vs_floor'))}  x best {_pair(row.get('vs_best'))}",
                flush=True,
            )
        out.append({"fixture": spec.label, "info": info, "rows": rows})
        del fx
    return out


def run_spread(
    specs: Sequence[FixtureSpec], group_layout: str, repeats: int, device: str, layouts: Sequence[str] = STATE_LAYOUTS
) -> list[dict[str, Any]]:
    """Mode ``dcp --spread``: :func:`run_dcp` twice, with the huge-page advice of the host buffers on
    (``SPARSE_CKPT_HUGE_PAGES=1``, the default) and off (``=0``), and per fixture, layout and setting
    the spread of the save and load samples (min / median / max): whether a layout's saves are
    bimodal, and whether the huge-page advice is what makes them so."""
    from sparse_ckpt._host_memory import HUGE_PAGES_ENV

    before = os.environ.get(HUGE_PAGES_ENV)
    out = []
    try:
        for setting in ("1", "0"):
            os.environ[HUGE_PAGES_ENV] = setting
            print(f"{HUGE_PAGES_ENV}={setting}", flush=True)
            runs = [
                {**run, "huge_pages": setting, "spread": [spread(row) for row in run["rows"]]}
                for run in run_dcp(specs, group_layout, repeats, device, layouts)
            ]
            print(spread_table(runs), flush=True)  # each setting's figures as soon as they are in
            out += runs
    finally:
        if before is None:
            os.environ.pop(HUGE_PAGES_ENV, None)
        else:
            os.environ[HUGE_PAGES_ENV] = before
    return out


def spread(row: dict[str, Any]) -> dict[str, Any]:
    """``{layout, save: [min, median, max], load: [...]}`` of one :func:`layout_rows` row's samples."""
    save, load = row["samples_s"]
    return {
        "layout": row["layout"],
        "n": len(save),
        "save": [min(save), statistics.median(save), max(save)],
        "load": [min(load), statistics.median(load), max(load)],
    }


def spread_table(runs: Sequence[dict[str, Any]]) -> str:
    """A markdown table of :func:`run_spread`'s figures: one row per fixture, layout and huge-page setting."""
    lines = [
        "| fixture | layout | huge pages | n | save min / median / max | load min / median / max |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    ms = "{:.0f} / {:.0f} / {:.0f} ms".format
    for run in runs:
        for sp in run["spread"]:
            setting = "-" if sp["layout"] == FLOOR else ("on" if run["huge_pages"] == "1" else "off (=0)")
            lines.append(
                f"| `{run['fixture']}` | {sp['layout']} | {setting} | {sp['n']} | "
                f"{ms(*(1e3 * x for x in sp['save']))} | {ms(*(1e3 * x for x in sp['load']))} |"
            )
    return "\n".join(lines)


def _pair(value: list[float] | None) -> str:
    return "-" if value is None else f"{value[0]:.2f}/{value[1]:.2f}"


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's tensor state."""
    return sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )


# --------------------------------------------------------------------------- threshold


def threshold_counts(sizes: Sequence[int], total: int, max_params: int) -> list[tuple[int, int]]:
    """``(chunk bytes, parameters)`` per size: ``total`` bytes of state (two float32 state tensors of the
    chunk's size per parameter), at least one and at most ``max_params`` parameters."""
    return [(size, max(1, min(max_params, total // (2 * size)))) for size in sizes]


def run_threshold(
    sizes: Sequence[int], total: int, max_params: int, repeats: int, layouts: Sequence[str] = PAIR
) -> dict[str, Any]:
    """Mode ``threshold``: per chunk size, ``dcp.save``/``dcp.load`` of the uniform fixture in each of
    ``layouts``; the per-item / bucketed ratios and the crossover."""
    points = []
    for size, n in threshold_counts(sizes, total, max_params):
        fx = uniform_fixture(n, (size // 4,))
        root = tempfile.mkdtemp(prefix="sc_threshold_")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows = layout_rows(fx, layouts, repeats, root, floor=False)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        point = {
            "chunk_bytes": size,
            "n_params": n,
            "n_state_tensors": 2 * n,
            "state_bytes": state_bytes(fx.optimizer),
            "rows": rows,
        }
        by = {r["layout"]: r for r in rows}
        if all(p in by for p in PAIR):
            per, buf = by["per_tensor"], by["buffers"]
            point["ratio"] = [
                per["save_s"] / buf["save_s"],
                per["load_s"] / buf["load_s"],
                (per["save_s"] + per["load_s"]) / (buf["save_s"] + buf["load_s"]),
            ]
        points.append(point)
        print(
            f"chunk {size_label(size):>7} x {2 * n:>6} tensors  "
            + "  ".join(f"{r['layout']} {r['save_s']:.3f}/{r['load_s']:.3f} s" for r in rows)
            + (
                f"  per_tensor/buffers {_pair(point['ratio'])} (sum {point['ratio'][2]:.2f})"
                if "ratio" in point
                else ""
            ),
            flush=True,
        )
        del fx
    result = {"points": points, **crossover(points)}
    print(
        "crossover (per-item at least as fast as buffers from this size on, at every larger size too): "
        + "; ".join(
            f"{what} {size_label(result[f'crossover{sfx}_bytes']) if result[f'crossover{sfx}_bytes'] else 'none'}"
            for what, sfx in (("save and load", ""), ("save", "_save"), ("load", "_load"), ("save + load", "_sum"))
        )
        + f"; the first size where save and load both hold: "
        f"{size_label(result['first_bytes']) if result['first_bytes'] else 'none'}"
    )
    return result


CRITERIA = {"": (0, 1), "_save": (0,), "_load": (1,), "_sum": (2,)}
"""``crossover{suffix}_bytes``: which of a point's ratios (save, load, save + load) must be <= 1."""


def from_size_on(flags: Sequence[tuple[int, bool]]) -> int | None:
    """The smallest size from which on (that size and every larger one; ``flags`` in ascending size)
    the flag holds; ``None`` when it does not hold at the largest."""
    cross = None
    for size, good in reversed(flags):
        if not good:
            break
        cross = size
    return cross


def crossover(points: Sequence[dict[str, Any]]) -> dict[str, int | None]:
    """``crossover_bytes``: the smallest chunk size from which on (that size and every larger one) one
    item per tensor saved and loaded at least as fast as buffers; ``crossover_save_bytes``,
    ``crossover_load_bytes``, ``crossover_sum_bytes``: the same for save alone, load alone and their
    sum; ``first_bytes``: the smallest size at which save and load both did (it differs from
    ``crossover_bytes`` where noise or a real bump flips a larger size back)."""
    rated = sorted((p["chunk_bytes"], p["ratio"]) for p in points if "ratio" in p)
    out: dict[str, int | None] = {}
    for suffix, idx in CRITERIA.items():
        out[f"crossover{suffix}_bytes"] = from_size_on(
            [(size, all(r[i] <= 1.0 for i in idx if i < len(r))) for size, r in rated]
        )
    out["first_bytes"] = next((size for size, r in rated if r[0] <= 1.0 and r[1] <= 1.0), None)
    return out


def size_label(size: int) -> str:
    """``4096`` -> ``"4 KiB"``, ``16 << 20`` -> ``"16 MiB"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def parse_size(text: str) -> int:
    """``"4K"``, ``"16KiB"``, ``"1M"``, ``"4096"`` -> bytes (a multiple of 4: float32 state)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    value = int(t[:-1] if mult > 1 else t) * mult
    if value < 4 or value % 4:
        raise ValueError(f"size {text!r} is not a positive multiple of 4 bytes")
    return value
