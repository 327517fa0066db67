"""verl 0.9.1's ``FSDPCheckpointManager`` and ``integrations.dsd``: its fsdp engine's AdamW and its
VeOmni engine's ``MultiOptimizer`` (VeOmni 0.1.12).

The trainer drill (:mod:`trainer_drill`) with the real packages: 2 Gloo ranks, FSDP2 over a CPU mesh,
the MoE of :mod:`dsd_moe` (as verl's engines hold it: a model with an HF ``config``), a checkpoint
after step 3 through ``FSDPCheckpointManager.save_checkpoint`` (each rank ``torch.save``-s its
model shard, ``optimizer.state_dict()`` and the scheduler), ``load_checkpoint`` into fresh objects,
two more steps, compared with the uninterrupted run. The optimizers are what verl's engines build:

- fsdp engine: one torch AdamW (the drill's two groups). Its ``state_dict()`` is torch's own, not
  DSD: stock and installed alike resume bit-exactly with 22 states (``install()`` changes nothing).
- VeOmni engine: VeOmni's ``MultiOptimizer`` (leaves ``non_extra_parallel`` and ``vit``, the tower),
  whose ``state_dict``/``load_state_dict`` call DSD's functions (``load_state_dict`` gives every leaf
  the same merged flat dict). Stock "works" but not exactly: DSD's synthetic step gives the ``vit``
  leaf state at save, and verl's ``_backfill_optimizer_state`` fills the fresh optimizer's invented
  state in at load: 40 parameters with state (18 invented). With ``install()``: 22, bit-exact, lrs
  kept; the stock checkpoint still loads (a call that works with stock DSD keeps working), as it is:
  24 states (the 22 and the ``vit`` leaf's 2 that DSD invented at save), nothing invented at load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install --no-deps -r .ci/requirements-verl.txt)")
pytest.importorskip("veomni", reason="veomni is not installed (pip install --no-deps -r .ci/requirements-veomni.txt)")

import _backends
import dsd_moe
import torch
from _dist import MULTI_RANK, assert_snapshots_equal, cpu_mesh, full_snapshot, run_ranks
from trainer_drill import SAVE_AT, STEPS, parallelize

pytestmark = [
    pytest.mark.slow,  # a trainer drill: the fast tier (-m 'not slow') leaves it out
    *MULTI_RANK,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
]
KINDS = ("fsdp", "veomni")


class VerlMoe(dsd_moe.Moe):
    """The drill MoE with what verl's checkpoint manager reads of an HF model (``config``, ``can_generate``)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig()

    def can_generate(self) -> bool:
        return False


def fresh(kind: str) -> tuple[Any, Any, Any]:
    """Model, optimizer and scheduler as verl's ``kind`` engine builds them."""
    torch.manual_seed(0)
    model = parallelize(VerlMoe(), cpu_mesh())
    if kind == "fsdp":
        optimizer: Any = dsd_moe.optimizer(model)
        return model, optimizer, dsd_moe.scheduler(optimizer)
    from veomni.optim.optimizer import MultiOptimizer

    vision = [p for n, p in model.named_parameters() if n.startswith("vision.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("vision.")]
    leaves = {
        "non_extra_parallel": torch.optim.AdamW(rest, lr=0.01),
        "vit": torch.optim.AdamW(vision, lr=dsd_moe.VISION_LR),
    }
    optimizer = MultiOptimizer(model, leaves, key_names=list(leaves))
    return model, optimizer, _Schedulers([_lambda(leaves["non_extra_parallel"], 0.9), _lambda(leaves["vit"], 0.5)])


def _lambda(opt: torch.optim.Optimizer, factor: float) -> Any:
    """:func:`dsd_moe.scheduler`'s factor for one leaf (0.9 per step, the tower's 0.5)."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor**s)


class _Schedulers:
    """One scheduler per VeOmni leaf (as VeOmni's ``MultiLRScheduler``), ``state_dict`` per leaf."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> list[dict[str, Any]]:
        return [s.state_dict() for s in self.schedulers]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for s, st in zip(self.schedulers, states):
            s.load_state_dict(st)


def leaves_of(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    sub = getattr(optimizer, "optimizers_dict", None)
    return dict(sub) if sub is not None else {"optim": optimizer}


def train(model: Any, optimizer: Any, scheduler: Any, steps: range, rank: int) -> None:
    """verl's step: forward/backward, ``optimizer.step()``, scheduler, ``zero_grad()``."""
    for step in steps:
        x, y = dsd_moe.batch(step, rank)
        model(x, y)["loss"].backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def outcome(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    leaves = leaves_of(optimizer)
    snap = full_snapshot(model, leaves)
    states = scheduler.state_dict() if isinstance(scheduler, _Schedulers) else [scheduler.state_dict()]
    snap["sched"] = [{k: v for k, v in st.items() if k != "lr_lambdas"} for st in states]
    snap["with_state"] = sum(len(o.state) for o in leaves.values())
    snap["lrs"] = [g["lr"] for o in leaves.values() for g in o.param_groups]
    return snap


def manager(model: Any, optimizer: Any, scheduler: Any) -> Any:
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    return FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=scheduler)


def run(kind: str, path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train to :data:`SAVE_AT`, save through verl, resume into fresh objects from ``path`` (the
    checkpoint just written, unless ``path`` already holds one), train to :data:`STEPS`."""
    model, optimizer, scheduler = fresh(kind)
    train(model, optimizer, scheduler, range(SAVE_AT), rank)
    at_save = len([1 for o in leaves_of(optimizer).values() for _ in o.state])
    if not (path / "extra_state_world_size_2_rank_0.pt").exists():
        manager(model, optimizer, scheduler).save_checkpoint(str(path), global_step=SAVE_AT)
    model, optimizer, scheduler = fresh(kind)
    manager(model, optimizer, scheduler).load_checkpoint(str(path))
    after_load = sum(len(o.state) for o in leaves_of(optimizer).values())
    train(model, optimizer, scheduler, range(SAVE_AT, STEPS), rank)
    return outcome(model, optimizer, scheduler), {"at_save": at_save, "after_load": after_load}


def assert_exact(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert got["with_state"] == dsd_moe.STEPPED, f"{where}: {got['with_state']} parameters with state"
    assert got["lrs"] == want["lrs"] and got["sched"] == want["sched"], f"{where}: lrs {got['lrs']} vs {want['lrs']}"
    assert_snapshots_equal(got, want, where, state_key_order=False)


def drill(rank: int, world_size: int, root: str) -> None:
    import sparse_ckpt.integrations.dsd as sc_dsd

    references = {}
    for kind in KINDS:
        model, optimizer, scheduler = fresh(kind)
        train(model, optimizer, scheduler, range(STEPS), rank)
        references[kind] = outcome(model, optimizer, scheduler)

    stock_fsdp, _ = run("fsdp", Path(root) / "stock-fsdp", rank)
    assert_exact(stock_fsdp, references["fsdp"], "fsdp engine, stock")  # torch's own state_dict: exact
    stock_veomni, counts = run("veomni", Path(root) / "stock-veomni", rank)
    assert stock_veomni["with_state"] == dsd_moe.PARAMS, stock_veomni["with_state"]  # 18 invented
    assert stock_veomni["lrs"] == references["veomni"]["lrs"]

    sc_dsd.install()  # after verl's and VeOmni's imports: the usual order
    for kind in KINDS:
        got, counts = run(kind, Path(root) / f"installed-{kind}", rank)
        assert counts["after_load"] == dsd_moe.STEPPED, (kind, counts)
        assert_exact(got, references[kind], f"{kind} engine, installed")
    # the stock checkpoint still loads, as it is: the 22 real states and the 2 DSD invented for the
    # `vit` leaf at save (nothing invented at load); everything stock's resume has for them, equal
    got, _ = run("veomni", Path(root) / "stock-veomni", rank)
    assert got["with_state"] == dsd_moe.STEPPED + 2, got["with_state"]
    assert got["lrs"] == references["veomni"]["lrs"], (got["lrs"], references["veomni"]["lrs"])
    cut = {leaf: {f: v for f, v in st.items() if f in got["state"][leaf]} for leaf, st in stock_veomni["state"].items()}
    assert_snapshots_equal(
        got, {**stock_veomni, "state": cut}, "installed load of the stock checkpoint", state_key_order=False
    )
    sc_dsd.uninstall()


@_backends.only(_backends.DEFAULT)
def test_verl_fsdp_checkpoint_manager_resumes_exactly_with_dsd_install(tmp_path: Path) -> None:
    """verl's FSDPCheckpointManager, both engines' optimizers: stock (fsdp exact; VeOmni 40 states)
    vs ``install()`` (both: 22 states, lrs kept, the next 2 steps bit-exact; the stock checkpoint
    still loads as stock loads it)."""
    run_ranks(drill, 2, str(tmp_path), timeout=300)
