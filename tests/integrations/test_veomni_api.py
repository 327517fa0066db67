"""VeOmni's objects (the real package) given to sparse_ckpt in one process: what works, what is refused and
how, ``install``/``uninstall``, and the example of docs/integrations/veomni.md run as written (a 1-rank Gloo group).

Skipped when veomni is not installed (``pip install --no-deps -r .ci/requirements-veomni.txt``).
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import free_port
from doc_blocks import ROOT, python_blocks, run_block
from helpers import IdentitySnapshot, same_bits
from torch import nn

import sparse_ckpt as sc

if importlib.util.find_spec("veomni") is None:
    pytest.skip(
        "veomni is not installed (pip install --no-deps -r .ci/requirements-veomni.txt)", allow_module_level=True
    )

from veomni.checkpoint import build_checkpointer
from veomni.checkpoint.dcp_checkpointer import DistributedCheckpointer, ModelState, OptimizerState
from veomni.optim import build_lr_scheduler
from veomni.optim.optimizer import MultiOptimizer

import sparse_ckpt.integrations.veomni as sc_veomni

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.tower = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # the tower gets no gradient: its leaf never steps


def build(seed: int = 0) -> tuple[Net, MultiOptimizer, Any]:
    """VeOmni's MultiOptimizer (leaves ``body``, ``vit``) and its linear scheduler (lr 0.01 over 4 steps)."""
    torch.manual_seed(seed)
    model = Net()
    optimizers = {
        "body": torch.optim.AdamW(model.body.parameters(), lr=0.01),
        "vit": torch.optim.AdamW(model.tower.parameters(), lr=0.01),
    }
    mo = MultiOptimizer(model, optimizers, key_names=list(optimizers))
    return model, mo, build_lr_scheduler(mo, train_steps=4, lr=0.01, lr_decay_style="linear")


def step(model: Net, mo: MultiOptimizer, scheduler: Any, seed: int) -> None:
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
    mo.step()
    scheduler.step()
    mo.zero_grad()


def trained() -> tuple[Net, MultiOptimizer, Any]:
    """Three steps: ``vit`` has no state and lr 0.0025."""
    model, mo, scheduler = build()
    for i in range(3):
        step(model, mo, scheduler, i)
    assert mo.optimizers_dict["vit"].param_groups[0]["lr"] == 0.0025 and not mo.optimizers_dict["vit"].state
    return model, mo, scheduler


def test_sparse_state_dict_takes_veomnis_multioptimizer() -> None:
    """Leaves named by key_names; the same dict as for its optimizers_dict; the live optimizer untouched."""
    model, mo, _ = trained()
    snap = IdentitySnapshot(model, list(mo.optimizers_dict.values()))
    sd = sc.sparse_state_dict(model, mo)
    snap.assert_unchanged(model)
    assert sd.keys() == sc.sparse_state_dict(model, mo.optimizers_dict).keys()
    assert {k.split(".")[2] for k in sd if k.startswith("param_groups.__packed__.")} == {"body", "vit"}


def test_load_sparse_state_dict_into_veomnis_multioptimizer() -> None:
    model, mo, scheduler = trained()
    sd = copy.deepcopy(sc.sparse_state_dict(model, mo))  # as read back (the dict shares the live tensors)
    model2, mo2, scheduler2 = build(seed=1)
    model2.load_state_dict(model.state_dict())
    sc.load_sparse_state_dict(model2, mo2, sd)
    scheduler2.load_state_dict(scheduler.state_dict())
    assert mo2.optimizers_dict["vit"].param_groups[0]["lr"] == 0.0025
    assert not mo2.optimizers_dict["vit"].state  # nothing invented
    for i in (3, 4):  # the next steps are bit-exact
        step(model, mo, scheduler, i)
        step(model2, mo2, scheduler2, i)
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("call", ["SparseOptimizerState", "sparse_state_dict", "load_sparse_state_dict"])
def test_veomnis_optimizer_wrapper_is_refused_naming_its_attribute(call: str) -> None:
    """VeOmni's OptimizerState (a DCP Stateful around the optimizer) is not an optimizer: the error says
    to pass what it holds at ``.optimizer``."""
    model, mo, _ = trained()
    wrapper = OptimizerState(model, mo)
    snap = IdentitySnapshot(model, list(mo.optimizers_dict.values()))
    with pytest.raises(
        TypeError, match=r"got OptimizerState; it holds optimizer\(s\) at `\.optimizer` \(a MultiOptimizer\)"
    ):
        if call == "SparseOptimizerState":
            sc.SparseOptimizerState(model, wrapper)
        elif call == "sparse_state_dict":
            sc.sparse_state_dict(model, wrapper)
        else:
            sc.load_sparse_state_dict(model, wrapper, sc.sparse_state_dict(model, mo))
    snap.assert_unchanged(model)


def test_veomnis_scheduler_and_model_wrapper_are_refused() -> None:
    model, mo, scheduler = trained()
    with pytest.raises(sc.UnsupportedStateDictError, match="leaf 'body': LambdaLR is not a torch.optim.Optimizer"):
        sc.SparseOptimizerState(model, scheduler)  # VeOmni's MultiLRScheduler: a dict of schedulers
    with pytest.raises(TypeError, match="model must be an nn.Module .*got ModelState"):
        sc.SparseOptimizerState(ModelState(model), mo)


def test_installed_save_refuses_a_wrong_optimizer_before_writing(tmp_path: Path) -> None:
    model, _mo, scheduler = trained()
    checkpointer = sc_veomni.sparse_checkpointer_class()
    with pytest.raises(sc.UnsupportedStateDictError, match="LambdaLR is not a torch.optim.Optimizer"):
        checkpointer.save(str(tmp_path / "ckpt"), {"model": model, "optimizer": scheduler}, global_steps=3)
    assert not (tmp_path / "ckpt").exists()


def test_install_is_idempotent_and_undone() -> None:
    assert build_checkpointer("dcp", "fsdp2") is DistributedCheckpointer
    with sc_veomni.install() as handle:
        sc_veomni.install()
        assert sc_veomni.installed()
        sparse = build_checkpointer("dcp", "fsdp2")
        assert sparse is build_checkpointer("dcp", "ddp") is sc_veomni.sparse_checkpointer_class()
        assert issubclass(sparse, DistributedCheckpointer) and sparse is not DistributedCheckpointer
        with pytest.raises(ValueError, match="Unsupported distributed backend"):  # VeOmni's own check
            build_checkpointer("dcp", "megatron")
        assert sparse is sc_veomni.SparseDistributedCheckpointer and not sparse.migrate_stock_checkpoints
        sc_veomni.install(migrate_stock=True)
        migrating = build_checkpointer("dcp", "fsdp2")
        assert migrating.migrate_stock_checkpoints and issubclass(migrating, sc_veomni.SparseDistributedCheckpointer)
        handle.remove()
        handle.remove()
        assert not sc_veomni.installed()
    assert build_checkpointer("dcp", "fsdp2") is DistributedCheckpointer
    sc_veomni.uninstall()  # not installed: no error
    assert build_checkpointer("dcp", "fsdp2") is DistributedCheckpointer


def test_other_dcp_overrides_are_not_wrapped() -> None:
    with pytest.raises(TypeError, match="wraps VeOmni's DistributedCheckpointer"):
        sc_veomni.sparse_checkpointer_class(type("MyCheckpointer", (), {}))


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A 1-rank Gloo group in this process (VeOmni's checkpointer needs one), and VeOmni's CPU no-op."""
    monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)  # VeOmni calls it after a save
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_docs_veomni_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_rank_group: None) -> None:
    (block,) = python_blocks(ROOT / "docs/integrations/veomni.md", "The lines")
    monkeypatch.chdir(tmp_path)
    model, optimizer, scheduler = trained()
    model2, optimizer2, _ = build(seed=1)
    namespace: dict[str, Any] = {
        "__name__": "docs",
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "model2": model2,
        "optimizer2": optimizer2,
    }
    try:
        run_block(block, namespace)
    finally:
        sc_veomni.uninstall()
    assert (tmp_path / "ckpt/global_step_3/.metadata").is_file()
    assert namespace["state"]["extra_state"]["global_step"] == 3
    assert optimizer2.optimizers_dict["vit"].param_groups[0]["lr"] == 0.0025
    assert not optimizer2.optimizers_dict["vit"].state
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- the checkpointer, one rank


def test_trainable_only_stage_dir_and_model_only(tmp_path: Path, one_rank_group: None) -> None:
    """VeOmni's save/load options behave as stock VeOmni's: trainable_only (frozen weights neither saved
    nor required), stage_dir (written there, then promoted), a checkpoint without an optimizer."""
    model, mo, _ = trained()
    model.tower.requires_grad_(False)  # a LoRA-style frozen base: not in the optimizer
    opt = mo.optimizers_dict["body"]
    sparse = sc_veomni.sparse_checkpointer_class()
    sparse.save(
        str(tmp_path / "ckpt"),
        {"model": model, "optimizer": opt},
        trainable_only=True,
        stage_dir=str(tmp_path / "stage"),
    )
    assert (tmp_path / "ckpt/.metadata").is_file() and not any((tmp_path / "stage").iterdir())
    model2, mo2, _ = build(seed=1)
    frozen = model2.tower.weight.detach().clone()
    sparse.load(
        str(tmp_path / "ckpt"), {"model": model2, "optimizer": mo2.optimizers_dict["body"]}, trainable_only=True
    )
    assert torch.equal(model2.body.weight, model.body.weight) and torch.equal(model2.tower.weight, frozen)
    assert mo2.optimizers_dict["body"].param_groups[0]["lr"] == 0.0025
    model3, mo3, _ = build(seed=1)
    with pytest.raises(BaseException, match=r"model\.tower\.weight"):  # DCP's CheckpointException, as stock's
        sparse.load(str(tmp_path / "ckpt"), {"model": model3, "optimizer": mo3.optimizers_dict["body"]})
    sparse.save(str(tmp_path / "model_only"), {"model": model})
    with pytest.raises(sc.CheckpointMismatchError, match="has no optimizer"):
        sparse.load(str(tmp_path / "model_only"), {"model": model3, "optimizer": mo3})
    sparse.load(str(tmp_path / "model_only"), {"model": model3})
    assert torch.equal(model3.body.weight, model.body.weight)


def test_save_and_load_have_veomnis_signatures_and_pass_its_arguments_on(
    tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overrides take what VeOmni's save/load take (a bad call fails as VeOmni's does), hand a
    parameter a later VeOmni adds to its save, and refuse a load parameter they do not implement."""
    import inspect

    sparse = sc_veomni.sparse_checkpointer_class()
    for name in ("save", "load"):
        assert inspect.signature(getattr(sparse, name)) == inspect.signature(getattr(DistributedCheckpointer, name))
    model, mo, _ = trained()
    with pytest.raises(TypeError, match="multiple values for argument 'save_async'"):
        sparse.save(str(tmp_path / "a"), {"model": model, "optimizer": mo}, False, save_async=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'new_option'"):
        sparse.save(str(tmp_path / "a"), {"model": model, "optimizer": mo}, new_option=1)
    assert not (tmp_path / "a").exists()

    received: dict[str, Any] = {}
    stock_save = DistributedCheckpointer.save.__func__

    def later(stock: Any) -> inspect.Signature:
        """``stock``'s signature with the parameter ``new_option: int = 0`` a later VeOmni might add."""
        signature = inspect.signature(stock)
        added = inspect.Parameter("new_option", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=0, annotation=int)
        return signature.replace(parameters=[*signature.parameters.values(), added])

    def save(cls: type, *args: Any, new_option: int = 0, **kwargs: Any) -> None:
        received["new_option"] = new_option
        stock_save(cls, *args, **kwargs)

    save.__signature__ = later(stock_save)  # type: ignore[attr-defined]
    monkeypatch.setattr(DistributedCheckpointer, "save", classmethod(save))
    sparse.save(str(tmp_path / "b"), {"model": model, "optimizer": mo}, new_option=7)
    assert received == {"new_option": 7} and (tmp_path / "b/.metadata").is_file()

    def load(cls: type, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise AssertionError("not reached")

    load.__signature__ = later(DistributedCheckpointer.load.__func__)  # type: ignore[attr-defined]
    monkeypatch.setattr(DistributedCheckpointer, "load", classmethod(load))
    model2, mo2, _ = build(seed=1)
    with pytest.raises(TypeError, match=r"takes \['new_option'\], which sparse_ckpt.integrations.veomni does not"):
        sparse.load(str(tmp_path / "b"), {"model": model2, "optimizer": mo2})
    assert not mo2.optimizers_dict["body"].state


def test_ddp_backend(tmp_path: Path, one_rank_group: None) -> None:
    """build_checkpointer("dcp", "ddp"): a DDP-wrapped model (FQNs without ``module.``) resumes exactly."""
    model, mo, _ = trained()
    with sc_veomni.install():
        checkpointer = build_checkpointer("dcp", "ddp")
        ddp = nn.parallel.DistributedDataParallel(model)
        checkpointer.save(str(tmp_path / "ckpt"), {"model": ddp, "optimizer": mo}, global_steps=3)
        model2, mo2, _ = build(seed=1)
        checkpointer.load(
            str(tmp_path / "ckpt/global_step_3"),
            {"model": nn.parallel.DistributedDataParallel(model2), "optimizer": mo2},
        )
    assert mo2.optimizers_dict["vit"].param_groups[0]["lr"] == 0.0025 and not mo2.optimizers_dict["vit"].state
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(
            mo2.optimizers_dict["body"].state[model2.body.weight][key],
            mo.optimizers_dict["body"].state[model.body.weight][key],
        )


@pytest.mark.parametrize("single", [True, False], ids=["one-AdamW-nested", "MultiOptimizer-flat"])
def test_stock_checkpoint_migration(tmp_path: Path, one_rank_group: None, single: bool) -> None:
    """Both layouts stock VeOmni writes (DSD nested for one optimizer, DSD flat for its MultiOptimizer)
    migrate: settings and state where saved, none invented, every gap reported."""
    model, mo, _ = trained()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01) if single else mo
    if single:  # one AdamW in which only body stepped (twice), tower's lr moved
        for i in range(2):
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(i))).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        optimizer.param_groups[0]["lr"] = 0.005
    DistributedCheckpointer.save(
        str(tmp_path / "stock"), {"model": model, "optimizer": optimizer, "extra_state": {"s": 1}}
    )
    model2, mo2, _ = build(seed=1)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=0.01) if single else mo2
    state = {"model": model2, "optimizer": optimizer2, "extra_state": {}}
    with pytest.warns(sc_veomni.StockCheckpointWarning, match="without saved state"):
        report = sc_veomni.load_stock_checkpoint(str(tmp_path / "stock"), state)
    assert state["extra_state"] == {"s": 1}
    gaps = {g.leaf: (g.params, g.no_settings, g.no_state) for g in report.leaves}
    if single:
        assert gaps == {"optim": (4, [], ["tower.weight", "tower.bias"])}
        assert optimizer2.param_groups[0]["lr"] == 0.005
        leaves2, leaves1 = {"optim": optimizer2}, {"optim": optimizer}
    else:
        assert gaps == {"body": (2, [], []), "vit": (2, ["tower.weight", "tower.bias"], ["tower.weight", "tower.bias"])}
        assert mo2.optimizers_dict["body"].param_groups[0]["lr"] == 0.0025
        assert mo2.optimizers_dict["vit"].param_groups[0]["lr"] == 0.01  # stock never saved it: kept, reported
        leaves2, leaves1 = mo2.optimizers_dict, mo.optimizers_dict
    assert not report.complete
    for name, opt2 in leaves2.items():
        names2 = {id(p): n for n, p in model2.named_parameters()}
        names1 = {id(p): n for n, p in model.named_parameters()}
        got = {names2[id(p)]: st for p, st in opt2.state.items()}
        want = {names1[id(p)]: st for p, st in leaves1[name].state.items()}
        assert got.keys() == want.keys(), name  # nothing invented
        for fqn, saved in want.items():
            for key, value in saved.items():
                assert torch.equal(got[fqn][key], value), (fqn, key)
    sc_veomni.sparse_checkpointer_class().save(str(tmp_path / "sparse"), {"model": model, "optimizer": optimizer})
    with pytest.raises(sc.CheckpointMismatchError, match="no optimizer saved by stock VeOmni"):
        sc_veomni.load_stock_checkpoint(str(tmp_path / "sparse"), state)


# --------------------------------------------------------------------------- what VeOmni's optimizers hold


def _anyprecision(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    """VeOmni's own ``build_optimizer(optimizer_type="anyprecision_adamw")``: torch.dtype values
    (``momentum_dtype``, ``variance_dtype``, ``compensation_buffer_dtype``) in its param groups."""
    from veomni.optim import build_optimizer

    torch.manual_seed(seed)
    model = Net()
    return model, build_optimizer(model, lr=0.01, optimizer_type="anyprecision_adamw")


def test_anyprecision_adamw_round_trips_through_veomnis_checkpointer(tmp_path: Path, one_rank_group: None) -> None:
    """``anyprecision_adamw``'s ``torch.dtype`` group settings save (not refused after VeOmni has
    written extra_state/) and resume bit-exactly through the installed checkpointer."""
    model, opt = _anyprecision(0)
    assert any(isinstance(v, torch.dtype) for g in opt.param_groups for v in g.values())
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
    with sc_veomni.install():
        checkpointer = build_checkpointer("dcp", "fsdp2")
        checkpointer.save(str(tmp_path), {"model": model, "optimizer": opt, "extra_state": {"s": 1}}, global_steps=1)
        model2, opt2 = _anyprecision(1)
        for g in opt2.param_groups:
            g.update(lr=0.5, momentum_dtype=torch.float64)
        checkpointer.load(str(tmp_path / "global_step_1"), {"model": model2, "optimizer": opt2, "extra_state": {}})
    saved = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    loaded = [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups]
    assert same_bits(loaded, saved)
    # state: torch's own load_state_dict casts floating state to the parameter's dtype (bf16 momentum
    # comes back float32, exactly); the load must give what torch's gives, to the bit
    _, torch_loaded = _anyprecision(1)
    torch_loaded.load_state_dict(opt.state_dict())
    params = [p for g in opt2.param_groups for p in g["params"]]
    assert same_bits(
        [opt2.state[p] for p in params], [torch_loaded.state[p] for g in torch_loaded.param_groups for p in g["params"]]
    )


def test_unsupported_group_value_is_refused_before_veomni_writes(tmp_path: Path, one_rank_group: None) -> None:
    """A value no format holds (an arbitrary object) is refused before any file of global_step_N exists
    (VeOmni writes extra_state/ before it calls dcp.save)."""
    model, opt = _anyprecision(0)
    opt.param_groups[0]["schedule"] = object()
    with sc_veomni.install():
        checkpointer = build_checkpointer("dcp", "fsdp2")
        with pytest.raises(sc.CheckpointFormatError, match="group 0 key 'schedule': unsupported value type object"):
            checkpointer.save(
                str(tmp_path), {"model": model, "optimizer": opt, "extra_state": {"s": 1}}, global_steps=2
            )
    assert not (tmp_path / "global_step_2").exists()


def test_stock_migration_reports_state_that_may_be_synthetic(tmp_path: Path, one_rank_group: None) -> None:
    """Reported as inexact: stock VeOmni saves a never-stepped optimizer through DSD, whose synthetic
    step invents ``step == 1`` state (Adam with weight_decay: non-zero moments); the migration loads
    it as saved and its report lists every such parameter (the resume is not exact)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)
    DistributedCheckpointer.save(str(tmp_path / "stock"), {"model": model, "optimizer": optimizer})
    assert {float(s["step"]) for s in optimizer.state.values()} == {1.0}  # stock VeOmni stepped it while saving
    model2 = Net()
    state = {"model": model2, "optimizer": torch.optim.Adam(model2.parameters(), lr=0.01, weight_decay=0.1)}
    with pytest.warns(sc_veomni.StockCheckpointWarning, match="4 loaded with step == 1 that DSD's synthetic step"):
        report = sc_veomni.load_stock_checkpoint(str(tmp_path / "stock"), state)
    assert report.complete and not report.exact
    assert report.leaves[0].possibly_synthetic == ["body.weight", "body.bias", "tower.weight", "tower.bias"]
