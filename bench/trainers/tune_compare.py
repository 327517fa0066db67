"""torchtune 0.6.1 recipe checkpoints: stock vs ``sparse_ckpt.integrations.torchtune``, sync and async.

``python -m bench.tune_compare [--nproc 2] [--layers 4] [--experts 32] [--routed 8] [--dim 64] [--repeats 3]``
(needs torchtune: ``pip install --no-deps -r .ci/requirements-torchtune.txt``).

Spawns ``--nproc`` Gloo ranks on CPU with an FSDP2 MoE (``--layers`` layers of a router and
``--experts`` ``Linear(dim, dim)`` experts, of which the first ``--routed`` get tokens, plus a
``vision`` tower that never runs and a head; AdamW, ``vision`` in its own group), trains 3 steps and
saves the way torchtune's ``full_finetune_distributed`` recipe does (`bench.tune_scenario`: sync =
``FullModelTorchTuneCheckpointer``, async = ``enable_async_checkpointing``), then resumes into a fresh
model and optimizer the way the recipe's ``setup`` does. Scenario ``moe`` is the above; ``all`` routes
every expert and runs ``vision`` (every parameter has state, so stock torchtune loads too).

Per scenario, way and method: parameters with state at the save and after the resume, the optimizer
entries written (sync: state tensors in ``recipe_state.pt``; async: DCP items under ``optimizer.``,
and all items), bytes (``recipe_state.pt``; the ``dist_epoch_0`` folder), save time (the recipe's
``save_checkpoint`` with the model, an async save until it is on disk) and resume time (the recipe's
``setup`` part: base or epoch weights, optimizer, distributed checkpoint), medians over ``--repeats``
of the slowest rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..drills.ranks import spawn_ranks


class MoeLayer(nn.Module):
    def __init__(self, dim: int, experts: int, routed: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.routed = routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x)[:, : self.routed], dim=-1)
        return x + sum(gates[:, i : i + 1] * torch.tanh(self.experts[i](x)) for i in range(self.routed))


class Moe(nn.Module):
    def __init__(self, args: argparse.Namespace, every: bool) -> None:
        super().__init__()
        routed = args.experts if every else args.routed
        self.layers = nn.ModuleList(MoeLayer(args.dim, args.experts, routed) for _ in range(args.layers))
        self.vision = nn.Linear(args.dim, args.dim)
        self.head = nn.Linear(args.dim, 1)
        self.every = every

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if self.every:
            x = x + self.vision(x)
        return self.head(x).sum(-1)


def build(args: argparse.Namespace, every: bool, mesh: Any, steps: int) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Moe(args, every)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model)
    for step in range(steps):
        x = torch.randn(4, args.dim, generator=torch.Generator().manual_seed(step * 100 + dist.get_rank()))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    vision = [p for n, p in model.named_parameters() if n.startswith("vision.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("vision.")]
    return torch.optim.AdamW([{"params": rest}, {"params": vision, "lr": 0.02}], lr=0.01)


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any, BaseException | None]:
    """Seconds of ``fn`` on the slowest rank, its result and its exception."""
    dist.barrier()
    t0 = time.perf_counter()
    result, error = None, None
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - a stock resume fails on sparse state: reported
        error = exc
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), result, error


def written(run: Path, async_: bool) -> tuple[int, int, int]:
    """(optimizer entries, all entries, bytes) of the optimizer's file or folder."""
    if async_:
        from torch.distributed.checkpoint import FileSystemReader

        folder = run / "out" / "dist_epoch_0"
        keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        size = sum(f.stat().st_size for f in folder.iterdir())
        return sum(k.startswith("optimizer.") for k in keys), len(keys), size
    path = run / "out" / "recipe_state" / "recipe_state.pt"
    sd = torch.load(path, weights_only=True)["optimizer"]
    tensors = sum(isinstance(v, torch.Tensor) for s in sd["state"].values() for v in s.values())
    return tensors, tensors, path.stat().st_size


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    logging.disable(logging.WARNING)  # torchtune logs every step at INFO
    from torch.distributed.device_mesh import init_device_mesh

    from bench.trainers import tune_scenario as ts
    from sparse_ckpt.integrations import torchtune as sc_tune

    mesh = init_device_mesh("cpu", (world_size,))
    rows = []
    for scenario in ("moe", "all"):
        for way, async_ in (("sync", False), ("async", True)):
            for method in ("stock", "sparse_ckpt"):
                if method == "sparse_ckpt":
                    sc_tune.install()
                saves, loads, error, loaded = [], [], None, None
                for r in range(args.repeats):
                    run = Path(out_dir) / f"{scenario}-{way}-{method}-{r}"
                    model, optimizer = build(args, scenario == "all", mesh, steps=3)
                    ts.write_base(run, Moe(args, scenario == "all"))
                    with_state = len(optimizer.state)
                    saves.append(timed(ts.save, run, model, optimizer, async_=async_)[0])
                    fresh, _ = build(args, scenario == "all", mesh, steps=0)
                    t, result, error = timed(ts.resume, run, fresh, make_optimizer, async_=async_)
                    loads.append(t)
                    loaded = None if error else len(result[0].state)
                entries = written(Path(out_dir) / f"{scenario}-{way}-{method}-0", async_)
                err = None if error is None else f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:110]}"
                rows.append(
                    (
                        scenario,
                        way,
                        method,
                        with_state,
                        loaded,
                        *entries,
                        statistics.median(saves),
                        None if error else statistics.median(loads),
                        err,
                    )
                )
                sc_tune.uninstall()
    if rank == 0:
        n = sum(1 for _ in model.parameters())
        print(
            f"torchtune 0.6.1 recipe checkpoints, {world_size} ranks, {n} parameters ({args.layers} layers x "
            f"{args.experts} experts, {args.routed} routed in 'moe', dim {args.dim}), median of {args.repeats}"
        )
        print(
            f"{'scenario':<8} {'way':<5} {'method':<11} {'state':>11} {'opt items':>9} {'items':>6} {'bytes':>10} "
            f"{'save ms':>8} {'resume ms':>9}"
        )
        for scenario, way, method, before, after, opt_items, items, size, save, load, err in rows:
            state = f"{before}->{after if after is not None else 'x'}"
            load_text = f"{load * 1e3:9.1f}" if load is not None else "    fails"
            print(
                f"{scenario:<8} {way:<5} {method:<11} {state:>11} {opt_items:>9} {items:>6} {size:>10} "
                f"{save * 1e3:8.1f} {load_text}" + (f"  ({err})" if err else "")
            )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tune_compare", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--routed", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    spawn_ranks(worker, args.nproc, args, "sparse_ckpt_torchtune_")


if __name__ == "__main__":
    main()
