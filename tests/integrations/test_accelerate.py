"""Hugging Face Accelerate with the real package: ``Accelerator.save_state``/``load_state`` on FSDP2.

A 2-rank Gloo drill (spawned ranks, explicit CPU mesh) with a model of a ``dense`` layer and a
``vision`` layer that never gets a gradient, AdamW with one group each, and a LambdaLR moving
both lrs:

1. stock Accelerate, pinned so that an upstream change shows up here: saving before the first
   step creates ``step=1`` state in the live optimizer (0 -> 4 parameters), and ``load_state`` of a
   trained run fails with ``Missing key in checkpoint state_dict: optimizer.state.vision.weight.step``,
   leaving DSD's synthetic state in the fresh optimizer;
2. with :func:`sparse_ckpt.integrations.accelerate.install`: saving invents nothing and changes
   nothing; ``load_state`` into a fresh run restores parameters, optimizer state (none for
   ``vision``), both lrs and the scheduler, and the next steps are bit-identical to the
   uninterrupted run; the stock checkpoint of (1) loads the same way (the migration path);
3. the cross-rank hazard: ``register_for_checkpointing`` of a sparse_ckpt Stateful is refused
   (installed); without the integration ``save_state`` refuses it, and a file that rank 0 pickled
   is refused by ``load_custom_state`` on rank 1.

Accelerate runs FSDP only on accelerator devices; on CPU it picks ``MULTI_CPU`` (DDP). The drill
forces FSDP2 by setting the distributed type explicitly: the recipe of docs/integrations/hugging-face.md, which
the drill runs as written, like that page's usage block. Skipped when accelerate is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import tools

accelerate = pytest.importorskip(
    "accelerate", reason="accelerate is not installed (pip install --no-deps -r .ci/requirements-accelerate.txt)"
)

import _backends
from _dist import assert_snapshots_equal, full_snapshot, run_ranks
from doc_blocks import ROOT, python_blocks, run_block

from sparse_ckpt.integrations import accelerate as integration

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

PAGE = ROOT / "docs/integrations/hugging-face.md"
SECTION = "Accelerate"
LR = 0.01
LAMBDAS = (lambda s: 0.5**s, lambda s: 0.25**s)  # dense, vision


class Net(nn.Module):
    """``dense`` is trained; ``vision`` (a frozen-in-practice tower) never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.vision = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


def doc_blocks() -> list[Any]:
    """The two ``python`` blocks of docs/integrations/hugging-face.md's "Accelerate": the usage and the CPU recipe."""
    blocks = python_blocks(PAGE, SECTION)
    assert len(blocks) == 2, f"'## {SECTION}' of {PAGE.name} has {len(blocks)} python blocks"
    return blocks


_recipe: dict[str, Any] = {}


def fsdp2_accelerator(world_size: int) -> Any:
    """The docs' ``fsdp2_accelerator`` (its CPU recipe, run as written): FSDP2 on CPU over a CPU mesh."""
    if not _recipe:
        run_block(doc_blocks()[1], _recipe)
    return _recipe["fsdp2_accelerator"](world_size)


def prepared(world_size: int, seed: int = 0) -> tuple[Any, nn.Module, Any, Any]:
    """A fresh run: accelerator, FSDP2 model, ``AcceleratedOptimizer`` (AdamW: dense, vision) and scheduler."""
    acc = fsdp2_accelerator(world_size)
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW([{"params": model.dense.parameters()}, {"params": model.vision.parameters()}], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, list(LAMBDAS))
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def train(acc: Any, model: nn.Module, opt: Any, sched: Any, steps: int, first: int) -> None:
    for step in range(first, first + steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        acc.backward(model(x).pow(2).mean())
        opt.step()
        sched.step()
        opt.zero_grad()


def snapshot(model: nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    snap = full_snapshot(model, opt)  # the AcceleratedOptimizer is unwrapped like any container
    snap["sched"] = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    return snap


def same(a: dict[str, Any], b: dict[str, Any], where: str, *, state_key_order: bool = True) -> None:
    assert_snapshots_equal(a, b, where, state_key_order=state_key_order)
    assert a["sched"] == b["sched"], f"{where}: scheduler {a['sched']} vs {b['sched']}"


def stateless(opt: Any, model: nn.Module) -> bool:
    return all(p not in opt.optimizer.state for p in model.vision.parameters())


def drill(rank: int, world_size: int, root_dir: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    from accelerate.checkpointing import load_custom_state
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(root_dir)
    # ---------------------------------------------------------------- 1. stock Accelerate (pinned)
    acc, model, opt, sched = prepared(world_size)
    acc.save_state(root / "stock_first")
    assert len(opt.optimizer.state) == 4  # the save ran DSD's synthetic step: step=1 state for all 4

    acc, model, opt, sched = prepared(world_size)
    train(acc, model, opt, sched, 2, first=0)
    at_save = snapshot(model, opt, sched)
    acc.save_state(root / "stock")
    acc, model, opt, sched = prepared(world_size, seed=1)
    with pytest.raises(
        CheckpointException, match=r"Missing key in checkpoint state_dict: optimizer\.state\.vision\.weight\.step"
    ):
        acc.load_state(root / "stock")
    assert len(opt.optimizer.state) == 4  # the failed load left DSD's invented state behind
    assert [g["lr"] for g in opt.param_groups] == [LR, LR]  # and the fresh lrs: vision's moved lr is lost

    # ---------------------------------------------------------------- 2. with the integration
    os.chdir(root)  # the docs' usage block, as written (it calls install())
    torch.manual_seed(0)
    net = Net()
    adam = torch.optim.AdamW([{"params": net.dense.parameters()}, {"params": net.vision.parameters()}], lr=LR)
    names = {
        "accelerator": fsdp2_accelerator(world_size),
        "model": net,
        "optimizer": adam,
        "scheduler": torch.optim.lr_scheduler.LambdaLR(adam, list(LAMBDAS)),
    }
    run_block(doc_blocks()[0], names)
    assert integration.installed()
    report = tools.inspect_checkpoint(root / "ckpt" / "accelerate" / "optimizer_0")["optimizers"][0]
    assert (report["key"], report["format"], report["with_state"]) == ("optimizer", "packed", 0)
    integration.install()  # idempotent
    acc, model, opt, sched = prepared(world_size)
    acc.save_state(root / "sparse_first")
    assert not opt.optimizer.state  # nothing invented

    acc, model, opt, sched = prepared(world_size)
    train(acc, model, opt, sched, 2, first=0)
    before = snapshot(model, opt, sched)
    same(before, at_save, "the same training as the stock run")
    acc.save_state(root / "sparse")
    same(snapshot(model, opt, sched), before, "live optimizer after save")  # the save changed nothing
    train(acc, model, opt, sched, 2, first=2)
    uninterrupted = snapshot(model, opt, sched)

    for source in ("sparse", "stock"):  # stock: Accelerate's own (DSD nested) checkpoint, migrated
        acc, model, opt, sched = prepared(world_size, seed=1)
        acc.load_state(root / source)
        # after a multi-rank load the key order inside one parameter's state follows DCP's metadata
        same(snapshot(model, opt, sched), at_save, f"{source}: resumed", state_key_order=False)
        assert len(opt.optimizer.state) == 2 and stateless(opt, model)
        assert [g["lr"] for g in opt.param_groups] == at_save["sched"]["_last_lr"] and opt.param_groups[1]["lr"] < LR
        train(acc, model, opt, sched, 2, first=2)
        same(snapshot(model, opt, sched), uninterrupted, f"{source}: next steps", state_key_order=False)

    # a value no format holds is refused before save_state writes anything (Accelerate writes the
    # models first, so a refusal after them would leave a partial checkpoint)
    acc, model, opt, sched = prepared(world_size)
    opt.param_groups[1]["schedule"] = object()
    with pytest.raises(sc.CheckpointFormatError, match="group 1 key 'schedule': unsupported value type object"):
        acc.save_state(root / "refused")
    assert not (root / "refused").exists()

    # ---------------------------------------------------------------- 3. the cross-rank hazard
    with pytest.raises(sc.CrossRankStateError, match="do not register it"):
        acc.register_for_checkpointing(sc.SparseOptimizerState(model, opt))
    integration.uninstall()
    assert accelerate.accelerator.save_fsdp_optimizer is accelerate.utils.fsdp_utils.save_fsdp_optimizer
    assert not integration.installed()

    acc, model, opt, sched = prepared(world_size)
    train(acc, model, opt, sched, 1, first=0)
    state = sc.SparseOptimizerState(model, opt)  # the AcceleratedOptimizer itself, as users pass it
    acc.register_for_checkpointing(state)
    with pytest.raises(sc.CrossRankStateError, match="register_for_checkpointing"):
        acc.save_state(root / "registered")  # refused before the custom object is written
    assert not (root / "registered" / "custom_checkpoint_0.pkl").exists()
    pickled = root / "pickled"
    if rank == 0:  # what save_custom_state writes: the main process's dict, pickled
        pickled.mkdir()
        torch.save(state.state_dict(), pickled / "custom_checkpoint_0.pkl")
    dist.barrier()
    kept = snapshot(model, opt, sched)
    if rank == 0:
        load_custom_state(state, str(pickled), 0)  # its own dict: fine
    else:
        with pytest.raises(sc.CrossRankStateError, match=r"made on rank 0 of 2 and is being loaded on rank 1 of 2"):
            load_custom_state(state, str(pickled), 0)
    same(snapshot(model, opt, sched), kept, "after loading the pickled dict")


def test_docs_section_has_its_two_blocks() -> None:
    usage, recipe = doc_blocks()
    assert "sc_accelerate.install()" in usage.code and "def fsdp2_accelerator(" in recipe.code


@pytest.mark.slow  # a trainer drill
@_backends.only(_backends.DEFAULT)
def test_accelerate_fsdp2_save_state_load_state_drill(tmp_path: Path) -> None:
    """Once, on the default core (C++ where built): most of the drill's time is starting ranks."""
    run_ranks(drill, 2, str(tmp_path), timeout=300)


# --------------------------------------------------------------------------- one process


@pytest.fixture
def restore() -> Any:
    yield
    integration.uninstall()


def test_install_is_idempotent_and_undone(restore: Any) -> None:
    acc_mod = importlib.import_module("accelerate.accelerator")
    utils = importlib.import_module("accelerate.utils")
    fsdp_utils = importlib.import_module("accelerate.utils.fsdp_utils")
    stock = (acc_mod.save_fsdp_optimizer, acc_mod.load_fsdp_optimizer, acc_mod.Accelerator.register_for_checkpointing)
    for _ in range(2):
        integration.install()
        for module in (acc_mod, utils, fsdp_utils):
            assert module.save_fsdp_optimizer is integration.save_fsdp_optimizer
            assert module.load_fsdp_optimizer is integration.load_fsdp_optimizer
        assert acc_mod.Accelerator.register_for_checkpointing.__wrapped__ is stock[2]
    integration.uninstall()
    integration.uninstall()
    assert (
        acc_mod.save_fsdp_optimizer,
        acc_mod.load_fsdp_optimizer,
        acc_mod.Accelerator.register_for_checkpointing,
    ) == stock
    assert utils.save_fsdp_optimizer is fsdp_utils.save_fsdp_optimizer is stock[0]
    with pytest.raises(ValueError, match="format"):
        integration.install(format="nested")  # type: ignore[arg-type]
    assert not integration.installed()


def test_install_refuses_an_accelerate_whose_functions_changed(restore: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    acc_mod = importlib.import_module("accelerate.accelerator")

    def save_fsdp_optimizer(fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index=0):  # type: ignore[no-untyped-def]
        pass

    monkeypatch.setattr(acc_mod, "save_fsdp_optimizer", save_fsdp_optimizer)
    with pytest.raises(RuntimeError, match="expected .*use_dcp.*nothing was installed"):
        integration.install()
    assert not integration.installed() and acc_mod.save_fsdp_optimizer is save_fsdp_optimizer


def test_other_configurations_stay_accelerates(restore: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP1, FULL_STATE_DICT and use_dcp=False are handed to Accelerate's own functions."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    acc_mod = importlib.import_module("accelerate.accelerator")
    for name in ("save_fsdp_optimizer", "load_fsdp_optimizer"):
        fn = getattr(acc_mod, name)

        def stub(*args: Any, _name: str = name) -> None:
            calls.append((_name, args))

        stub.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
        monkeypatch.setattr(acc_mod, name, stub)
    integration.install()

    class Plugin:
        def __init__(self, version: int, kind: str) -> None:
            self.fsdp_version = version
            self.state_dict_type = type("T", (), {"name": kind})()

    for plugin, use_dcp in (
        (Plugin(1, "SHARDED_STATE_DICT"), True),
        (Plugin(2, "FULL_STATE_DICT"), True),
        (Plugin(2, "SHARDED_STATE_DICT"), False),
    ):
        acc_mod.save_fsdp_optimizer(plugin, None, None, None, "out", 0, use_dcp)
        acc_mod.load_fsdp_optimizer(plugin, None, None, None, "out", 0, False, use_dcp)
    assert [name for name, _ in calls] == ["save_fsdp_optimizer", "load_fsdp_optimizer"] * 3


def test_importing_the_integration_does_not_import_accelerate() -> None:
    code = (
        "import sys, sparse_ckpt.integrations.accelerate as m; "
        "assert 'accelerate' not in sys.modules, 'imported'; print(m.installed())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
