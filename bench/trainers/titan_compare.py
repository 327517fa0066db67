"""torchtitan's stock ``CheckpointManager`` vs sparse_ckpt's ``SparseCheckpointManager`` on one model.

``python -m bench.titan_compare`` (needs torchtitan: ``pip install --no-deps -r
.ci/requirements-torchtitan.txt``) builds the MoE of :mod:`bench.titan_scenario` at
``--layers`` x ``--experts`` (``Linear(dim, dim)`` experts with bias, a router per layer, ``aux``),
trains two steps, saves at step 2 with each manager (built by ``Config.build``, as torchtitan's
trainer does) and loads into fresh objects, in one process (a 1-rank Gloo group). Two scenarios:

* ``moe``: only ``--routed`` of the experts got tokens before the save and the ``aux`` optimizer never
  stepped. The stock save runs torchtitan's synthetic step (state for ``aux``, in the live optimizer
  too); the stock load of its own checkpoint fails (``Missing key``), so the stock load is timed
  with ``allow_partial_load=True`` (which invents state for the unrouted experts);
* ``dense``: every expert routed and ``aux`` used, so the stock manager loads its own checkpoint.

Reported per manager: DCP items (all, and the optimizer's), bytes on disk, save and load time
(median of ``--repeat`` runs, each in a fresh folder), and parameters with state after the load.
Writes JSON to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torchtitan.components.checkpoint import CheckpointManager

from sparse_ckpt.integrations.torchtitan import SparseCheckpointManager

from .. import provenance
from . import titan_scenario as tt

MANAGERS = {
    "stock": (CheckpointManager.Config, tt.PartialLoadManager.Config),
    "sparse": (SparseCheckpointManager.Config, SparseCheckpointManager.Config),
}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _one(kind: str, scenario: str, shape: dict[str, int], routed: tuple[int, ...], base: Path) -> dict[str, Any]:
    save_cfg, load_cfg = MANAGERS[kind]
    use_aux = scenario == "dense"
    objs = tt.build(0, **shape)
    tt.train(*objs, range(1, 3), routed, use_aux=use_aux)
    mgr = tt.manager(save_cfg, str(base), *objs, tt.TrainState(2))
    t0 = time.perf_counter()
    mgr.save(2)
    save_s = time.perf_counter() - t0
    mgr.close()
    ckpt = base / "checkpoint" / "step-2"
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    fresh = tt.build(1, **shape)
    stock_own = kind == "stock" and scenario == "dense"
    mgr2 = tt.manager(CheckpointManager.Config if stock_own else load_cfg, str(base), *fresh, tt.TrainState())
    t0 = time.perf_counter()
    assert mgr2.load() is True
    load_s = time.perf_counter() - t0
    mgr2.close()
    return {
        "items": len(keys),
        "optimizer_items": sum(k.startswith("optimizer.") for k in keys),
        "bytes": _dir_bytes(ckpt),
        "save_s": save_s,
        "load_s": load_s,
        "params_with_state_saved": sum(len(o.state) for o in objs[1].optimizers),
        "params_with_state_loaded": sum(len(o.state) for o in fresh[1].optimizers),
        "loader": "stock" if stock_own else ("stock, allow_partial_load=True" if kind == "stock" else "sparse"),
    }


def run(layers: int, experts: int, dim: int, routed_fraction: float, repeat: int) -> dict[str, Any]:
    """Every manager on both scenarios; medians of ``repeat`` runs."""
    shape = {"layers": layers, "experts": experts, "dim": dim}
    params = sum(p.numel() for p in tt.TitanMoE(**shape).parameters())
    tensors = len(list(tt.TitanMoE(**shape).parameters()))
    out: dict[str, Any] = {
        "shape": {**shape, "parameters": tensors, "numel": params, "routed_fraction": routed_fraction},
        "results": {},
    }
    for scenario in ("moe", "dense"):
        routed = tt.routed_experts(experts, routed_fraction if scenario == "moe" else 1.0)
        for kind in MANAGERS:
            runs = []
            for _ in range(repeat):
                with tempfile.TemporaryDirectory() as tmp:
                    runs.append(_one(kind, scenario, shape, routed, Path(tmp)))
            row = dict(runs[-1])
            row["save_s"] = statistics.median(r["save_s"] for r in runs)
            row["load_s"] = statistics.median(r["load_s"] for r in runs)
            out["results"][f"{scenario}/{kind}"] = row
            print(
                f"{scenario:5s} {kind:6s} items {row['items']:6d} (optimizer {row['optimizer_items']:6d})  "
                f"bytes {row['bytes']:10d}  save {row['save_s']:7.3f} s  load {row['load_s']:7.3f} s  "
                f"state {row['params_with_state_saved']} -> {row['params_with_state_loaded']}  [{row['loader']}]",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--routed", type=float, default=0.5, help="fraction of experts routed before the save (moe)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # torchtitan logs every save and load
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        try:
            result = run(args.layers, args.experts, args.dim, args.routed, args.repeat)
        finally:
            dist.destroy_process_group()
    result["torch"] = torch.__version__
    result["provenance"] = provenance.record()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
