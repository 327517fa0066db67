"""Accelerate FSDP2 optimizer checkpoints: stock ``save_state``/``load_state`` vs
``sparse_ckpt.integrations.accelerate``.

``python -m bench.accelerate_ckpt [--nproc 2] [--experts 32] [--routed 8] [--dim 64] [--repeats 3]``
(in a wheel: ``python -m sparse_ckpt.bench.accelerate_ckpt``; needs ``accelerate``).

Spawns ``--nproc`` Gloo ranks on CPU, each with an ``Accelerator`` forced to FSDP2 (the recipe of
docs/integrations/hugging-face.md: distributed type set explicitly, CPU mesh), and a model of ``--experts``
expert layers (``Linear(dim, dim)``) of which the first ``--routed`` get tokens, a ``dense`` layer and a
``vision`` layer that never gets a gradient; AdamW with one group per part, LambdaLR. After two
steps it times Accelerate's optimizer save and load (``save_fsdp_optimizer`` /
``load_fsdp_optimizer``, what ``save_state``/``load_state`` call; the model part is the same for
both and left out), stock and with the integration installed, into a fresh run, and reports the
checkpoint's DCP items and bytes on disk. Scenario ``sparse`` is the above; scenario ``all``
gives every parameter a gradient (so stock Accelerate can load too). Times are medians over
``--repeats`` of the slowest rank, with a barrier before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..drills.ranks import spawn_ranks


class MoENet(nn.Module):
    def __init__(self, experts: int, routed: int, dim: int, all_state: bool) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.vision = nn.Linear(dim, dim)
        self.used = list(self.experts) if all_state else list(self.experts)[:routed]
        self.all_state = all_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        out = sum(e(h) for e in self.used)
        return out + self.vision(h) if self.all_state else out


def fsdp2_accelerator(world_size: int) -> Any:
    """The recipe of docs/integrations/hugging-face.md: FSDP2 forced on CPU (distributed type set explicitly,
    CPU mesh)."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig

    acc = Accelerator(cpu=True)
    for state in (acc.state, PartialState()):
        state.distributed_type = DistributedType.FSDP
    config = ParallelismConfig(dp_shard_size=world_size)
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc.state.parallelism_config = config
    acc.state.device_mesh = config.get_device_mesh("cpu")
    return acc


def prepared(
    args: argparse.Namespace, world_size: int, all_state: bool, seed: int, steps: int
) -> tuple[Any, nn.Module, Any]:
    acc = fsdp2_accelerator(world_size)
    torch.manual_seed(seed)
    model = MoENet(args.experts, args.routed, args.dim, all_state)
    opt = torch.optim.AdamW(
        [
            {"params": model.dense.parameters()},
            {"params": model.experts.parameters()},
            {"params": model.vision.parameters()},
        ],
        lr=0.01,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.5**s] * 3)
    model, opt, sched = acc.prepare(model, opt, sched)
    for step in range(steps):
        x = torch.randn(4, args.dim, generator=torch.Generator().manual_seed(step))
        acc.backward(model(x).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()
    return acc, model, opt


def timed(fn: Any, *args: Any) -> tuple[float, BaseException | None]:
    """Seconds of ``fn(*args)`` on the slowest rank, and its exception (``None`` when it returned)."""
    dist.barrier()
    t0 = time.perf_counter()
    error = None
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - stock load fails on sparse state: reported
        error = exc
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), error


def _disk(path: str) -> tuple[int, int]:
    from torch.distributed.checkpoint import FileSystemReader

    items = len(FileSystemReader(path).read_metadata().state_dict_metadata)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return items, size


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import accelerate.accelerator as acc_mod

    import sparse_ckpt.integrations.accelerate as integration

    rows = []
    for scenario in ("sparse", "all"):
        for method in ("stock", "sparse_ckpt"):
            if method == "sparse_ckpt":
                integration.install()
            saves, loads, error = [], [], None
            acc, model, opt = prepared(args, world_size, scenario == "all", seed=0, steps=2)
            n_state = len(opt.optimizer.state)
            for r in range(args.repeats):
                where = os.path.join(out_dir, f"{scenario}_{method}_{r}")
                saves.append(timed(acc_mod.save_fsdp_optimizer, acc.state.fsdp_plugin, acc, opt, model, where, 0)[0])
                acc2, model2, opt2 = prepared(args, world_size, scenario == "all", seed=1, steps=0)  # a fresh run
                t, error = timed(acc_mod.load_fsdp_optimizer, acc2.state.fsdp_plugin, acc2, opt2, model2, where, 0)
                loads.append(t)
            items, size = _disk(os.path.join(out_dir, f"{scenario}_{method}_0", "optimizer_0"))
            rows.append(
                (
                    scenario,
                    method,
                    n_state,
                    items,
                    size,
                    statistics.median(saves),
                    None if error else statistics.median(loads),
                    None if error is None else f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:90]}",
                )
            )
            integration.uninstall()
    if rank == 0:
        n_params = sum(1 for _ in model.parameters())
        print(
            f"accelerate FSDP2 optimizer checkpoint, {world_size} ranks, {n_params} params "
            f"({args.experts} experts, {args.routed} routed, dim {args.dim}), median of {args.repeats}"
        )
        print(
            f"{'scenario':<8} {'method':<12} {'with state':>10} {'items':>6} {'bytes':>9} {'save ms':>8} {'load ms':>8}"
        )
        for scenario, method, n_state, items, size, save, load, err in rows:
            load_text = f"{load * 1e3:8.1f}" if load is not None else "  failed"
            print(
                f"{scenario:<8} {method:<12} {n_state:>10} {items:>6} {size:>9} {save * 1e3:8.1f} {load_text}"
                + (f"  ({err})" if err else "")
            )
    dist.barrier()
    dist.destroy_process_group()  # (else a rank aborts at exit: SIGABRT after the table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.accelerate_ckpt", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--routed", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    spawn_ranks(worker, args.nproc, args, "sparse_ckpt_accelerate_")


if __name__ == "__main__":
    main()
