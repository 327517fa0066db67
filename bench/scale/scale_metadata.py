"""``bench.scale`` mode ``metadata``: the ``.metadata`` DCP's coordinator would write for an FSDP2 job
of N ranks saving a fixture's optimizer through ``SparseOptimizerState``, in every state layout of
``sparse_ckpt._layouts.STATE_LAYOUTS`` -- no processes (see ``bench/scale/scale.py`` and bench/README.md).

Each rank's local plan is the library's own one-rank ``sparse_state_dict`` of the fixture in that
layout, taken as the rank's local shard: its per-item state tensors are planned as chunks of tensors
sharded over the N ranks (``Shard(0)``, one chunk per rank), its layout table and buffers as the rank's
own items (rank tag ``w{N}r{rank}``), tables and guards as replicated items DCP keeps once. A layout
that decides per tensor from the local chunk's size (``auto``) therefore plans on every rank exactly
what the library decided for that chunk (the decision is uniform across ranks: every rank's chunk of a
tensor has the same size here).
"""

from __future__ import annotations

import gc
import math
import pickle
import statistics
import time
from typing import Any

import torch

import sparse_ckpt as sc
from sparse_ckpt._format.keys import BUFFERS_PREFIX, is_state_item
from sparse_ckpt._layouts import STATE_LAYOUTS

from ..suite.fixtures import FixtureCache, FixtureSpec, gc_paused

LEAF = "optim"


def _write_item(fqn: str, value: Any, rank: int, world: int, sharded: bool) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    if not isinstance(value, torch.Tensor):
        return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
    shape = tuple(value.shape)
    if sharded:  # FSDP2 Shard(0) over the world: global dim 0 = world x rows, one chunk per rank
        rows = shape[0] if shape else 1
        global_shape = (world * rows, *shape[1:])
        offsets = (rank * rows, *(0 for _ in shape[1:]))
        sizes = (rows, *shape[1:])
    else:
        global_shape, offsets, sizes = shape, tuple(0 for _ in shape), shape
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD if sharded else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=value.dtype),
            size=torch.Size(global_shape),
        ),
    )


def local_plans(sd: dict[str, Any], world: int, layout: str, sample: int) -> list[Any]:
    """Every rank's local plan for ``{"optim": sd}``: per-item state tensors sharded (one chunk per
    rank; every ``sample``-th of them), tables and the planner guard replicated (DCP keeps one);
    buffers layout: each rank's own layout table and buffers (keyed by its rank)."""
    from torch.distributed.checkpoint.planner import SavePlan

    plans = []
    state_items = [k for k in sd if is_state_item(k)]
    skip = set(state_items) - set(state_items[::sample])
    for rank in range(world):
        items, mapping = [], {}
        for key, value in sd.items():
            if key in skip:
                continue
            if key.startswith(BUFFERS_PREFIX):
                key = key.replace("w1r0", f"w{world}r{rank}")  # every rank its own (sharded) layout
            fqn = f"{LEAF}.{key}"
            mapping[fqn] = (LEAF, key)
            items.append(_write_item(fqn, value, rank, world, sharded=is_state_item(key)))
        plans.append(SavePlan(items, planner_data=mapping))
    return plans


def build_metadata(plans: list[Any]) -> Any:
    """The ``.metadata`` DCP writes for ``plans``: the coordinator's global plan and metadata, and
    the storage records of ``FileSystemWriter.finish`` (each rank's file, offsets in write order)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    planner = DefaultSavePlanner()
    final, metadata = planner.create_global_plan(plans)
    storage: dict[Any, Any] = {}
    for rank, plan in enumerate(final):
        offset = 0
        for item in plan.items:
            nbytes = 0
            if item.tensor_data is not None:
                nbytes = math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
            length = nbytes + 1_100  # torch.save's zip framing of one item, about
            storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", offset, length)
            offset += length
    metadata.storage_data = storage
    return metadata


def count_records(metadata: Any) -> dict[str, int]:
    chunks = sum(len(getattr(md, "chunks", ())) or 1 for md in metadata.state_dict_metadata.values())
    return {
        "items": len(metadata.state_dict_metadata),
        "chunk_records": chunks,
        "storage_records": len(metadata.storage_data),
    }


def time_pickle(metadata: Any, repeats: int) -> dict[str, float]:
    """Pickled bytes and median (un)pickle seconds, the cyclic collector paused while timed (as the main
    bench's timed regions: its passes over the fixture's millions of objects are not the cost measured)."""
    dumps, loads, blob = [], [], b""
    for _ in range(repeats):
        gc.collect()
        with gc_paused():
            t0 = time.perf_counter()
            blob = pickle.dumps(metadata)
            dumps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pickle.loads(blob)
            loads.append(time.perf_counter() - t0)
    return {"bytes": len(blob), "pickle_s": statistics.median(dumps), "unpickle_s": statistics.median(loads)}


def metadata_row(sd: dict[str, Any], world: int, layout: str, sample: int, repeats: int) -> dict[str, Any]:
    """Records, pickled bytes and (un)pickle seconds of the ``.metadata`` of ``world`` ranks saving ``sd``;
    ``sample > 1`` plans every ``sample``-th per-item state tensor and scales up (only for dicts whose
    records are per-item state: the other items are not sampled)."""
    if sample > 1 and any(k.startswith(BUFFERS_PREFIX) for k in sd):
        raise ValueError(f"{layout}: a dict with buffers is planned in full (raise --max-records)")
    plans = local_plans(sd, world, layout, sample)
    md = build_metadata(plans)
    del plans
    row: dict[str, Any] = {
        "ranks": world,
        "layout": layout,
        "sample": sample,
        **count_records(md),
        **time_pickle(md, repeats),
    }
    if sample > 1:  # linear in the tensors planned: scale up (the state items dominate every figure)
        row["measured"] = {
            k: row[k] for k in ("items", "chunk_records", "storage_records", "bytes", "pickle_s", "unpickle_s")
        }
        for k in ("chunk_records", "storage_records", "bytes", "pickle_s", "unpickle_s"):
            row[k] = row[k] * sample
        state = [k for k in sd if is_state_item(k)]
        row["items"] += len(state) - len(state[::sample])  # exact: the items do not depend on sampling
    return row


AUTO_THRESHOLD_NAMES = ("AUTO_OWN_ITEM_BYTES", "AUTO_ITEM_BYTES")
"""Where ``sparse_ckpt._layouts`` may keep ``auto``'s threshold (the first that exists is recorded)."""


def auto_threshold() -> tuple[str, int] | None:
    """``(name, bytes)`` of the library's ``auto`` threshold constant, if it has one."""
    import sparse_ckpt._layouts as layouts

    for name in AUTO_THRESHOLD_NAMES:
        value = getattr(layouts, name, None)
        if isinstance(value, int):
            return name, value
    return None


def split(sd: dict[str, Any]) -> dict[str, int]:
    """Per-item state tensors, layout tables and buffers of a one-rank dict."""
    buffers = [k for k in sd if k.startswith(BUFFERS_PREFIX)]
    return {
        "per_item_state": sum(1 for k in sd if is_state_item(k)),
        "layout_tables": sum(1 for k in buffers if not isinstance(sd[k], torch.Tensor)),
        "buffers": sum(1 for k in buffers if isinstance(sd[k], torch.Tensor)),
    }


def run_metadata(
    spec: FixtureSpec,
    group_layout: str,
    ranks: list[int],
    max_records: int,
    repeats: int,
    check: list[int],
    check_sample: int,
    layouts: tuple[str, ...] = STATE_LAYOUTS,
) -> dict[str, Any]:
    """Mode ``metadata``: one row per (ranks, layout) with records, bytes, (un)pickle times and the ratios
    to ``per_tensor`` at the same N; ``check``: full vs sampled per-tensor rows."""
    fx = FixtureCache(hidden=spec.hidden, embed=spec.embed, no_state_fraction=0.5).get(spec.scale, group_layout)
    sds = {layout: sc.sparse_state_dict(fx.model, fx.optimizer, state_layout=layout) for layout in layouts}
    splits = {layout: split(sd) for layout, sd in sds.items()}
    rows = []
    for world in ranks:
        for layout, sd in sds.items():
            full = (splits[layout]["per_item_state"] + splits[layout]["buffers"]) * world
            sample = max(1, math.ceil(full / max_records))
            t0 = time.perf_counter()
            row = metadata_row(sd, world, layout, sample, 1 if sample > 1 or full > 200_000 else repeats)
            row["build_s"] = time.perf_counter() - t0
            rows.append(row)
            _print_metadata_row(row)
    add_vs_per_tensor(rows)
    checks = []
    for world in check:
        sd = sds["per_tensor"]
        exact = metadata_row(sd, world, "per_tensor", 1, repeats)
        scaled = metadata_row(sd, world, "per_tensor", check_sample, repeats)
        checks.append({"ranks": world, "full": exact, "scaled": scaled})
        print(
            f"check at {world} ranks: full {exact['bytes']} bytes, pickle {exact['pickle_s']:.3f} s, unpickle "
            f"{exact['unpickle_s']:.3f} s; 1/{check_sample} scaled: {scaled['bytes']} bytes, pickle "
            f"{scaled['pickle_s']:.3f} s, unpickle {scaled['unpickle_s']:.3f} s"
        )
    threshold = auto_threshold()
    return {
        "fixture": spec.label,
        "group_layout": group_layout,
        "n_param_shaped_state": fx.info["n_param_shaped_state"],
        "info": fx.info,
        "split": splits,
        "auto_threshold": threshold,
        "auto_check": auto_check(sds, threshold),
        "rows": rows,
        "checks": checks,
    }


def auto_check(sds: dict[str, dict[str, Any]], threshold: tuple[str, int] | None) -> dict[str, Any] | None:
    """For ``auto``: the smallest per-item and the largest bucketed state tensor (bytes of the local
    chunk, from the ``per_tensor`` dict), and whether the library's split follows the threshold."""
    if "auto" not in sds or "per_tensor" not in sds or threshold is None:
        return None
    own = {k for k in sds["auto"] if is_state_item(k)}
    sizes = {k: v.numel() * v.element_size() for k, v in sds["per_tensor"].items() if is_state_item(k)}
    item_min = min((n for k, n in sizes.items() if k in own), default=None)
    bucket_max = max((n for k, n in sizes.items() if k not in own), default=None)
    ok = (item_min is None or item_min >= threshold[1]) and (bucket_max is None or bucket_max < threshold[1])
    return {"per_item_min_bytes": item_min, "buffered_max_bytes": bucket_max, "follows_threshold": ok}


def add_vs_per_tensor(rows: list[dict[str, Any]]) -> None:
    """``vs_per_tensor``: chunk records and bytes of each row over ``per_tensor``'s at the same N."""
    ref = {r["ranks"]: r for r in rows if r["layout"] == "per_tensor"}
    for r in rows:
        p = ref.get(r["ranks"])
        if p is not None:
            r["vs_per_tensor"] = {
                "chunk_records": r["chunk_records"] / p["chunk_records"],
                "bytes": r["bytes"] / p["bytes"],
                "unpickle_s": r["unpickle_s"] / p["unpickle_s"] if p["unpickle_s"] else None,
            }


def _print_metadata_row(row: dict[str, Any]) -> None:
    note = f" (scaled x{row['sample']})" if row["sample"] > 1 else ""
    print(
        f"{row['ranks']:>5} ranks {row['layout']:<10} items {row['items']:>10,} chunk records "
        f"{row['chunk_records']:>12,} "
        f"storage records {row['storage_records']:>12,} .metadata {row['bytes'] / 2**20:>10.1f} MiB "
        f"pickle {row['pickle_s']:>8.3f} s unpickle {row['unpickle_s']:>8.3f} s{note}",
        flush=True,
    )
