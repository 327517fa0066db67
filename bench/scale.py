"""Scale figures (issue 23): DCP's ``.metadata`` at N ranks, and ``dcp.save``/``dcp.load`` of the
whole optimizer in both state layouts against the raw-bytes floor.

``metadata`` mode builds the ``.metadata`` that DCP's coordinator would write for an FSDP2 job of
N ranks saving the bench's synthetic MoE optimizer with ``SparseOptimizerState`` -- from
synthetic local save plans (the write items each rank's ``DefaultSavePlanner`` would plan, every
parameter-shaped state tensor sharded over all N ranks, one chunk each), planned by DCP's own
``DefaultSavePlanner.create_global_plan`` (de-duplication, global plan, metadata), with the
storage records ``FileSystemWriter.finish`` adds -- and reports its records, its pickled bytes and
the time to pickle and unpickle it (what the coordinator pays once and every rank pays on load),
for ``state_layout="per_tensor"`` and ``"buffers"``. No process is started. Where the
per-tensor metadata of the full optimizer would exceed ``--max-records``, every k-th state tensor
is planned and records, bytes and times are multiplied by k (all three are linear in the number
of tensors; the output marks such rows ``scaled x k``, and ``--check`` compares a scaled row with
a full one at the same N).

``dcp`` mode times, in one process, ``dcp.save``/``dcp.load`` of the whole optimizer
(``SparseOptimizerState`` + ``SparseLoadPlanner``) in both layouts, and the floor: ``torch.save``
/ ``torch.load(weights_only=True)`` of the same state as one tensor per dtype (concatenated
beforehand, untimed).

    python -m bench.scale metadata --scale 61x256 --ranks 8,16,32,64,128,256,512,1024
    python -m bench.scale dcp --scale 24x128 --hidden 0,64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:  # a checkout (python -m bench.scale) or the wheel (python -m sparse_ckpt.bench.scale)
    from .fixtures import ADAMW_KWARGS, FixtureCache, build_adamw, parse_scales
except ImportError:  # pragma: no cover - run as a script
    from fixtures import ADAMW_KWARGS, FixtureCache, build_adamw, parse_scales  # type: ignore[no-redef]

import sparse_ckpt as sc
from sparse_ckpt._format.keys import BUFFERS_PREFIX, is_state_item

LEAF = "optim"


# --------------------------------------------------------------------------- metadata


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
    return {"items": len(metadata.state_dict_metadata), "chunk_records": chunks, "storage_records": len(metadata.storage_data)}


def time_pickle(metadata: Any, repeats: int) -> dict[str, float]:
    dumps, loads, blob = [], [], b""
    for _ in range(repeats):
        t0 = time.perf_counter()
        blob = pickle.dumps(metadata)
        dumps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pickle.loads(blob)
        loads.append(time.perf_counter() - t0)
    return {"bytes": len(blob), "pickle_s": statistics.median(dumps), "unpickle_s": statistics.median(loads)}


def metadata_row(sd: dict[str, Any], world: int, layout: str, sample: int, repeats: int) -> dict[str, Any]:
    plans = local_plans(sd, world, layout, sample)
    md = build_metadata(plans)
    del plans
    row: dict[str, Any] = {"ranks": world, "layout": layout, "sample": sample, **count_records(md),
                           **time_pickle(md, repeats)}
    if sample > 1:  # linear in the tensors planned: scale up (the state items dominate every figure)
        row["measured"] = {k: row[k] for k in ("items", "chunk_records", "storage_records", "bytes", "pickle_s", "unpickle_s")}
        for k in ("chunk_records", "storage_records", "bytes", "pickle_s", "unpickle_s"):
            row[k] = row[k] * sample
        state = [k for k in sd if is_state_item(k)]
        row["items"] += len(state) - len(state[::sample])  # exact: the items do not depend on sampling
    return row


def run_metadata(args: argparse.Namespace) -> dict[str, Any]:
    (scale,) = parse_scales(args.scale)
    fx = FixtureCache(hidden=0, no_state_fraction=0.5).get(scale, args.layout)
    sds = {layout: sc.sparse_state_dict(fx.model, fx.optimizer, state_layout=layout) for layout in ("per_tensor", "buffers")}
    n_state = sum(1 for k in sds["per_tensor"] if is_state_item(k))
    rows = []
    for world in args.ranks:
        for layout, sd in sds.items():
            full = n_state * world if layout == "per_tensor" else 4 * world
            sample = max(1, math.ceil(full / args.max_records))
            t0 = time.perf_counter()
            row = metadata_row(sd, world, layout, sample, 1 if sample > 1 or full > 200_000 else args.repeats)
            row["build_s"] = time.perf_counter() - t0
            rows.append(row)
            _print_metadata_row(row)
    checks = []
    for world in args.check:
        sd = sds["per_tensor"]
        exact = metadata_row(sd, world, "per_tensor", 1, args.repeats)
        scaled = metadata_row(sd, world, "per_tensor", args.check_sample, args.repeats)
        checks.append({"ranks": world, "full": exact, "scaled": scaled})
        print(f"check at {world} ranks: full {exact['bytes']} bytes, pickle {exact['pickle_s']:.3f} s, unpickle "
              f"{exact['unpickle_s']:.3f} s; 1/{args.check_sample} scaled: {scaled['bytes']} bytes, pickle "
              f"{scaled['pickle_s']:.3f} s, unpickle {scaled['unpickle_s']:.3f} s")
    return {"mode": "metadata", "scale": scale.label, "layout": args.layout, "n_param_shaped_state": n_state,
            "fixture": fx.info, "rows": rows, "checks": checks}


def _print_metadata_row(row: dict[str, Any]) -> None:
    note = f" (scaled x{row['sample']})" if row["sample"] > 1 else ""
    print(f"{row['ranks']:>5} ranks {row['layout']:<10} items {row['items']:>10,} chunk records {row['chunk_records']:>12,} "
          f"storage records {row['storage_records']:>12,} .metadata {row['bytes'] / 2**20:>10.1f} MiB "
          f"pickle {row['pickle_s']:>8.3f} s unpickle {row['unpickle_s']:>8.3f} s{note}", flush=True)


# --------------------------------------------------------------------------- dcp


def _median(fn: Callable[[int], None], repeats: int) -> tuple[float, list[float]]:
    samples = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def _disk(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def dcp_rows(fx: Any, repeats: int, root: str, device: str) -> list[dict[str, Any]]:
    import torch.distributed.checkpoint as dcp

    rows = []
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for layout in ("per_tensor", "buffers"):
        def save(i: int, layout: str = layout) -> None:
            dcp.save({LEAF: sc.SparseOptimizerState(fx.model, fx.optimizer, state_layout=layout)},
                     checkpoint_id=os.path.join(root, f"{layout}{i}"))

        def load(i: int, layout: str = layout) -> None:
            fresh = build_adamw(fx.specs, **ADAMW_KWARGS)
            dcp.load({LEAF: sc.SparseOptimizerState(fx.model, fresh)}, checkpoint_id=os.path.join(root, f"{layout}{i}"),
                     planner=sc.SparseLoadPlanner())
            sync()
            assert len(fresh.state) == len(fx.optimizer.state)

        save_s, save_samples = _median(save, repeats)
        load_s, load_samples = _median(load, repeats)
        items = len(dcp.FileSystemReader(os.path.join(root, f"{layout}0")).read_metadata().state_dict_metadata)
        rows.append({"what": f"dcp/{layout}", "save_s": save_s, "load_s": load_s, "items": items,
                     "disk_bytes": _disk(os.path.join(root, f"{layout}0")), "samples_s": [save_samples, load_samples]})
    flat: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for st in fx.optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                by_dtype.setdefault(v.dtype, []).append(v.reshape(-1))
    for dtype, parts in by_dtype.items():
        flat[str(dtype)] = torch.cat([p.cpu() for p in parts])

    def floor_save(i: int) -> None:
        torch.save(flat, os.path.join(root, f"floor{i}.pt"))

    def floor_load(i: int) -> None:
        torch.load(os.path.join(root, f"floor{i}.pt"), weights_only=True)

    save_s, save_samples = _median(floor_save, repeats)
    load_s, load_samples = _median(floor_load, repeats)
    rows.append({"what": "floor/torch.save", "save_s": save_s, "load_s": load_s, "items": len(flat),
                 "disk_bytes": os.path.getsize(os.path.join(root, "floor0.pt")), "samples_s": [save_samples, load_samples]})
    return rows


def run_dcp(args: argparse.Namespace) -> dict[str, Any]:
    (scale,) = parse_scales(args.scale)
    out = []
    for hidden in args.hidden:
        fx = FixtureCache(hidden=hidden, device=args.device).get(scale, args.layout)
        root = tempfile.mkdtemp(prefix="sc_scale_")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows = dcp_rows(fx, args.repeats, root, args.device)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for row in rows:
            row["hidden"] = hidden
            print(f"{scale.label} {args.layout} hidden {hidden:>3} {row['what']:<18} save {row['save_s']:>8.3f} s  "
                  f"load {row['load_s']:>8.3f} s  items {row['items']:>7,}  {row['disk_bytes'] / 2**20:>8.1f} MiB", flush=True)
        out.append({"hidden": hidden, "fixture": fx.info, "rows": rows})
    return {"mode": "dcp", "scale": scale.label, "layout": args.layout, "device": args.device, "runs": out}


# --------------------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("metadata", help="simulated .metadata of N ranks (no processes)")
    m.add_argument("--scale", default="61x256")
    m.add_argument("--layout", default="layer", choices=("layer", "param"))
    m.add_argument("--ranks", type=_ints, default=_ints("8,16,32,64,128,256,512,1024"))
    m.add_argument("--max-records", type=int, default=1_500_000, help="plan every k-th state tensor above this")
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--check", type=_ints, default=[], help="ranks at which to compare a scaled row with a full one")
    m.add_argument("--check-sample", type=int, default=8)
    d = sub.add_parser("dcp", help="dcp.save/dcp.load of the whole optimizer, both layouts, and the floor")
    d.add_argument("--scale", default="24x128")
    d.add_argument("--layout", default="layer", choices=("layer", "param"))
    d.add_argument("--hidden", type=_ints, default=[0, 64], help="0: tiny (2,) tensors; N: (N, N) weights")
    d.add_argument("--repeats", type=int, default=3)
    d.add_argument("--device", default="cpu")
    for sp in (m, d):
        sp.add_argument("--out", default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    result = run_metadata(args) if args.mode == "metadata" else run_dcp(args)
    result.update({"command": " ".join(["python -m bench.scale", *(argv if argv is not None else sys.argv[1:])]),
                   "torch": torch.__version__, "python": sys.version.split()[0], "backend": sc.backend(),
                   "cpu_count": os.cpu_count(), "total_s": time.perf_counter() - t0})
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
