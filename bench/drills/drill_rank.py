"""What every rank of the resume drill runs (:func:`train_run`), and the DCP ``Stateful`` app state it saves.

One run on one rank: (resume from the newest complete checkpoint,) train with ``dcp.async_save``
every ``every`` steps on a dedicated Gloo group, optionally stall one save (:class:`StallingWriter`,
so the run can be SIGKILLed mid-save), and write ``timings.json`` and ``snapshot.pt`` on rank 0.
See :mod:`.resume` for the drill that starts these ranks and checks their results.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LRScheduler

import sparse_ckpt as sc

from ..suite.devices import current_device, synchronize
from .drill_model import DrillConfig, build, make_batch

SNAPSHOT = "snapshot.pt"
TIMINGS = "timings.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
"""A checkpoint directory of a run: ``step-<n>``."""


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
            match = STEP_DIR.match(entry.name)
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


def snapshot(model: nn.Module, mo: sc.MultiOptimizer, scheds: Mapping[str, LRScheduler], step: int) -> dict[str, Any]:
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
                {
                    "step": step,
                    "wait_prev_s": t2 - t1,
                    "async_save_s": t3 - t2,
                    "mean_step_s": sum(window) / len(window),
                    "steps": len(window),
                }
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
