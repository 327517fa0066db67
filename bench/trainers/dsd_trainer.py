"""torch DSD optimizer checkpoints as trainers write them: stock vs ``sparse_ckpt.integrations.dsd.install()``.

``python -m bench.dsd_trainer [--nproc 2] [--experts 8] [--routed 4] [--dim 8] [--repeats 5] [--json PATH]``
(in a wheel: ``python -m sparse_ckpt.bench.dsd_trainer``).

Spawns ``--nproc`` Gloo ranks on CPU, each with the trainer drills' MoE (2 layers, each a router and
``--experts`` ``Linear(dim, dim)`` experts of which the first ``--routed`` are used, a ``vision``
tower in its own AdamW group that never runs, a head; FSDP2 over a CPU mesh) and times what Hugging
Face Accelerate's ``save_fsdp_optimizer``/``load_fsdp_optimizer`` (so ``Trainer``) and the other DSD
trainers do: save = ``get_optimizer_state_dict`` + ``dcp.save``; load into a fresh optimizer =
``get_optimizer_state_dict`` (the target) + ``dcp.load`` + ``set_optimizer_state_dict``. Scenario
``fresh`` saves before the first step, ``step3`` after three. Reports the parameters with state
in the live optimizer after the save and after the load, the checkpoint's DCP items and bytes, and
the save and load times (slowest rank, median of ``--repeats``); ``--json`` also writes them, with
the configuration and the machine (CPU, cores, load average, torch), to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import provenance
from ..drills.ranks import run_ranks
from ..provenance import cpu_model


class Layer(nn.Module):
    def __init__(self, experts: int, routed: int, dim: int) -> None:
        super().__init__()
        self.routed = routed
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x)[:, : self.routed], dim=-1)
        return x + sum(gates[:, i : i + 1] * torch.tanh(self.experts[i](x)) for i in range(self.routed))


class Moe(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(args.experts, args.routed, args.dim) for _ in range(2))
        self.vision = nn.Linear(args.dim, args.dim)
        self.head = nn.Linear(args.dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(args: argparse.Namespace, steps: int, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Moe(args)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    vision = list(model.vision.parameters())
    rest = [p for n, p in model.named_parameters() if not n.startswith("vision.")]
    opt = torch.optim.AdamW([{"params": rest}, {"params": vision, "lr": 0.02}], lr=0.01)
    for step in range(steps):
        x = torch.randn(4, args.dim, generator=torch.Generator().manual_seed(1000 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.param_groups[1]["lr"] = 0.005  # a scheduler moved vision's lr
    return model, opt


def trainer_save(model: nn.Module, opt: torch.optim.Optimizer, where: str) -> None:
    """What a DSD trainer's save does (Accelerate's ``save_fsdp_optimizer``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    dcp.save({"optimizer": dsd.get_optimizer_state_dict(model, opt)}, checkpoint_id=where)


def trainer_load(model: nn.Module, opt: torch.optim.Optimizer, where: str) -> None:
    """What a DSD trainer's resume does (Accelerate's ``load_fsdp_optimizer``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    target = {"optimizer": dsd.get_optimizer_state_dict(model, opt)}
    dcp.load(target, checkpoint_id=where)
    dsd.set_optimizer_state_dict(model, opt, target["optimizer"])


def timed(fn: Any, *args: Any) -> tuple[float, BaseException | None]:
    dist.barrier()
    start = time.perf_counter()
    error = None
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - stock DCP raises CheckpointException (a BaseException)
        error = exc
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()), error


def worker(rank: int, world_size: int, args: argparse.Namespace, out_dir: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    import sparse_ckpt.integrations.dsd as sc_dsd

    rows = []
    for method in ("stock", "install()"):
        if method != "stock":
            sc_dsd.install()
        for scenario, steps in (("fresh", 0), ("step3", 3)):
            saves, loads, error, after_load = [], [], None, None
            for r in range(args.repeats):
                model, opt = build(args, steps, rank)
                where = os.path.join(out_dir, f"{method}_{scenario}_{r}")
                t, _ = timed(trainer_save, model, opt, where)
                saves.append(t)
                after_save = len(opt.state)
                model2, opt2 = build(args, 0, rank)
                t, error = timed(trainer_load, model2, opt2, where)
                loads.append(t)
                after_load = len(opt2.state)
            path = os.path.join(out_dir, f"{method}_{scenario}_0")
            items = len(FileSystemReader(path).read_metadata().state_dict_metadata)
            size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            err = None if error is None else str(error).strip().splitlines()[-1][:100]
            rows.append(
                (
                    scenario,
                    method,
                    after_save,
                    items,
                    size,
                    statistics.median(saves),
                    after_load,
                    statistics.median(loads),
                    err,
                )
            )
        sc_dsd.uninstall()
    if rank == 0:
        n_params = sum(1 for _ in model.parameters())
        print(
            f"torch DSD optimizer checkpoint (get/set_optimizer_state_dict + dcp), {world_size} ranks, {n_params} "
            "params "
            f"({args.experts} experts/layer, {args.routed} routed, dim {args.dim}), median of {args.repeats}, "
            "slowest rank"
        )
        print(
            f"{'scenario':<8} {'method':<10} {'state after save':>16} {'items':>6} {'bytes':>8} {'save ms':>8} "
            f"{'state after load':>16} {'load ms':>8}"
        )
        for scenario, method, after_save, items, size, save, after_load, load, err in rows:
            load_text = "  failed" if err else f"{load * 1e3:8.1f}"
            print(
                f"{scenario:<8} {method:<10} {after_save:>16} {items:>6} {size:>8} {save * 1e3:8.1f} "
                f"{after_load:>16} {load_text}" + (f"  ({err})" if err else "")
            )
        if args.json is not None:
            write_json(args, world_size, n_params, rows)
    dist.barrier()


def write_json(args: argparse.Namespace, world_size: int, n_params: int, rows: list[tuple[Any, ...]]) -> None:
    """The rows of :func:`worker` as JSON at ``args.json``, with the configuration and the machine."""
    fields = (
        "scenario",
        "method",
        "state_after_save",
        "items",
        "bytes",
        "save_s",
        "state_after_load",
        "load_s",
        "load_error",
    )
    machine = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }
    config = {
        "nproc": world_size,
        "experts": args.experts,
        "routed": args.routed,
        "dim": args.dim,
        "repeats": args.repeats,
        "params": n_params,
    }
    command = "python -m bench.dsd_trainer --repeats " + str(args.repeats) + " --json " + str(args.json)
    payload = {"command": command, "config": config, "machine": machine, "rows": [dict(zip(fields, r)) for r in rows]}
    payload["provenance"] = provenance.record()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dsd_trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--routed", type=int, default=4)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the table, the configuration and the machine here"
    )
    args = parser.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="sparse_ckpt_dsd_")
    try:
        run_ranks(worker, args.nproc, args, out_dir, err_dir=out_dir, timeout=600)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
