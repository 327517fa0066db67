"""VeOmni's own checkpointer, stock vs with sparse_ckpt installed: DCP items, bytes, save and load time.

``python -m bench.veomni_checkpointer`` (``--nproc 2``, ``--layers``, ``--experts``, ``--dim``,
``--routed`` fraction, ``--repeats``, ``--json PATH``) needs veomni (``pip install --no-deps -r
.ci/requirements-veomni.txt``). Each spawned Gloo rank builds the same MoE: ``layers`` blocks of a
dense ``Linear(dim, dim)`` and ``experts`` expert ``Linear(dim, dim)`` (the first ``routed`` fraction
routed, the others never get a token), and a vision tower that never steps; ``fully_shard`` per
block and at the root on an explicit CPU mesh; VeOmni's ``MultiOptimizer`` (leaves
``non_extra_parallel`` and ``vit``, AdamW) and linear scheduler; two training steps. Then, for
``build_checkpointer("dcp", "fsdp2")`` stock and after ``sparse_ckpt.integrations.veomni.install()``,
``repeats`` times: ``save`` into a new directory and ``load`` into freshly built objects, as VeOmni's
trainer calls them; row ``model``: the stock checkpointer with the model alone (no optimizer), the
part of each time that is not the optimizer's. Times are the slowest rank's, min and median over repeats; items are the
checkpoint's DCP items (all and ``optimizer.*``); bytes are the files on disk (``.distcp`` and
``.metadata``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from .. import provenance
from ..drills.ranks import free_port

KINDS = ("model", "stock", "sparse")
"""``model``: stock VeOmni saving and loading the model alone (the floor both others include)."""


class Block(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(experts))

    def forward(self, x: torch.Tensor, routed: int) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        return x + sum(self.experts[i](h) for i in range(routed)) / routed


class BenchMoE(nn.Module):
    def __init__(self, layers: int, experts: int, dim: int) -> None:
        super().__init__()
        self.tower = nn.Linear(dim, dim)  # never used: its leaf never steps
        self.blocks = nn.ModuleList(Block(dim, experts) for _ in range(layers))

    def forward(self, x: torch.Tensor, routed: int) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, routed)
        return x


def build(args: argparse.Namespace, mesh: Any) -> tuple[BenchMoE, Any, Any]:
    from torch.distributed.fsdp import fully_shard
    from veomni.optim import build_lr_scheduler
    from veomni.optim.optimizer import MultiOptimizer

    torch.manual_seed(0)
    model = BenchMoE(args.layers, args.experts, args.dim)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = {
        "non_extra_parallel": torch.optim.AdamW(model.blocks.parameters(), lr=0.01),
        "vit": torch.optim.AdamW(model.tower.parameters(), lr=0.01),
    }
    mo = MultiOptimizer(model, optimizers, key_names=list(optimizers))
    return model, mo, build_lr_scheduler(mo, train_steps=10, lr=0.01, lr_decay_style="linear")


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def on_disk(path: Path) -> tuple[int, int, int]:
    """(DCP items, of which ``optimizer.*``, bytes of the DCP files)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return len(keys), sum(1 for k in keys if k.startswith("optimizer.")), size


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
    try:
        _measure(rank, world_size, args, Path(root))
    finally:
        dist.destroy_process_group()


def with_optimizer(kind: str, state: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """VeOmni's checkpoint state: ``state`` plus the optimizer, except in the model-only row."""
    return state if kind == "model" else {**state, "optimizer": optimizer}


def _measure(rank: int, world_size: int, args: argparse.Namespace, root: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from veomni.checkpoint import build_checkpointer
    from veomni.distributed.parallel_state import init_parallel_state

    import sparse_ckpt.integrations.veomni as sc_veomni

    if not hasattr(torch.cpu, "empty_cache"):  # VeOmni calls it after a save; a no-op on CPU
        torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    init_parallel_state(dp_size=world_size, dp_mode="fsdp2", device_type="cpu")
    mesh = init_device_mesh("cpu", (world_size,))
    model, mo, scheduler = build(args, mesh)
    routed = max(1, round(args.routed * args.experts))
    for i in range(2):
        x = torch.randn(8, args.dim, generator=torch.Generator().manual_seed(i))
        model(x, routed).pow(2).mean().backward()
        mo.step()
        scheduler.step()
        mo.zero_grad()
    results: dict[str, Any] = {}
    for kind in KINDS:
        if kind == "sparse":
            sc_veomni.install()
        checkpointer = build_checkpointer("dcp", "fsdp2")
        saves, loads = [], []
        for r in range(args.repeats):
            path = root / kind / f"r{r}"
            state = with_optimizer(kind, {"model": model, "extra_state": {"global_step": 2}}, mo)
            dist.barrier()
            t0 = time.perf_counter()
            checkpointer.save(str(path), state)
            saves.append(slowest(time.perf_counter() - t0))
            model2, mo2, _s = build(args, mesh)
            target = with_optimizer(kind, {"model": model2, "extra_state": {}}, mo2)
            dist.barrier()
            t0 = time.perf_counter()
            checkpointer.load(str(path), target)
            loads.append(slowest(time.perf_counter() - t0))
        items, opt_items, size = on_disk(root / kind / "r0")
        results[kind] = {
            "items": items,
            "optimizer_items": opt_items,
            "bytes": size,
            "save_s": {"min": min(saves), "median": statistics.median(saves)},
            "load_s": {"min": min(loads), "median": statistics.median(loads)},
        }
    sc_veomni.uninstall()
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        config = {k: v for k, v in vars(args).items() if k != "json"}
        results["config"] = {**config, "routed_experts": routed, "params": n_params}
        (root / "results.json").write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--routed", type=float, default=0.75, help="fraction of experts that get tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(
            worker, args=(args.nproc, free_port(), args, root), nprocs=args.nproc, start_method="spawn", join=True
        )
        results = json.loads((Path(root) / "results.json").read_text())
    cfg = results["config"]
    print(
        f"VeOmni checkpointer, {args.nproc} ranks, {cfg['layers']} layers x {cfg['experts']} experts "
        f"({cfg['routed_experts']} routed), dim {cfg['dim']}, {cfg['params']} params; "
        f"times: slowest rank, min / median of {args.repeats}"
    )
    print(f"{'':8} {'items':>6} {'optim':>6} {'bytes':>10} {'save s':>15} {'load s':>15}")
    for kind in KINDS:
        r = results[kind]
        print(
            f"{kind:8} {r['items']:6d} {r['optimizer_items']:6d} {r['bytes']:10d} "
            f"{r['save_s']['min']:7.3f}/{r['save_s']['median']:7.3f} "
            f"{r['load_s']['min']:7.3f}/{r['load_s']['median']:7.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps({**results, "provenance": provenance.record()}, indent=1))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
