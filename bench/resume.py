"""The resume drill (issue 11): train, checkpoint asynchronously, get SIGKILLed mid-save, resume exactly.

``python -m bench.resume --nproc 2`` (also ``--nproc 1`` / ``--nproc 4``, ``--steps``, ``--every``,
``--kill-at``, ``--resume-sizes``, ``--device cpu|cuda|npu``) trains the way users train and checks
what users rely on:

* **Model:** a small vision-language MoE (:class:`DrillModel`): a frozen vision tower, an adapter,
  token embeddings, MoE blocks and a head, ``fully_shard`` per block and at the root (FSDP2). The
  router of every block masks the last experts out (``route_mask``), so those experts never get a
  token, a gradient or optimizer state.
* **Optimizer:** ``sparse_ckpt.MultiOptimizer(model, {"experts": AdamW, "dense": AdamW, "vision":
  AdamW})`` with one LR scheduler per leaf. The vision tower is frozen (``requires_grad=False``: its
  leaf's ``step`` does nothing), but its scheduler moves its lr 0.01 -> 0.005 -> 0.0025.
* **Checkpoints:** every ``every`` steps ``dcp.async_save({"model": ModelState, "optim": mo,
  "sched": SchedulerState, "train": TrainState}, checkpoint_id=<run>/step-<n>)`` on a dedicated Gloo
  group (as torchtitan does: the save's collectives run in a background thread and must not
  interleave with FSDP's), waiting for the previous save first.
* **Kill:** the run is SIGKILLed (every rank's process group) while the save of
  step ``kill_at`` is in flight: :class:`StallingWriter` writes that checkpoint's data files, signals
  and stalls before DCP can write ``.metadata``.
* **Resume:** fresh processes at every size in ``resume_sizes`` load the last *complete* checkpoint
  (the newest ``step-*`` directory with ``.metadata``) with ``sparse_ckpt.SparseLoadPlanner`` and
  train on to ``steps``; parameters, optimizer state, lrs and scheduler states must equal an
  uninterrupted run bit for bit. Every rank gets the same batch, so FSDP's gradient averaging over a
  power-of-two number of identical values is exact and results do not depend on the world size.
* **Devices:** ``--device cpu`` (default): Gloo ranks on the CPU; ``cuda``: NCCL, rank r on ``cuda:r``
  (one rank per GPU, deterministic kernels); ``npu``: ``torch_npu``, HCCL. Ranks start from a fork
  server or by spawn (``.ranks``), never by fork, and ``fully_shard`` always gets an explicit mesh
  on the run's device, so a CPU run also works on a GPU machine.

:func:`run_drill` is what the CLI and ``tests/benchmark/test_resume_drill.py`` call; the pieces
(:func:`train_run`, :func:`run_ranks`, :func:`run_killed`, :func:`compare_snapshots`, ...) are
importable on their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, LRScheduler

import sparse_ckpt as sc

from .devices import (
    DEVICES,
    DeviceUnavailable,
    check_device,
    check_world_sizes,
    current_device,
    device_count,
    synchronize,
)
from .ranks import run_killed, run_ranks

__all__ = [
    "DrillConfig",
    "DrillModel",
    "DrillResult",
    "ModelState",
    "SchedulerState",
    "StallingWriter",
    "TrainState",
    "VisionDecay",
    "build",
    "compare_snapshots",
    "default_resume_sizes",
    "latest_complete",
    "main",
    "run_drill",
    "run_killed",
    "run_ranks",
    "train_run",
]

VISION_LR = 0.01
SNAPSHOT = "snapshot.pt"
TIMINGS = "timings.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class DrillConfig:
    """Sizes of the drill. The default widths give every rank's shard a multiple of 32 elements (see :func:`build`)."""

    steps: int = 12
    """Total training steps (N + M)."""
    every: int = 3
    """Checkpoint every ``every`` steps (after steps every, 2*every, ...)."""
    kill_at: int | None = None
    """The step whose save is in flight when the run is killed; ``None``: the second to last save."""
    dim: int = 32
    hidden: int = 64
    n_experts: int = 8
    routed: int = 5
    """Experts ``routed..n_experts-1`` of every block never receive a token."""
    n_blocks: int = 2
    vocab: int = 64
    patch_dim: int = 32
    batch: int = 4
    tokens: int = 8
    patches: int = 4
    seed: int = 0
    device: str = "cpu"
    """Where the ranks train: ``cpu`` (Gloo), ``cuda`` (NCCL, one rank per GPU) or ``npu`` (HCCL)."""

    def save_steps(self) -> list[int]:
        """The steps after which a checkpoint is saved."""
        return list(range(self.every, self.steps + 1, self.every))

    def kill_step(self) -> int:
        """The step whose save the killed run never finishes."""
        saves = self.save_steps()
        if len(saves) < 2:
            raise ValueError(f"--steps {self.steps} --every {self.every}: need at least two saves to kill one")
        kill = saves[-2] if self.kill_at is None else self.kill_at
        if kill not in saves[1:]:
            raise ValueError(f"kill_at={kill} must be a save step after the first one: {saves[1:]}")
        return kill

    def vision_milestones(self) -> tuple[int, int]:
        """Scheduler epochs at which the vision lr halves (0.01 -> 0.005 -> 0.0025)."""
        return (max(1, self.steps // 3), max(2, (2 * self.steps) // 3))

    def unrouted_prefixes(self) -> list[str]:
        """FQN prefixes of the experts that never get a token."""
        return [f"blocks.{b}.experts.{e}." for b in range(self.n_blocks) for e in range(self.routed, self.n_experts)]


# --------------------------------------------------------------------------- the model


class Expert(nn.Module):
    """A feed-forward expert ``down(gelu(up(x)))`` (no biases: every shard is a multiple of 32)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the expert."""
        return self.down(nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 routed experts with a residual; ``route_mask`` keeps experts ``routed..`` unrouted."""

    def __init__(self, dim: int, hidden: int, n_experts: int, routed: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(n_experts))
        mask = torch.zeros(n_experts)
        mask[routed:] = float("-inf")
        self.register_buffer("route_mask", mask, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Route every row to its best allowed expert."""
        flat = h.reshape(-1, h.shape[-1])
        logits = self.router(flat) + self.route_mask
        choice = logits.argmax(dim=-1)
        gate = torch.softmax(logits, dim=-1).gather(-1, choice[:, None])
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                out = out.index_add(0, rows, gate[rows] * expert(flat[rows]))
        return h + torch.tanh(out.reshape(h.shape))


class VisionTower(nn.Module):
    """Patch embedding and one projection; frozen in the drill."""

    def __init__(self, patch_dim: int, dim: int) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Image patches -> features."""
        return torch.tanh(self.proj(nn.functional.gelu(self.patch(images))))


class DrillModel(nn.Module):
    """``[adapter(vision(images)); embed(tokens)] -> MoE blocks -> head``."""

    def __init__(self, cfg: DrillConfig) -> None:
        super().__init__()
        self.vision = VisionTower(cfg.patch_dim, cfg.dim)
        self.adapter = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(
            MoEBlock(cfg.dim, cfg.hidden, cfg.n_experts, cfg.routed) for _ in range(cfg.n_blocks)
        )
        self.head = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """Output features for every patch and token."""
        h = torch.cat([self.adapter(self.vision(images)), self.embed(tokens)], dim=1)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class VisionDecay:
    """LambdaLR factor: 1 until ``milestones[0]``, 1/2 until ``milestones[1]``, then 1/4.

    A callable object (not a function), so ``LambdaLR.state_dict`` saves its attributes.
    """

    def __init__(self, milestones: Sequence[int]) -> None:
        self.milestones = tuple(milestones)

    def __call__(self, epoch: int) -> float:
        return 0.5 ** sum(epoch >= m for m in self.milestones)


def make_batch(cfg: DrillConfig, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch of ``step`` (1-based): the same on every rank and at every world size."""
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.tokens), generator=gen)
    images = torch.randn(cfg.batch, cfg.patches, cfg.patch_dim, generator=gen)
    target = torch.randn(cfg.batch, cfg.patches + cfg.tokens, cfg.dim, generator=gen)
    return tokens, images, target


def build(cfg: DrillConfig) -> tuple[DrillModel, sc.MultiOptimizer, dict[str, LRScheduler]]:
    """The deterministic model (FSDP2-sharded on ``cfg.device`` when a process group is up, else on the
    CPU), its MultiOptimizer and schedulers.

    With the default sizes every shard is a multiple of 32 elements at world sizes 1, 2 and 4, so the
    optimizer's elementwise kernels cannot treat an element differently at another world size (a
    precaution: uneven widths such as ``--dim 36 --hidden 68`` were bit-identical too on torch 2.13 CPU).
    """
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    try:
        model = DrillModel(cfg)
    finally:
        torch.random.set_rng_state(gen_state)
    model.vision.requires_grad_(False)
    if dist.is_initialized():
        # An explicit mesh on the run's device: without one, fully_shard builds its default mesh on the
        # machine's accelerator (CUDA on a GPU machine) even when the run is Gloo on CPU.
        mesh = init_device_mesh(cfg.device, (dist.get_world_size(),))
        fully_shard(model.vision, mesh=mesh)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    experts = [p for block in model.blocks for p in block.experts.parameters()]
    routers = [block.router.weight for block in model.blocks]
    dense = [*model.adapter.parameters(), *model.embed.parameters(), *model.head.parameters()]
    mo = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(experts, lr=0.004, weight_decay=0.1),
            "dense": torch.optim.AdamW(
                [{"params": dense}, {"params": routers, "weight_decay": 0.0, "lr": 0.002}], lr=0.003
            ),
            "vision": torch.optim.AdamW(model.vision.parameters(), lr=VISION_LR),
        },
    )
    scheds: dict[str, LRScheduler] = {
        "experts": LinearLR(mo["experts"], start_factor=0.25, total_iters=max(1, cfg.steps // 2)),
        "dense": CosineAnnealingLR(mo["dense"], T_max=cfg.steps, eta_min=1e-4),
        "vision": LambdaLR(mo["vision"], VisionDecay(cfg.vision_milestones())),
    }
    return model, mo, scheds


# --------------------------------------------------------------------------- Stateful app state


class ModelState:
    """DCP ``Stateful`` for the model (torchtitan's ``ModelWrapper``): DSD's sharded model state dict."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        """``get_model_state_dict(model)``: DTensors under FSDP2, resharded by DCP on load."""
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """``set_model_state_dict(model, state_dict)`` (strict)."""
        set_model_state_dict(self.model, dict(state_dict))


class SchedulerState:
    """DCP ``Stateful`` holding one LR scheduler per leaf: ``{leaf: scheduler.state_dict()}``.

    DCP calls ``state_dict()``/``load_state_dict()`` only on top-level values, so a dict of
    schedulers would be pickled whole (and restored into nothing); this object is the top-level
    value. DCP turns every dict key into a string, which silently breaks int-keyed dicts (e.g.
    ``MultiStepLR``'s ``milestones`` Counter): such state is refused here instead.
    """

    def __init__(self, schedulers: Mapping[str, LRScheduler]) -> None:
        self.schedulers = dict(schedulers)

    def state_dict(self) -> dict[str, Any]:
        """Every scheduler's own ``state_dict()``, by leaf name."""
        out = {name: s.state_dict() for name, s in self.schedulers.items()}
        _check_str_keys(out, "sched")
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore every scheduler; the leaves must be the same."""
        if set(state_dict) != set(self.schedulers):
            raise KeyError(f"scheduler leaves {sorted(state_dict)} != {sorted(self.schedulers)}")
        for name, sched in self.schedulers.items():
            sched.load_state_dict(dict(state_dict[name]))


def _check_str_keys(node: Any, where: str) -> None:
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has the non-string key {key!r}: DCP would restore it as {str(key)!r}")
            _check_str_keys(value, f"{where}.{key}")


class TrainState:
    """DCP ``Stateful`` for the loop counter (torchtitan's ``TrainState``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"step": tensor}``."""
        return {"step": torch.tensor(self.step, dtype=torch.int64)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore ``step``."""
        self.step = int(state_dict["step"])


class StallingWriter(dcp.FileSystemWriter):
    """A ``FileSystemWriter`` that, when ``stall_marker`` is set, writes its data, signals and stalls.

    The data files of this rank are on disk, but ``write_data`` never returns, so DCP never gathers
    the write results and never writes ``.metadata``: the checkpoint stays incomplete until the
    process is killed.
    """

    def __init__(self, path: str | os.PathLike[str], stall_marker: str | None = None) -> None:
        super().__init__(path)
        self.stall_marker = stall_marker

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        """Write as ``FileSystemWriter`` does; then, if asked, signal through ``stall_marker`` and stall."""
        fut = super().write_data(plan, planner)
        if self.stall_marker is not None:
            Path(self.stall_marker).write_text(str(os.getpid()))
            while True:
                time.sleep(3600)
        return fut


# --------------------------------------------------------------------------- one training run (every rank)


def latest_complete(run_dir: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The newest ``step-<n>`` directory of ``run_dir`` that has ``.metadata`` (DCP writes it last)."""
    found: list[tuple[int, Path]] = []
    root = Path(run_dir)
    if root.is_dir():
        for entry in root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / ".metadata").is_file():
                found.append((int(match.group(1)), entry))
    return max(found) if found else None


def _full(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value on the CPU (a collective for DTensors: every rank calls it in the same order)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _check_sparse_state(model: nn.Module, mo: sc.MultiOptimizer, cfg: DrillConfig, where: str) -> None:
    """No ``{}`` entries; no state for unrouted experts or for the vision leaf; every param of a leaf known."""
    names = {id(p): n for n, p in model.named_parameters()}
    unrouted = tuple(cfg.unrouted_prefixes())
    for leaf, opt in mo.leaves():
        for p, st in opt.state.items():
            name = names.get(id(p), f"<unknown {tuple(p.shape)}>")
            assert st, f"{where}: leaf {leaf!r} has an empty state entry for {name}"
            assert not name.startswith(unrouted), f"{where}: unrouted expert {name} has state {sorted(st)}"
        if leaf == "vision":
            assert not opt.state, f"{where}: the frozen vision leaf has state for {len(opt.state)} params"


def snapshot(
    model: nn.Module, mo: sc.MultiOptimizer, scheds: Mapping[str, LRScheduler], step: int
) -> dict[str, Any]:
    """Full parameters, full optimizer state by ``leaf/fqn``, group lrs and scheduler states (collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    snap: dict[str, Any] = {"step": step, "params": {}, "state": {}, "lr": {}, "sched": {}}
    for name, p in model.named_parameters():
        snap["params"][name] = _full(p)
    for leaf, opt in mo.leaves():
        snap["lr"][leaf] = [g["lr"] for g in opt.param_groups]
        for p, st in sorted(opt.state.items(), key=lambda kv: names[id(kv[0])]):
            snap["state"][f"{leaf}/{names[id(p)]}"] = {k: _full(v) for k, v in sorted(st.items())}
    for leaf, sched in scheds.items():
        sd = sched.state_dict()
        snap["sched"][leaf] = {k: v for k, v in sd.items() if not callable(v)}
    return snap


def train_run(
    rank: int,
    world_size: int,
    cfg: DrillConfig,
    run_dir: str,
    out_dir: str,
    resume_from: str | None = None,
    stall_at: int | None = None,
    skip_on_load: Sequence[str] = (),
) -> None:
    """One run on one rank: (resume,) train to ``cfg.steps`` with async saves, snapshot on rank 0.

    ``resume_from``: a run directory to resume from (its newest complete checkpoint);
    ``skip_on_load``: app-state keys *not* to load (a broken resume, to show the checks catch it). ``stall_at``:
    the save of that step stalls (:class:`StallingWriter`); the marker ``stalled-<rank>`` appears in
    ``out_dir`` once this rank's data files are written. Rank 0 writes ``timings.json`` (per save:
    the wait for the previous save, the ``async_save`` call, and the mean step time since the last
    save) and ``snapshot.pt`` (:func:`snapshot` after the last save completed).
    """
    out = Path(out_dir)
    ckpt_pg = dist.new_group(backend="gloo")  # the saves' collectives run in a background thread
    model, mo, scheds = build(cfg)
    train_state = TrainState()
    app = {"model": ModelState(model), "optim": mo, "sched": SchedulerState(scheds), "train": train_state}
    info: dict[str, Any] = {"world_size": world_size, "backend": sc.backend(), "device": cfg.device, "saves": []}
    device = current_device(cfg.device)
    if resume_from is not None:
        found = latest_complete(resume_from)
        assert found is not None, f"no complete checkpoint in {resume_from}"
        step, path = found
        t0 = time.perf_counter()
        load_target = {k: v for k, v in app.items() if k not in skip_on_load}
        dcp.load(load_target, checkpoint_id=str(path), planner=sc.SparseLoadPlanner())
        info["load_s"] = time.perf_counter() - t0
        info["resumed_from"] = path.name
        assert train_state.step == step, f"checkpoint {path.name} holds step {train_state.step}"
        _check_sparse_state(model, mo, cfg, f"rank {rank} after loading {path.name}")
    pending: Future[Any] | None = None
    window: list[float] = []
    for step in range(train_state.step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        tokens, images, target = (t.to(device) for t in make_batch(cfg, step))
        mo.zero_grad()
        loss = (model(tokens, images) - target).pow(2).mean()
        loss.backward()
        mo.step()
        for sched in scheds.values():
            sched.step()
        train_state.step = step
        synchronize(cfg.device)
        window.append(time.perf_counter() - t0)
        if step % cfg.every == 0:
            t1 = time.perf_counter()
            if pending is not None:
                pending.result()
            t2 = time.perf_counter()
            ckpt = Path(run_dir) / f"step-{step}"
            marker = str(out / f"stalled-{rank}") if step == stall_at else None
            pending = dcp.async_save(
                app, storage_writer=StallingWriter(ckpt, marker), checkpoint_id=str(ckpt), process_group=ckpt_pg
            )
            t3 = time.perf_counter()
            info["saves"].append(
                {"step": step, "wait_prev_s": t2 - t1, "async_save_s": t3 - t2, "mean_step_s": sum(window) / len(window),
                 "steps": len(window)}
            )
            window = []
    if pending is not None:
        t0 = time.perf_counter()
        pending.result()
        info["final_wait_s"] = time.perf_counter() - t0
    _check_sparse_state(model, mo, cfg, f"rank {rank} at step {train_state.step}")
    snap = snapshot(model, mo, scheds, train_state.step)
    if rank == 0:
        torch.save(snap, out / SNAPSHOT)
        (out / TIMINGS).write_text(json.dumps(info, indent=1))
    dist.barrier()


# --------------------------------------------------------------------------- the drill


@dataclasses.dataclass
class DrillResult:
    """What :func:`run_drill` measured and checked."""

    cfg: DrillConfig
    nproc: int
    root: Path
    kill_step: int
    resumed_from: str
    reference: dict[str, Any]
    """``timings.json`` of the uninterrupted run."""
    killed_after_s: float
    incomplete: list[str]
    """Checkpoint directories of the killed run without ``.metadata``."""
    resumes: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """World size -> ``timings.json`` of that resume plus ``checks`` (a summary of what matched)."""


def compare_snapshots(ref: Mapping[str, Any], got: Mapping[str, Any], where: str) -> dict[str, int]:
    """Assert two :func:`snapshot` results are bit-identical; return counts of what was compared."""
    assert got["step"] == ref["step"], f"{where}: step {got['step']} vs {ref['step']}"
    assert got["lr"] == ref["lr"], f"{where}: lr {got['lr']} vs {ref['lr']}"
    assert got["sched"] == ref["sched"], f"{where}: scheduler state {got['sched']} vs {ref['sched']}"
    for part in ("params", "state"):
        assert list(got[part]) == list(ref[part]), f"{where}: {part} keys {list(got[part])} vs {list(ref[part])}"
    for name, value in ref["params"].items():
        other = got["params"][name]
        assert other.dtype == value.dtype and torch.equal(other, value), f"{where}: parameter {name} differs"
    n_tensors = 0
    for name, st in ref["state"].items():
        other = got["state"][name]
        assert list(other) == list(st), f"{where}: state keys of {name}: {list(other)} vs {list(st)}"
        for key, value in st.items():
            assert other[key].dtype == value.dtype and torch.equal(other[key], value), f"{where}: state {name}.{key}"
            n_tensors += 1
    return {"params": len(ref["params"]), "state_params": len(ref["state"]), "state_tensors": n_tensors}


def check_snapshot_sparsity(snap: Mapping[str, Any], cfg: DrillConfig, initial: DrillModel) -> None:
    """The snapshot has no state for unrouted experts or vision, and the frozen tower never moved."""
    unrouted = tuple(cfg.unrouted_prefixes())
    for key in snap["state"]:
        leaf, _, fqn = key.partition("/")
        assert leaf != "vision" and not fqn.startswith(unrouted), f"unexpected optimizer state for {key}"
    for name, p in initial.named_parameters():
        if name.startswith(unrouted) or name.startswith("vision."):
            assert torch.equal(snap["params"][name], p.detach()), f"{name} changed although it never had a grad"
    assert snap["lr"]["vision"] == [VISION_LR * 0.25], f"vision lr {snap['lr']['vision']} != [{VISION_LR * 0.25}]"


def check_checkpoint_keys(path: Path, cfg: DrillConfig) -> int:
    """No ``optim.state`` item in the checkpoint at ``path`` for unrouted experts or vision; count them."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    unrouted = tuple(cfg.unrouted_prefixes())
    n = 0
    for key in md.state_dict_metadata:
        if key.startswith("optim.state."):
            n += 1
            body = key[len("optim.state."):]
            assert not body.startswith(unrouted) and not body.startswith("vision."), f"{path.name}: saved {key}"
    assert n, f"{path.name}: no optimizer state saved"
    return n


def run_drill(
    cfg: DrillConfig,
    nproc: int = 2,
    resume_sizes: Sequence[int] = (2, 1, 4),
    root: str | os.PathLike[str] | None = None,
    *,
    rank_fn: Callable[..., None] = train_run,
) -> DrillResult:
    """The whole drill under ``root`` (a new temp directory if ``None``); raises ``AssertionError`` on a mismatch.

    1. ``reference/``: an uninterrupted run at ``nproc`` ranks (saves included);
    2. ``killed/``: the same run, SIGKILLed while the save of ``cfg.kill_step()`` is in flight;
    3. ``resume-<n>/`` for every ``n`` in ``resume_sizes``: resume from ``killed/``'s newest complete
       checkpoint at ``n`` ranks and train to ``cfg.steps``; compare with the reference.

    Ranks run on ``cfg.device``. ``rank_fn``: what every rank runs, :func:`train_run` or a picklable
    function that calls it with the same arguments (a test may wrap it to add checks inside the ranks).
    """
    base = Path(tempfile.mkdtemp(prefix="resume-drill-") if root is None else root)
    kill = cfg.kill_step()
    dirs = {name: base / name for name in ("reference", "killed", *(f"resume-{n}" for n in resume_sizes))}
    for d in dirs.values():
        (d / "ckpt").mkdir(parents=True, exist_ok=True)

    ref_dir = dirs["reference"]
    run_ranks(rank_fn, nproc, cfg, str(ref_dir / "ckpt"), str(ref_dir), err_dir=str(ref_dir), device=cfg.device)
    reference = json.loads((ref_dir / TIMINGS).read_text())
    ref_snap = torch.load(ref_dir / SNAPSHOT, weights_only=True)
    if dist.is_initialized():
        raise RuntimeError("run_drill starts its own process groups; call it outside one")
    initial, _, _ = build(cfg)  # unsharded: the initial values of the parameters that must never move
    check_snapshot_sparsity(ref_snap, cfg, initial)
    for step in cfg.save_steps():
        check_checkpoint_keys(ref_dir / "ckpt" / f"step-{step}", cfg)

    kdir = dirs["killed"]
    markers = [kdir / f"stalled-{r}" for r in range(nproc)]
    killed_after = run_killed(
        rank_fn, nproc, cfg, str(kdir / "ckpt"), str(kdir), None, kill, markers=markers, err_dir=str(kdir),
        device=cfg.device,
    )
    ckpts = sorted((p for p in (kdir / "ckpt").iterdir() if _STEP_DIR.match(p.name)), key=lambda p: int(p.name[5:]))
    incomplete = [p.name for p in ckpts if not (p / ".metadata").exists()]
    assert incomplete == [f"step-{kill}"], f"incomplete checkpoints {incomplete}, expected [step-{kill}]"
    assert any((kdir / "ckpt" / f"step-{kill}").glob("*.distcp")), "the killed save wrote no data files"
    found = latest_complete(kdir / "ckpt")
    expected_from = kill - cfg.every
    assert found is not None and found[0] == expected_from, f"latest complete {found}, expected step-{expected_from}"
    check_checkpoint_keys(found[1], cfg)

    result = DrillResult(cfg, nproc, base, kill, found[1].name, reference, killed_after, incomplete)
    for n in resume_sizes:
        rdir = dirs[f"resume-{n}"]
        run_ranks(rank_fn, n, cfg, str(rdir / "ckpt"), str(rdir), str(kdir / "ckpt"), err_dir=str(rdir),
                  device=cfg.device)
        info = json.loads((rdir / TIMINGS).read_text())
        snap = torch.load(rdir / SNAPSHOT, weights_only=True)
        check_snapshot_sparsity(snap, cfg, initial)
        info["checks"] = compare_snapshots(ref_snap, snap, f"resume at world size {n}")
        for step in (s for s in cfg.save_steps() if s > expected_from):
            check_checkpoint_keys(rdir / "ckpt" / f"step-{step}", cfg)
        result.resumes[n] = info
    return result


# --------------------------------------------------------------------------- CLI


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


def format_saves(title: str, info: Mapping[str, Any]) -> list[str]:
    """One line per save: the checkpoint stall next to the mean step time."""
    lines = [f"{title} ({info['world_size']} rank(s) on {info.get('device', 'cpu')}, core {info['backend']})"]
    if "load_s" in info:
        lines.append(f"  load {info['resumed_from']}: {_ms(info['load_s'])}")
    for s in info["saves"]:
        stall = s["wait_prev_s"] + s["async_save_s"]
        lines.append(
            f"  save step {s['step']:>4}: stall {_ms(stall)} (wait for previous {_ms(s['wait_prev_s'])}, "
            f"async_save {_ms(s['async_save_s'])}) | mean step {_ms(s['mean_step_s'])} over {s['steps']} steps"
        )
    if "final_wait_s" in info:
        lines.append(f"  wait for the last save: {_ms(info['final_wait_s'])}")
    return lines


def _sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive world sizes expected")
    return sizes


def default_resume_sizes(nproc: int, devices: int | None) -> list[int]:
    """``nproc`` first, then those of 1, 2 and 4 that differ from it and that ``devices`` accelerators
    allow (one rank each; ``None``: the CPU, no limit)."""
    return [nproc, *(n for n in (1, 2, 4) if n != nproc and (devices is None or n <= devices))]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.resume``: run the drill, print stalls, step times and the resume checks."""
    parser = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="world size of the trained and killed runs (default 2)")
    parser.add_argument("--steps", type=int, default=DrillConfig.steps, help="total steps N+M (default %(default)s)")
    parser.add_argument("--every", type=int, default=DrillConfig.every, help="save every K steps (default %(default)s)")
    parser.add_argument("--kill-at", type=int, default=None, help="the save step in flight when killed "
                        "(default: the second to last save)")
    parser.add_argument("--resume-sizes", type=_sizes, default=None, help="world sizes to resume at (default 1,2,4 "
                        "with --nproc first; on cuda/npu only those the devices present allow)")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="cpu: Gloo ranks (default); cuda: NCCL, one "
                        "rank per GPU (--nproc and --resume-sizes at most the GPUs present); npu: torch_npu, HCCL")
    parser.add_argument("--dim", type=int, default=DrillConfig.dim, help="model width (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=DrillConfig.hidden, help="expert width (default %(default)s)")
    parser.add_argument("--experts", type=int, default=DrillConfig.n_experts, help="experts per block (default "
                        "%(default)s)")
    parser.add_argument("--routed", type=int, default=DrillConfig.routed, help="experts that get tokens "
                        "(default %(default)s)")
    parser.add_argument("--blocks", type=int, default=DrillConfig.n_blocks, help="MoE blocks (default %(default)s)")
    parser.add_argument("--out", default=None, help="keep the run here (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    cfg = DrillConfig(steps=args.steps, every=args.every, kill_at=args.kill_at, dim=args.dim, hidden=args.hidden,
                      n_experts=args.experts, routed=min(args.routed, args.experts), n_blocks=args.blocks,
                      device=args.device)
    try:
        kill = cfg.kill_step()
    except ValueError as exc:
        parser.error(str(exc))
    try:
        check_device(args.device)
        present = device_count(args.device)
        sizes = args.resume_sizes or default_resume_sizes(args.nproc, present)
        check_world_sizes(args.device, [args.nproc, *sizes])
    except DeviceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    where = args.device if present is None else f"{args.device} ({present} present)"
    print(f"resume drill: {args.nproc} rank(s) on {where}, {cfg.steps} steps, save every {cfg.every}, SIGKILL during "
          f"the save of step {kill}, resume at {','.join(map(str, sizes))}; core {sc.backend()}; "
          f"torch {torch.__version__}", flush=True)
    root = args.out
    tmp = None
    if root is None:
        tmp = root = tempfile.mkdtemp(prefix="resume-drill-")
    elif Path(root).exists() and any(Path(root).iterdir()):
        parser.error(f"--out {root}: not empty")
    try:
        try:
            res = run_drill(cfg, args.nproc, sizes, root)
        except AssertionError as exc:
            print(f"RESUME CHECK FAILED: {exc}", flush=True)
            return 1
        for line in format_saves("uninterrupted run", res.reference):
            print(line)
        print(f"killed run: SIGKILL {res.killed_after_s:.2f} s after start, while saving step {res.kill_step}; "
              f"incomplete (no .metadata): {', '.join(res.incomplete)}; last complete: {res.resumed_from}")
        for n, info in res.resumes.items():
            for line in format_saves(f"resume at {n} rank(s)", info):
                print(line)
            c = info["checks"]
            print(f"  checks: OK, bit-identical to the uninterrupted run at step {cfg.steps}: {c['params']} parameters, "
                  f"optimizer state of {c['state_params']} parameters ({c['state_tensors']} tensors), lr and scheduler "
                  f"state of 3 leaves; no state for {len(cfg.unrouted_prefixes())} unrouted experts or the vision "
                  "leaf; no {} entries")
        print("resume drill: PASS")
        return 0
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
