"""The resume drill and a 2 -> 1 reshard with optimizer state on an accelerator (``device_type``: cuda,
npu; each skipped where absent; the CPU dry run with ``SPARSE_CKPT_TEST_DEVICE=cpu``).

* **Resume drill, in one process:** a MoE (two experts never routed: never any state) trains on the
  last device of the type (``<type>:1`` on a two-device machine) with a ``MultiOptimizer`` of fused,
  foreach or capturable AdamW leaves and a scheduler per leaf; ``dcp.async_save`` every 2 steps,
  through DCP's ``DefaultStager(StagingOptions(use_pinned_memory=True))`` (torch 2.13's stager pins
  only where CUDA is available and stages to plain host memory elsewhere, npu included: its own
  check, ``StateDictStager``); the save of step 4 is interrupted after its data
  files and before ``.metadata`` (its writer raises in ``finish``). A fresh model and optimizer on
  the same device resume from the last complete checkpoint (step 2) with ``SparseLoadPlanner`` and
  train on to step 6: parameters, state (values, dtypes, devices), lrs and scheduler state equal
  an uninterrupted run bit for bit.
* **Multi-rank drill:** ``bench/drills/resume.py`` on the device: two FSDP2 ranks on ``<type>:0`` and
  ``<type>:1`` (the device's process group: NCCL, HCCL, or the emulated npu's ``npu_gloo``), async saves,
  the save of step 6 SIGKILLed, resumed from step 4 at world sizes 2 and 1, each bit for bit the
  uninterrupted run.
* **Reshard 2 -> 1:** two Gloo ranks, each holding half of the experts (expert parallelism: no
  DTensor, so Gloo moves only the plan's CPU objects) with their state on ``<type>:<rank>``, save
  one checkpoint; one process with every expert on one device loads it and must equal a
  single-process run of the same training exactly.
* **Bench:** ``python -m bench --device <type>`` at a toy scale writes its table and plots.
"""

from __future__ import annotations

import warnings
import zlib
from pathlib import Path
from typing import Any

import _backends
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import guarded, run_ranks
from helpers import assert_optimizer_equal
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import sparse_ckpt as sc
from bench.drills import resume
from bench.suite.devices import import_npu

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

N_EXPERTS, ROUTED, DIM = 4, (0, 1), 8
VARIANTS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "capturable": {"capturable": True, "foreach": True}}


class Moe(nn.Module):
    """``embed -> experts (only :data:`ROUTED` get rows) -> head``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(N_EXPERTS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + torch.cat([self.experts[e](r) for e, r in zip(ROUTED, h.chunk(len(ROUTED)))]))


def last_device(device_type: str) -> torch.device:
    """``<type>:<count - 1>`` (cpu in the dry run): a load that lands on device 0 instead shows."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).device_count() - 1)


def build(device: torch.device, variant: str) -> tuple[Moe, sc.MultiOptimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = Moe().to(device)
    kw = VARIANTS[variant]
    experts = list(model.experts.parameters())
    dense = [p for n, p in model.named_parameters() if not n.startswith("experts.")]
    opt = sc.MultiOptimizer(
        model, {"experts": torch.optim.AdamW(experts, lr=0.01, **kw), "dense": torch.optim.AdamW(dense, lr=0.02, **kw)}
    )
    scheds = {leaf: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for leaf, o in opt.leaves()}
    return model, opt, scheds


def train(model: Moe, opt: sc.MultiOptimizer, scheds: dict[str, Any], start: int, stop: int) -> None:
    device = next(model.parameters()).device
    for step in range(start, stop):
        opt.zero_grad()
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).pow(2).mean().backward()
        opt.step()
        for s in scheds.values():
            s.step()


class InterruptedWriter(dcp.FileSystemWriter):
    """Writes the data files, then fails before ``.metadata``: what a kill mid-save leaves."""

    def finish(self, metadata: Any, results: Any) -> None:
        raise RuntimeError("interrupted before .metadata")


def _app_state(model: Moe, opt: sc.MultiOptimizer, scheds: dict[str, Any]) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt, "sched": {leaf: s.state_dict() for leaf, s in scheds.items()}}


def _stager() -> Any:
    """DCP's stager with pinned host staging (no shared memory, synchronous staging: what needs only
    ``Tensor.pin_memory`` of the current accelerator)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_drill_on_device(variant: str, device_type: str, tmp_path: Path) -> None:
    """Save every 2 steps (async, pinned staging), interrupt the save of step 4, resume from step 2 on the
    same device index: bit for bit an uninterrupted run; unrouted experts never get state."""
    if variant != "foreach" and device_type == "cpu":
        pytest.skip("fused/capturable AdamW: the CPU cases are tests/load and tests/dcp")
    device = last_device(device_type)
    model, opt, scheds = build(device, variant)
    for step in (2, 4):
        train(model, opt, scheds, step - 2, step)
        writer = (
            dcp.FileSystemWriter(tmp_path / f"step-{step}")
            if step == 2
            else InterruptedWriter(tmp_path / f"step-{step}")
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            future = dcp.async_save(
                _app_state(model, opt, scheds), storage_writer=writer, async_stager=_stager(), no_dist=True
            )
            if step == 2:
                future.result()
            else:
                with pytest.raises(CheckpointException, match="interrupted before .metadata"):
                    future.result()
    assert not (tmp_path / "step-4" / ".metadata").exists() and (tmp_path / "step-2" / ".metadata").exists()
    train(model, opt, scheds, 4, 6)  # the uninterrupted run goes on

    model2, opt2, scheds2 = build(device, variant)
    train(model2, opt2, scheds2, 0, 1)  # a resumed process has moved on from its initial values: all replaced
    app = _app_state(model2, opt2, scheds2)
    dcp.load(app, checkpoint_id=tmp_path / "step-2", planner=sc.SparseLoadPlanner(), no_dist=True)
    model2.load_state_dict(app["model"])
    for leaf, s in scheds2.items():
        s.load_state_dict(app["sched"][leaf])
    train(model2, opt2, scheds2, 2, 6)

    assert_optimizer_equal(opt, opt2, grads=False)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert p2.device == device and torch.equal(p.cpu(), p2.cpu()), name
    for leaf, o in opt2.leaves():
        for p, st in o.state.items():
            assert all(v.device == device for k, v in st.items() if k != "step" or variant != "foreach"), leaf
    unrouted = {id(p) for e in range(N_EXPERTS) if e not in ROUTED for p in model2.experts[e].parameters()}
    assert not any(id(p) in unrouted for p in opt2["experts"].state)
    assert {leaf: s.state_dict() for leaf, s in scheds.items()} == {leaf: s.state_dict() for leaf, s in scheds2.items()}


def _ep_rank(rank: int, world_size: int, device_type: str, path: str) -> None:
    """Rank ``rank`` of an expert-parallel save: experts ``rank::world_size`` and the dense layers, on
    ``<type>:<rank>`` (the dense state is the same on every rank)."""
    if device_type == "npu":
        import_npu()  # a fresh process: register the npu type as the parent did
    device = torch.device(device_type, rank) if device_type != "cpu" else torch.device("cpu")
    model, opt = _ep_model(device, [e for e in range(N_EXPERTS) if e % world_size == rank])
    _ep_train(model, opt)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=path, process_group=dist.group.WORLD)


def _ep_model(device: torch.device, experts: list[int]) -> tuple[Moe, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Moe().to(device)
    keep = [p for n, p in model.named_parameters() if not n.startswith("experts.") or int(n.split(".")[1]) in experts]
    return model, torch.optim.AdamW(keep, lr=0.01, foreach=True)


def _ep_train(model: Moe, opt: torch.optim.Optimizer) -> None:
    """Two steps with gradients from a per-FQN seed (the same on any rank layout); expert 3 gets none."""
    for step in range(2):
        for n, p in model.named_parameters():
            p.grad = (
                None
                if n.startswith("experts.3.")
                else torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode()) + step)).to(
                    p.device
                )
            )
        opt.step()


def test_reshard_two_ranks_to_one(device_type: str, tmp_path: Path, forbid_fork: None) -> None:
    """Two expert-parallel ranks with device state on ``<type>:<rank>`` save; one process with every expert on
    one device loads it and equals a single-process run exactly (expert 3: no state)."""
    if device_type != "cpu" and torch.get_device_module(device_type).device_count() < 2:
        pytest.skip(f"needs two {device_type} devices")
    run_ranks(_ep_rank, 2, device_type, str(tmp_path / "ckpt"))
    device = last_device(device_type)
    ref, ref_opt = _ep_model(device, list(range(N_EXPERTS)))
    _ep_train(ref, ref_opt)
    model, opt = _ep_model(device, list(range(N_EXPERTS)))
    dcp.load(
        {"optim": sc.SparseOptimizerState(model, opt)},
        checkpoint_id=tmp_path / "ckpt",
        planner=sc.SparseLoadPlanner(),
        no_dist=True,
    )
    model.load_state_dict(ref.state_dict())  # (the checkpoint holds the optimizer only)
    assert_optimizer_equal(ref_opt, opt, grads=False, state_order=False)  # (state in checkpoint order)
    assert all(v.device == device for st in opt.state.values() for k, v in st.items() if k != "step")
    assert not any(p in opt.state for p in model.experts[3].parameters())


def test_multi_rank_drill_on_device(device_type: str, tmp_path: Path, forbid_fork: None) -> None:
    """The resume drill of ``bench/drills/resume.py`` with FSDP2 ranks on the device (one per device, its process
    group): the killed save is incomplete and the resumes at 2 and 1 ranks equal the uninterrupted run bit for bit."""
    if device_type == "cpu":
        pytest.skip("the CPU drill is tests/benchmark/test_resume_drill.py")
    if torch.get_device_module(device_type).device_count() < 2:
        pytest.skip(f"needs two {device_type} devices")
    cfg = resume.DrillConfig(steps=8, every=2, device=device_type)  # saves at 2, 4, 6, 8; the save of 6 is killed
    result = resume.run_drill(cfg, nproc=2, resume_sizes=(2, 1), root=tmp_path, rank_fn=guarded(resume.train_run))
    assert result.incomplete == ["step-6"] and result.resumed_from == "step-4"
    assert sorted(result.resumes) == [1, 2]
    assert result.reference["device"] == device_type


@_backends.only("cpp")  # (the bench measures both core backends itself)
def test_bench_quick_on_device(device_type: str, tmp_path: Path) -> None:
    """``python -m bench --device <type>`` at a toy scale runs with state on the device: results.json names
    the device, the table (results.md) and the plots are written, no figure failed."""
    import json

    from bench.run import main

    out = tmp_path / "bench"
    rc = main(
        [
            "--device",
            device_type,
            "--scales",
            "2x8",
            "--repeats",
            "1",
            "--budget",
            "0.2",
            "--progress",
            "off",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["device"] == device_type
    assert (out / "results.md").read_text().count("|") > 10
    assert sorted(p.name for p in out.glob("*.png")), sorted(p.name for p in out.iterdir())
