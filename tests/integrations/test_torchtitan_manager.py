"""``SparseCheckpointManager`` in one process (a 1-rank Gloo group, as torchtitan's manager expects
one): the stock manager's features keep working (``keep_latest_k``, ``exclude_from_loading``,
model-only and HF safetensors saves and loads, ``train_state``/``dataloader``/``lr_scheduler``),
and each wrong object or setting a torchtitan user may pass fails when the manager is built, with a
message that says what to pass instead. The real torchtitan package; skipped without it."""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install --no-deps -r .ci/requirements-torchtitan.txt)"
)

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import free_port
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig
from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

import sparse_ckpt as sc
from bench.trainers import titan_scenario as tt
from sparse_ckpt import CheckpointMismatchError
from sparse_ckpt.integrations.torchtitan import SparseCheckpointManager

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
Config = SparseCheckpointManager.Config


@pytest.fixture
def one_rank(tmp_path: Path):
    """A 1-rank Gloo process group for the test (torchtitan's manager calls ``dist.get_rank()``)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trained(steps: int = 2, seed: int = 0) -> tuple[Any, Any, Any]:
    objs = tt.build(seed)
    tt.train(*objs, range(1, steps + 1), tt.ROUTED_BEFORE, use_aux=False)
    return objs


def _state_count(optimizers) -> list[int]:
    return [len(o.state) for o in optimizers.optimizers]


def test_keep_latest_k_and_exclude_from_loading(tmp_path, one_rank) -> None:
    objs = tt.build(0)
    model = objs[0]
    mgr = tt.manager(Config, str(tmp_path), *objs, tt.TrainState(), tt.Loader(), keep_latest_k=2)
    for step in range(1, 4):
        tt.train(*objs, range(step, step + 1), tt.ROUTED_BEFORE, use_aux=False)
        mgr.states["train_state"].value = step
        assert mgr.save(step) is True
    mgr.close()  # joins the purge thread
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-3"]

    fresh = tt.build(1)
    ts, loader = tt.TrainState(), tt.Loader(5)
    mgr2 = tt.manager(Config, str(tmp_path), *fresh, ts, loader, exclude_from_loading=["optimizer", "dataloader"])
    assert mgr2.load() is True
    mgr2.close()
    assert ts.value == 3 and loader.value == 5 and fresh[2].schedulers[0].last_epoch == 3
    assert _state_count(fresh[1]) == [0, 0], "the excluded optimizer was loaded"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh[0].parameters()))

    again = tt.build(1)
    mgr3 = tt.manager(Config, str(tmp_path), *again, tt.TrainState(), load_step=2)
    assert mgr3.load(step=2) is True
    mgr3.close()
    assert _state_count(again[1]) == [0, 10] and again[2].schedulers[0].last_epoch == 2


def test_migration_report_and_log(tmp_path, one_rank, caplog) -> None:
    """One process: the never-stepped Adam's synthetic state is dropped and logged; a real first step
    (``aux`` used in step 2 only: ``step == 1``, moments not zero) is kept."""
    for aux_step, dropped in (((), ["aux.bias", "aux.weight"]), ((2,), [])):
        base = str(tmp_path / f"aux{len(aux_step)}")
        objs = tt.build(0)
        for step in (1, 2):
            tt.train(*objs, range(step, step + 1), tt.ROUTED_BEFORE, use_aux=step in aux_step)
        stock = tt.manager(CheckpointManager.Config, base, *objs, tt.TrainState(2))
        stock.save(2)
        stock.close()
        fresh = tt.build(1)
        mgr = tt.manager(
            Config, base, *fresh, tt.TrainState(), migrate_stock_checkpoints=True, drop_synthetic_state=True
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sparse_ckpt.integrations.torchtitan"):
            assert mgr.load() is True
        mgr.close()
        report = mgr.migration_report
        assert report.checkpoint_id.endswith("step-2") and sorted(d.fqn for d in report.dropped) == dropped
        assert len(fresh[1].optimizers[0].state) == 2 - len(dropped)
        messages = [r.getMessage() for r in caplog.records]
        if dropped:
            assert any("leaf 'optim0': dropped the synthetic-step state" in m and "aux.bias" in m for m in messages), (
                messages
            )
        else:
            assert [float(s["step"]) for s in fresh[1].optimizers[0].state.values()] == [1.0, 1.0]
            assert not any("dropped" in m for m in messages), messages
        assert any("leaf 'optim1': 8 parameter(s) have no state: layers.0.experts.1.weight" in m for m in messages), (
            messages
        )


class IdentityAdapter(BaseStateDictAdapter):
    """HF keys = torchtitan keys (a model adapter would rename them)."""

    def __init__(self, model_config: Any = None, hf_assets_path: str | None = None) -> None:
        self.fqn_to_index_mapping = None
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(hf_state_dict)

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> HuggingFaceStorageReader:
        return HuggingFaceStorageReader(path)


def _build(config: Any, objs: tuple, base: str, sd_adapter: Any = None) -> Any:
    return config.build(
        dataloader=tt.Loader(),
        model_parts=[objs[0]],
        optimizers=objs[1],
        lr_schedulers=objs[2],
        states={"train_state": tt.TrainState()},
        sd_adapter=sd_adapter,
        base_folder=base,
    )


def test_last_step_model_only_and_hf_paths(tmp_path, one_rank) -> None:
    objs = _trained()
    mgr = _build(
        Config(enable=True, keep_latest_k=0, last_save_in_hf=True, export_dtype="bfloat16"),
        objs,
        str(tmp_path / "hf"),
        IdentityAdapter(),
    )
    assert mgr.save(2, last_step=True) is True
    mgr.close()
    exported = tmp_path / "hf" / "checkpoint" / "step-2"
    assert (exported / "model.safetensors.index.json").is_file() and not (exported / ".metadata").exists()

    fresh = tt.build(1)
    mgr2 = _build(
        Config(enable=True, keep_latest_k=0, initial_load_path=str(exported), initial_load_in_hf=True),
        fresh,
        str(tmp_path / "empty"),
        IdentityAdapter(),
    )
    assert mgr2.load() is True
    mgr2.close()
    for (name, a), b in zip(objs[0].named_parameters(), fresh[0].parameters()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name
    assert _state_count(fresh[1]) == [0, 0]

    # model-only DCP last save, then resuming from it: refused, naming what to do
    mgr3 = _build(Config(enable=True, keep_latest_k=0), objs, str(tmp_path / "dcp"))
    mgr3.save(2, last_step=True)
    mgr3.close()
    mgr4 = _build(Config(enable=True, keep_latest_k=0), tt.build(1), str(tmp_path / "dcp"))
    with pytest.raises(CheckpointMismatchError, match=r"no 'optimizer' entries.*exclude_from_loading"):
        mgr4.load()
    mgr4.close()
    # ... and as the initial checkpoint of a new run (model only): loads
    fresh = tt.build(1)
    mgr5 = _build(
        Config(enable=True, keep_latest_k=0, initial_load_path=str(tmp_path / "dcp" / "checkpoint" / "step-2")),
        fresh,
        str(tmp_path / "new"),
    )
    assert mgr5.load() is True
    mgr5.close()
    assert all(torch.equal(a, b) for a, b in zip(objs[0].parameters(), fresh[0].parameters()))


def test_pinned_memory_async_needs_an_accelerator(tmp_path, one_rank) -> None:
    if torch.accelerator.is_available():
        pytest.skip("this host has an accelerator: async_with_pinned_mem is exercised by the GPU check")
    config = Config(enable=True, async_mode="async_with_pinned_mem")
    with pytest.raises(ValueError, match=r"async_with_pinned_mem.*needs an accelerator.*async_mode='async'"):
        _build(config, _trained(), str(tmp_path))
    # The stock manager builds and fails its first save instead (pinned: an upstream change is noticed).
    stock = _build(CheckpointManager.Config(enable=True, async_mode="async_with_pinned_mem"), _trained(), str(tmp_path))
    with pytest.raises(AssertionError, match="Non-blocking copy requires that the current accelerator is available"):
        stock.save(500)
    stock.close()


class Stage(nn.Module):
    """One pipeline stage the way torchtitan splits a model: the kept layers under their original
    indices (``layers`` a ``ModuleDict``), ``aux`` on the last stage only."""

    def __init__(self, layer_ids: list[int], last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): tt.MoELayer(tt.DIM, tt.EXPERTS) for i in layer_ids})
        self.aux = nn.Linear(tt.DIM, tt.DIM) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x, tt.ROUTED_BEFORE)
        return self.aux(x) if self.aux is not None else x


def _stages(seed: int, ids: tuple[list[int], list[int]] = ([0], [1])) -> tuple[list[Stage], Any, Any]:
    torch.manual_seed(seed)
    parts = [Stage(ids[0], last=False), Stage(ids[1], last=True)]
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": tt.LR})],
    ).build(model_parts=parts)
    return (
        parts,
        optimizers,
        LRSchedulersContainer.Config(warmup_steps=tt.WARMUP).build(optimizers=optimizers, training_steps=100),
    )


def _build_parts(config: Any, objs: tuple, base: str) -> Any:
    return config.build(
        dataloader=tt.Loader(),
        model_parts=objs[0],
        optimizers=objs[1],
        lr_schedulers=objs[2],
        states={"train_state": tt.TrainState()},
        sd_adapter=None,
        base_folder=base,
    )


def test_pipeline_parallel_model_parts(tmp_path, one_rank) -> None:
    parts, optimizers, schedulers = objs = _stages(0)
    for step in range(2):
        optimizers.zero_grad()
        parts[1](parts[0](torch.randn(4, tt.DIM, generator=torch.Generator().manual_seed(step)))).pow(
            2
        ).mean().backward()
        optimizers.step()
        schedulers.step()
    assert [len(o.state) for o in optimizers.optimizers] == [5, 7]  # router + experts 0, 2; part 1 also aux
    mgr = _build_parts(Config(enable=True, interval=1, keep_latest_k=0), objs, str(tmp_path))
    mgr.save(2)
    mgr.close()
    fresh = _stages(1)
    mgr2 = _build_parts(Config(enable=True, keep_latest_k=0), fresh, str(tmp_path))
    assert mgr2.load() is True
    mgr2.close()
    for a, b in zip(optimizers.optimizers, fresh[1].optimizers):
        assert [g["lr"] for g in a.param_groups] == [g["lr"] for g in b.param_groups] == [tt.LR * 3 / tt.WARMUP]
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
            assert a.state.get(p, {}).keys() == b.state.get(q, {}).keys()
            for key, value in a.state.get(p, {}).items():
                assert torch.equal(value, b.state[q][key])
    # two stages with the same FQNs (layers.0 in both): refused when the manager is built
    with pytest.raises(ValueError, match=r"'layers\.0\.router\.weight' is in model part 0 and model part 1"):
        _build_parts(Config(enable=True), _stages(0, ([0], [0])), str(tmp_path / "dup"))


@pytest.mark.skipif(
    not torch.accelerator.is_available(), reason="async_with_pinned_mem needs an accelerator (this host has none)"
)
def test_pinned_memory_async_on_an_accelerator(tmp_path, one_rank, monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the background save process sets up its own group
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    device = torch.accelerator.current_accelerator()
    objs = tt.build(0, device=device)
    tt.train(*objs, range(1, 3), tt.ROUTED_BEFORE, use_aux=False)
    copies = {
        n: [{k: v.clone() for k, v in s.items()} for s in o.state.values()] for n, o in tt.leaves(objs[1]).items()
    }
    mgr = tt.manager(Config, str(tmp_path), *objs, tt.TrainState(2), async_mode="async_with_pinned_mem")
    assert mgr.save(2) is True
    mgr.maybe_wait_for_staging()
    mgr.maybe_wait_for_saving()
    mgr.close()
    assert _state_count(objs[1]) == [0, 10], "the save created state"
    fresh = tt.build(1, device=device)
    mgr2 = tt.manager(Config, str(tmp_path), *fresh, tt.TrainState(), async_mode="async_with_pinned_mem")
    assert mgr2.load() is True
    mgr2.close()
    assert _state_count(fresh[1]) == [0, 10] and tt.lrs(fresh[1]) == tt.lrs(objs[1])
    for name, opt in tt.leaves(fresh[1]).items():
        for saved, loaded in zip(copies[name], opt.state.values()):
            for key, value in saved.items():
                assert torch.equal(value.cpu(), loaded[key].cpu()), (name, key)


def test_wrong_objects_fail_when_built(tmp_path) -> None:
    model, optimizers, schedulers = tt.build(0)
    cases = [
        (
            {"model_parts": model.state_dict()},
            TypeError,
            r"model must be an nn.Module or a list of nn.Module.*OrderedDict",
        ),
        ({"model_parts": []}, TypeError, r"model is an empty list"),
        ({"model_parts": [model, model.state_dict()]}, TypeError, r"model part 1 is a OrderedDict, not an nn.Module"),
        ({"optimizers": schedulers}, TypeError, r"expected a torch.optim.Optimizer.*got LRSchedulersContainer"),
        ({"optimizers": [optimizers]}, TypeError, r"expected a torch.optim.Optimizer.*got list"),
    ]
    for change, exc, pattern in cases:
        kwargs = {
            "dataloader": None,
            "model_parts": [model],
            "optimizers": optimizers,
            "lr_schedulers": schedulers,
            "states": {},
            "sd_adapter": None,
            "base_folder": str(tmp_path),
            **change,
        }
        with pytest.raises(exc, match=pattern):
            Config(enable=True).build(**kwargs)
    assert not os.path.exists(tmp_path / "checkpoint")
    with pytest.raises(ValueError, match="drop_synthetic_state=True needs migrate_stock_checkpoints=True"):
        Config(enable=True, drop_synthetic_state=True)
    # disabled: built without looking at the objects, as the stock manager
    assert (
        Config(enable=False)
        .build(dataloader=None, model_parts=None, optimizers=None, lr_schedulers=None, states={}, sd_adapter=None)
        .load()
        is False
    )


def test_the_container_itself_in_plain_dcp(tmp_path) -> None:
    """What a user tries first: ``SparseOptimizerState(model_parts, container)`` straight into DCP."""
    model, optimizers, _ = _trained()
    state = sc.SparseOptimizerState([model], optimizers)
    dcp.save({"optimizer": state}, checkpoint_id=str(tmp_path))
    assert [len(o.state) for o in optimizers.optimizers] == [0, 10], "the save invented state"
    fresh = tt.build(1)
    target = sc.SparseOptimizerState([fresh[0]], fresh[1])
    dcp.load({"optimizer": target}, checkpoint_id=str(tmp_path), planner=sc.SparseLoadPlanner())
    assert [len(o.state) for o in fresh[1].optimizers] == [0, 10] and tt.lrs(fresh[1]) == tt.lrs(optimizers)


def test_config_is_the_stock_config_plus_migration() -> None:
    stock = {f for f in CheckpointManager.Config.__dataclass_fields__}
    ours = {f for f in Config.__dataclass_fields__}
    assert ours - stock == {"migrate_stock_checkpoints", "drop_synthetic_state"} and stock <= ours
    assert issubclass(Config, CheckpointManager.Config) and Config._owner is SparseCheckpointManager
    for name in stock:
        assert Config.__dataclass_fields__[name].default == CheckpointManager.Config.__dataclass_fields__[name].default
    # the manager is built with the stock manager's arguments, and says so
    assert inspect.signature(SparseCheckpointManager) == inspect.signature(CheckpointManager)
    with pytest.raises(TypeError, match="missing a required argument: 'sd_adapter'"):
        Config(enable=False).build(dataloader=None, model_parts=None, optimizers=None, lr_schedulers=None, states={})


def test_group_values_round_trip_and_unsupported_refused_before_writing(tmp_path, one_rank) -> None:
    """A torch.dtype/torch.device setting round-trips through the manager; an
    arbitrary object is refused before any file of the step exists."""
    objs = _trained()
    for opt in objs[1].optimizers:
        for g in opt.param_groups:
            g.update(momentum_dtype=torch.bfloat16, offload=torch.device("cpu"), mode="adamw", table=((1, None), [2.5]))
    mgr = tt.manager(Config, str(tmp_path), *objs, tt.TrainState(2))
    assert mgr.save(2) is True
    mgr.close()
    fresh = tt.build(1)
    mgr2 = tt.manager(Config, str(tmp_path), *fresh, tt.TrainState())
    assert mgr2.load() is True
    mgr2.close()
    for a, b in zip(objs[1].optimizers, fresh[1].optimizers):
        saved = [{k: v for k, v in g.items() if k != "params"} for g in a.param_groups]
        assert [{k: v for k, v in g.items() if k != "params"} for g in b.param_groups] == saved
        assert all(g["momentum_dtype"] is torch.bfloat16 for g in b.param_groups)

    objs[1].optimizers[0].param_groups[0]["schedule"] = object()
    mgr3 = tt.manager(Config, str(tmp_path), *objs, tt.TrainState(3))
    with pytest.raises(sc.CheckpointFormatError, match="key 'schedule': unsupported value type object"):
        mgr3.save(3)
    mgr3.close()
    assert not (tmp_path / "checkpoint" / "step-3").exists()


def test_migration_report_lists_state_kept_as_possibly_synthetic(tmp_path, one_rank) -> None:
    """Reported as inexact: the never-stepped ``Adam`` has ``weight_decay``, so the stock manager's
    synthetic step writes non-zero moments: nothing is dropped, and the report must say that the
    state of every one of its parameters was kept though it may be invented (the resume is not exact)."""
    objs = tt.build(0)
    for g in objs[1].optimizers[0].param_groups:
        g["weight_decay"] = 0.1
    for step in (1, 2):
        tt.train(*objs, range(step, step + 1), tt.ROUTED_BEFORE, use_aux=False)
    stock = tt.manager(CheckpointManager.Config, str(tmp_path), *objs, tt.TrainState(2))
    stock.save(2)
    stock.close()
    fresh = tt.build(1)
    mgr = tt.manager(
        Config, str(tmp_path), *fresh, tt.TrainState(), migrate_stock_checkpoints=True, drop_synthetic_state=True
    )
    assert mgr.load() is True
    mgr.close()
    report = mgr.migration_report
    assert report.dropped == () and not report.exact
    kept = {(k.leaf, k.fqn) for k in report.possibly_synthetic}
    assert {("optim0", "aux.weight"), ("optim0", "aux.bias")} <= kept
    assert all(leaf == "optim0" for leaf, _ in kept), kept  # optim1 stepped twice: step == 2
    assert any("leaf 'optim0': kept the state of 2 parameter(s) with step == 1" in line for line in report.summary())
