"""``bench.scale`` mode ``async``: how long ``dcp.async_save`` blocks the training loop.

Per fixture and round-robin over the variants, one ``dcp.async_save`` per sample with torch's default
async path (``DefaultStager``: the state dict is copied to CPU memory before the call returns; a
thread then plans and writes) in a one-rank Gloo process group started in this process:

* ``blocked_s``: from the call until ``async_save`` returns its future (what the loop waits for: the
  Stateful's ``state_dict()`` plus the staging copy), of which ``state_dict_s`` is the Stateful's
  ``state_dict()`` alone;
* ``total_s``: from the call until the future's ``result()`` returns (the checkpoint is complete).

Beside them, per fixture and sample, the copy floor ``copy_floor_s``: the optimizer's state tensors
copied once into host buffers allocated (and written) before the first sample, so no page is
faulted in (one ``torch.stack`` per dtype and shape), in the same rotation as the variants. What
``async_save`` must copy before it returns is the state's bytes once; each row's ``vs_floor`` is its
``blocked_s`` over ``copy_floor_s``.

Each ``SparseOptimizerState`` variant is one object for all its samples, as a training loop keeps
its Stateful, and is saved once untimed before the first sample: like the copy floor's buffers,
the host buffers its captures stage into (its pool, ``sparse_ckpt._host_memory.HostPool``) are
then allocated and mapped, and a sample measures a save of a run that has saved before. Each
row's ``staging_allocs`` is how many host buffers each sample's save allocated (0 once warm).

Variants: ``SparseOptimizerState`` in every layout of ``STATE_LAYOUTS``, and ``stock``: the state
dict of torch DSD's ``get_optimizer_state_dict(model, optimizer)`` with its default options (DCP's own
tutorial's pattern: an app Stateful returning DSD's dict), so the capture runs inside ``async_save``
as it does for ``SparseOptimizerState``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Any

import sparse_ckpt as sc
from sparse_ckpt._layouts import STATE_LAYOUTS

from ..suite.fixtures import FixtureCache, FixtureSpec
from .scale_dcp import LEAF, disk_bytes, rotated, settle, state_bytes

STOCK = "stock_dsd"
FLOOR = "copy_floor"
"""The rotation's entry that times :class:`CopyFloor` instead of a save."""


class Timed:
    """A DCP Stateful that records how long the wrapped ``state_dict()`` took (loading is not used)."""

    def __init__(self, state_dict: Any) -> None:
        self._state_dict = state_dict
        self.state_dict_s = 0.0

    def state_dict(self) -> dict[str, Any]:
        """The wrapped ``state_dict()``, timed."""
        t0 = time.perf_counter()
        out = self._state_dict()
        self.state_dict_s = time.perf_counter() - t0
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # pragma: no cover - never loaded
        raise NotImplementedError


class CopyFloor:
    """The optimizer's tensor state grouped by dtype and shape, and per group a preallocated host
    buffer ``(n, *shape)`` (written once, so its pages are mapped before the first timed copy)."""

    def __init__(self, optimizer: Any) -> None:
        import torch

        groups: dict[tuple[Any, tuple[int, ...]], list[Any]] = {}
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    groups.setdefault((v.dtype, tuple(v.shape)), []).append(v.detach())
        self.groups = list(groups.values())
        self.dst = [torch.zeros((len(g), *g[0].shape), dtype=g[0].dtype, device="cpu") for g in self.groups]
        self.copy()

    def copy(self) -> float:
        """Seconds to copy every state tensor once into the buffers (one ``torch.stack`` per group)."""
        import torch

        t0 = time.perf_counter()
        for group, dst in zip(self.groups, self.dst):
            torch.stack(group, out=dst)
        return time.perf_counter() - t0


def one_rank_group(root: str) -> bool:
    """Start a one-rank Gloo group in this process unless one exists; ``True`` if started here."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(root, 'store')}", rank=0, world_size=1)
    return True


class TimedSparse(Timed):
    """:class:`Timed` over one ``SparseOptimizerState`` (its ``host_pool`` kept from save to save)."""

    def __init__(self, state: Any) -> None:
        super().__init__(state.state_dict)
        self.state = state


def variant(fx: Any, name: str) -> Timed:
    """The Stateful ``async_save`` gets for variant ``name``."""
    if name == STOCK:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return Timed(lambda: get_optimizer_state_dict(fx.model, fx.optimizer))
    return TimedSparse(sc.SparseOptimizerState(fx.model, fx.optimizer, state_layout=name))


def allocated(stateful: Timed) -> int:
    """Host buffers the Stateful's staging pool allocated so far (0 for the stock variant)."""
    return stateful.state.host_pool.allocated if isinstance(stateful, TimedSparse) else 0


def async_rows(
    fx: Any, names: Sequence[str], repeats: int, root: str, floor: list[float] | None = None
) -> list[dict[str, Any]]:
    """Per variant: blocked, ``state_dict()`` and total seconds (samples and medians), bytes on disk.
    ``floor``: the :class:`CopyFloor` samples are appended to it, taken in the rotation with the saves,
    and each row gets ``vs_floor`` (its ``blocked_s`` over their median)."""
    import torch.distributed.checkpoint as dcp

    samples: dict[str, dict[str, list[float]]] = {
        n: {"blocked_s": [], "state_dict_s": [], "total_s": []} for n in names
    }
    allocs: dict[str, list[int]] = {n: [] for n in names}
    disk: dict[str, int] = {}
    statefuls = {n: variant(fx, n) for n in names}
    for name, stateful in statefuls.items():  # warm-up: a run that has saved before
        if isinstance(stateful, TimedSparse):
            dcp.async_save({LEAF: stateful}, checkpoint_id=os.path.join(root, f"{name}_warm")).result()
            shutil.rmtree(os.path.join(root, f"{name}_warm"), ignore_errors=True)
    settle()
    copier = CopyFloor(fx.optimizer) if floor is not None else None
    for i in range(repeats):
        for name in rotated([*names, FLOOR] if copier is not None else names, i):
            if name == FLOOR:
                floor.append(copier.copy())  # type: ignore[union-attr]
                settle()
                continue
            path = os.path.join(root, f"{name}{i}")
            stateful = statefuls[name]
            before = allocated(stateful)
            t0 = time.perf_counter()
            future = dcp.async_save({LEAF: stateful}, checkpoint_id=path)
            blocked = time.perf_counter() - t0
            allocs[name].append(allocated(stateful) - before)
            future.result()
            total = time.perf_counter() - t0
            del future  # (freed here, untimed: assigning the next sample's future would free this one, and
            # with it this save's plan and metadata, inside the next sample's blocked time)
            for key, value in (("blocked_s", blocked), ("state_dict_s", stateful.state_dict_s), ("total_s", total)):
                samples[name][key].append(value)
            disk[name] = disk_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            settle()
    rows = []
    for name in names:
        s = samples[name]
        rows.append(
            {
                "variant": name,
                **{k: statistics.median(v) for k, v in s.items()},
                "disk_bytes": disk[name],
                "staging_allocs": allocs[name],
                "samples_s": s,
            }
        )
    stock = next((r for r in rows if r["variant"] == STOCK), None)
    for r in rows:
        if stock is not None:
            r["vs_stock"] = [r["blocked_s"] / stock["blocked_s"], r["total_s"] / stock["total_s"]]
        if floor:
            r["vs_floor"] = r["blocked_s"] / statistics.median(floor)
    return rows


def run_async(
    specs: Sequence[FixtureSpec], group_layout: str, repeats: int, layouts: Sequence[str] = STATE_LAYOUTS
) -> list[dict[str, Any]]:
    """Mode ``async``: :func:`async_rows` of every fixture (in a one-rank Gloo group), printed as they come."""
    import torch.distributed as dist

    out = []
    root = tempfile.mkdtemp(prefix="sc_async_")
    started = one_rank_group(root)
    try:
        for spec in specs:
            fx = FixtureCache(hidden=spec.hidden, embed=spec.embed).get(spec.scale, group_layout)
            info = {**fx.info, "state_bytes": state_bytes(fx.optimizer)}
            floor: list[float] = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows = async_rows(fx, [*layouts, STOCK], repeats, root, floor)
            floor_s = statistics.median(floor)
            print(f"{spec.label:<20} {FLOOR:<11} {floor_s:>7.3f} s (the state's bytes copied once)", flush=True)
            for r in rows:
                vs = r.get("vs_stock")
                print(
                    f"{spec.label:<20} {r['variant']:<11} blocked {r['blocked_s']:>7.3f} s (state_dict "
                    f"{r['state_dict_s']:.3f} s, x floor {r['vs_floor']:.2f}, new buffers {max(r['staging_allocs'])})  "
                    f"total {r['total_s']:>7.3f} s  "
                    f"{r['disk_bytes'] / 2**20:>7.1f} MiB" + (f"  x stock {vs[0]:.2f}/{vs[1]:.2f}" if vs else ""),
                    flush=True,
                )
            out.append(
                {
                    "fixture": spec.label,
                    "info": info,
                    "copy_floor_s": floor_s,
                    "copy_floor_samples_s": floor,
                    "rows": rows,
                }
            )
            del fx
    finally:
        if started:
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return out


def run_async_threshold(sizes: Sequence[int], total: int, max_params: int, repeats: int) -> dict[str, Any]:
    """Mode ``threshold --async``: per chunk size, the time ``dcp.async_save`` blocks with one item per
    state tensor (``per_tensor``) and with the tensors bucketed (``buffers``), and where one item per
    tensor blocks no longer (the crossover ``state_layout="auto"`` uses inside ``async_save``)."""
    import torch.distributed as dist

    from ..suite.fixtures import uniform_fixture
    from .scale_dcp import from_size_on, size_label, threshold_counts

    points = []
    root = tempfile.mkdtemp(prefix="sc_async_threshold_")
    started = one_rank_group(root)
    try:
        for size, n in threshold_counts(sizes, total, max_params):
            fx = uniform_fixture(n, (size // 4,))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows = async_rows(fx, ["per_tensor", "buffers"], repeats, root)
            by = {r["variant"]: r for r in rows}
            ratio = by["per_tensor"]["blocked_s"] / by["buffers"]["blocked_s"]
            points.append(
                {"chunk_bytes": size, "n_params": n, "n_state_tensors": 2 * n, "rows": rows, "blocked_ratio": ratio}
            )
            print(
                f"chunk {size_label(size):>7} x {2 * n:>6} tensors  async_save blocked: per_tensor "
                f"{by['per_tensor']['blocked_s']:.3f} s  buffers {by['buffers']['blocked_s']:.3f} s  "
                f"per_tensor/buffers {ratio:.2f}",
                flush=True,
            )
            del fx
    finally:
        if started:
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    cross = from_size_on(sorted((p["chunk_bytes"], p["blocked_ratio"] <= 1) for p in points))
    print(
        "crossover (one item per tensor blocks no longer than buffers from this size on): "
        + (size_label(cross) if cross else "none in the sweep")
    )
    return {"points": points, "crossover_blocked_bytes": cross, "async": True}
