"""What a resharding load of a ``state_layout="buffers"`` checkpoint reads per rank, with and without
the layout index: layout tables and their bytes, for one rank of a load of a ``--saved``-rank
checkpoint into ``--load`` ranks.

The saved ranks' layout tables are synthetic, built with the core's ``encode_layout`` from the
bench's MoE fixture (no process is started): its single-process layout gives each state tensor's
FQN, key, dtype and local shape, and every saved rank gets a table of its own chunks.

* ``fsdp``: every state tensor sharded ``Shard(0)`` over all saved ranks, one chunk each (as
  ``bench.scale``'s metadata mode plans it: global rows = ranks x local rows);
* ``ep``: the dense parameters so, the experts expert-parallel: each expert held whole by one rank
  (round-robin over the global expert number, at save and at load).

The index is what a coordinated save writes (`sparse_ckpt._format.layout_index.build_index` from
each rank's part); the tables a loading rank reads with it are what ``LayoutIndex.tags_for`` picks
for its chunks, plus the index itself. Without an index a rank reads every table of the leaf.

    python -m bench.layout_index --scale 61x256 --saved 1024 --load 512 --mode fsdp,ep
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

try:  # a checkout (python -m bench.layout_index) or the wheel
    from .. import provenance
    from ..suite.fixtures import FixtureCache, parse_scales
except ImportError:  # pragma: no cover - run as a script
    import provenance  # type: ignore[no-redef]
    from fixtures import FixtureCache, parse_scales  # type: ignore[no-redef]

import sparse_ckpt as sc
from sparse_ckpt import _backend
from sparse_ckpt._format.bucket_checksums import split_checksums
from sparse_ckpt._format.keys import BUFFERS_PREFIX, rank_tag, seal
from sparse_ckpt._format.layout_index import build_index, decode_index
from sparse_ckpt._layouts.bucketed import BUCKET_BYTES

LEAF = "optim"
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _entries(scale: Any) -> tuple[list[tuple[str, str, str, int, tuple[int, ...]]], int]:
    """``[(fqn, key, dtype, itemsize, local shape)]`` of the fixture's buffered state, and its experts per layer."""
    fx = FixtureCache(hidden=0, no_state_fraction=0.5).get(scale, "layer")
    sd = sc.sparse_state_dict(fx.model, fx.optimizer, state_layout="buffers")
    (layout,) = [v for k, v in sd.items() if k.startswith(BUFFERS_PREFIX) and ".L" in k]
    out = []
    table, _crcs = split_checksums(LEAF, "layout", layout[:-8])  # (the seal, then the bucket checksums off)
    for dtype, numel, entries in _backend.core.decode_layout(LEAF, table):
        itemsize = 4 if dtype == "float32" else 8 if dtype in ("float64", "int64") else 2
        del numel
        out.extend((fqn, key, dtype, itemsize, sizes) for fqn, key, _shape, _offsets, sizes in entries)
    return out, scale.experts


def _expert_of(fqn: str, experts: int) -> int | None:
    m = _EXPERT.match(fqn)
    return None if m is None else int(m.group(1)) * experts + int(m.group(2))


def _sharded(local: tuple[int, ...], world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    rows = local[0] if local else 1
    shape = (world * rows, *local[1:]) if local else (world,)
    return shape, (rank * rows, *(0 for _ in shape[1:])), (rows, *shape[1:])


def _rank_entries(entries: list[Any], experts: int, mode: str, world: int, rank: int) -> list[tuple[Any, ...]]:
    out = []
    for fqn, key, dtype, itemsize, local in entries:
        g = _expert_of(fqn, experts) if mode == "ep" else None
        if g is None:
            out.append((fqn, key, dtype, itemsize, *_sharded(local, world, rank)))
        elif g % world == rank:
            out.append((fqn, key, dtype, itemsize, local, (0,) * len(local), local))
    return out


def _parts(entries: list[Any], experts: int, mode: str, world: int) -> list[Any]:
    """Each saved rank's part of the index, as `sparse_ckpt._layouts.bucketed_index` makes it: one
    description per global shape (``Shard(0)`` over a 1-D mesh of every rank; the same object on
    every rank, as the save's exchange gives equal pieces), the experts whole."""
    specs: dict[Any, set[str]] = {}
    whole: dict[int, set[str]] = {}
    ranks = tuple(range(world))
    for fqn, _key, _dtype, _itemsize, local in entries:
        g = _expert_of(fqn, experts) if mode == "ep" else None
        if g is None:
            specs.setdefault((_sharded(local, world, 0)[0], (world,), ranks, (0,)), set()).add(fqn)
        else:
            whole.setdefault(g % world, set()).add(fqn)
    described = tuple((s, tuple(sorted(f))) for s, f in specs.items())
    none: tuple[str, ...] = ()
    return [(described, tuple(sorted(whole.get(r, ()))), none) for r in range(world)]


def measure(scale: Any, modes: list[str], saved: int, load: int, ranks: list[int]) -> list[dict[str, Any]]:
    """Tables and bytes each loading rank of ``ranks`` (of ``load``) reads of a ``saved``-rank checkpoint."""
    core = _backend.core
    entries, experts = _entries(scale)
    rows = []
    for mode in modes:
        t0 = time.perf_counter()
        index = seal(
            build_index(LEAF, [(rank_tag(saved, [s]), p) for s, p in enumerate(_parts(entries, experts, mode, saved))])
        )
        build_s = time.perf_counter() - t0
        table_bytes = []
        for s in range(saved):  # every saved rank's table, encoded and measured, then dropped
            table, _buckets = core.encode_layout(LEAF, _rank_entries(entries, experts, mode, saved, s), BUCKET_BYTES)
            table_bytes.append(len(seal(table)))
        for rank in ranks:
            t0 = time.perf_counter()
            decoded = decode_index(LEAF, "index", index[:-8])
            tags = decoded.tags_for(_needs(entries, experts, mode, saved, load, rank))
            select_s = time.perf_counter() - t0
            chosen = sorted(int(t.partition("r")[2]) for t in tags)
            rows.append(
                {
                    "scale": scale.label,
                    "mode": mode,
                    "saved": saved,
                    "load": load,
                    "rank": rank,
                    "state_tensors": len(entries),
                    "without_index": {"tables": saved, "bytes": sum(table_bytes)},
                    "with_index": {
                        "tables": len(chosen),
                        "saved_ranks": chosen,
                        "index_bytes": len(index),
                        "bytes": len(index) + sum(table_bytes[s] for s in chosen),
                    },
                    "index_build_s": build_s,
                    "index_decode_and_select_s": select_s,
                }
            )
    return rows


def _needs(entries: list[Any], experts: int, mode: str, saved: int, load: int, rank: int) -> list[Any]:
    """``(fqn, (global shape, offsets, sizes))`` of the chunks loading rank ``rank`` of ``load`` holds."""
    needs = []
    for fqn, _key, _dtype, _itemsize, local in entries:
        g = _expert_of(fqn, experts) if mode == "ep" else None
        if g is None:
            shape = _sharded(local, saved, 0)[0]
            step = -(-shape[0] // load)
            lo = min(step * rank, shape[0])
            needs.append((fqn, (shape, (lo, *(0 for _ in shape[1:])), (min(shape[0], lo + step) - lo, *shape[1:]))))
        elif g % load == rank:
            needs.append((fqn, (local, (0,) * len(local), local)))
    return needs


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="8x64")
    p.add_argument("--mode", default="fsdp,ep")
    p.add_argument("--saved", type=int, default=1024)
    p.add_argument("--load", type=int, default=512)
    p.add_argument("--ranks", type=_ints, default=[0], help="loading ranks to measure")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    (scale,) = parse_scales(args.scale)
    rows = measure(scale, args.mode.split(","), args.saved, args.load, args.ranks)
    for row in rows:
        w, i = row["without_index"], row["with_index"]
        print(
            f"{row['scale']} {row['mode']:<4} {args.saved} -> {args.load} ranks, rank {row['rank']}: without index "
            f"{w['tables']} tables, {w['bytes']:,} bytes; with index {i['tables']} tables (saved ranks "
            f"{i['saved_ranks']}) + index of {i['index_bytes']:,} bytes = {i['bytes']:,} bytes "
            f"(index built in {row['index_build_s']:.2f} s, decoded and selected in "
            f"{row['index_decode_and_select_s']:.3f} s)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "provenance": provenance.record()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
