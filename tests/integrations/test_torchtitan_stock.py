"""torchtitan's stock ``CheckpointManager`` on the scenario of test_torchtitan.py, pinned (torchtitan
0.3.0, torch 2.13, 2 Gloo ranks, FSDP2), so that a fix upstream is noticed; and what sparse_ckpt
does with the checkpoints on either side:

* stock save + stock load: the save runs torchtitan's synthetic step on the never-stepped leaf
  (the *live* optimizer gains ``step == 1`` state), and the load of its own checkpoint fails
  (``Missing key in checkpoint state_dict: optimizer.state.layers.0.experts.1.weight.step``);
  with ``allow_partial_load=True`` it loads, with state invented for the unrouted experts, and the
  next steps differ from an uninterrupted run;
* the foreign-loader hazard: the stock load of a sparse_ckpt checkpoint fails on the first state
  key the checkpoint lacks; with ``allow_partial_load=True`` the checkpoint's foreign-loader guard
  (``param_groups.<first FQN>.lr``) makes DCP refuse the plan, nothing read (without the guard it
  "loaded" ``step`` 1 instead of 2, the constructor's lr and invented state);
* ``SparseCheckpointManager`` refuses the stock checkpoint unless ``migrate_stock_checkpoints``;
  migrated with ``drop_synthetic_state`` it resumes bit-exact with the uninterrupted run,
  migrated as saved it resumes bit-exact with the run that kept the invented state.
"""

from __future__ import annotations

import _backends
import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install --no-deps -r .ci/requirements-torchtitan.txt)"
)

import torch
from _dist import assert_snapshots_equal, full_snapshot, run_ranks
from helpers import assert_deep_equal
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import CheckpointManager

from bench.trainers import titan_scenario as tt
from sparse_ckpt import CheckpointMismatchError
from sparse_ckpt.integrations.torchtitan import SparseCheckpointManager

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]  # a trainer drill: slow

UPSTREAM = "torchtitan 0.3.0's stock behaviour changed (fixed upstream?): update this pin and the README"
UNROUTED = [f"layers.{i}.experts.{e}.{w}" for i in range(tt.LAYERS) for e in (1, 3) for w in ("weight", "bias")]
AUX = ["aux.bias", "aux.weight"]


def _state(model, optimizers) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for o in optimizers.optimizers for p, s in o.state.items()}


def _is_synthetic(state: dict) -> bool:
    local = [v.to_local() if isinstance(v, DTensor) else v for k, v in state.items() if k != "step"]
    return float(state["step"]) == 1.0 and all(int(torch.count_nonzero(t)) == 0 for t in local)


def _load_error(config_cls, folder: str, mesh, objs: tuple | None = None, **config) -> BaseException:
    """The error of ``config_cls``'s load of ``folder`` into ``objs`` (fresh objects when not given)."""
    objs = objs if objs is not None else tt.build(1, mesh)
    mgr = tt.manager(config_cls, folder, *objs, tt.TrainState(), **config)
    try:
        mgr.load()
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        # (the stock load's synthetic step has already created state when it fails)
        assert config_cls is not SparseCheckpointManager.Config or not _state(*objs[:2]), (
            "a refused load changed the optimizer"
        )
        return exc
    finally:
        mgr.close()
    raise AssertionError(f"{config_cls.__qualname__}.load() did not fail")


def _failure_texts(exc: BaseException) -> set[str]:
    assert isinstance(exc, CheckpointException), f"{UPSTREAM}: {type(exc).__name__}: {exc}"
    return {str(f[0]) for f in exc.failures.values()}


def _stock(rank: int, world_size: int, base: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    before, after = range(1, 3), range(3, 5)
    ref = tt.build(0, mesh)  # the uninterrupted run
    tt.train(*ref, before, tt.ROUTED_BEFORE, use_aux=False, rank=rank)

    # -- stock save: the live optimizer gains synthetic state
    stock_dir, sparse_dir = f"{base}/stock", f"{base}/sparse"
    live = tt.build(0, mesh)
    tt.train(*live, before, tt.ROUTED_BEFORE, use_aux=False, rank=rank)
    assert not _state(*live[:2]).keys() & set(AUX)
    mgr = tt.manager(CheckpointManager.Config, stock_dir, *live, tt.TrainState(2))
    mgr.save(2)
    mgr.close()
    invented = _state(*live[:2])
    assert sorted(k for k in invented if k.startswith("aux.")) == AUX and all(
        _is_synthetic(invented[k]) for k in AUX
    ), f"{UPSTREAM}: the save no longer creates state in the live never-stepped optimizer"

    # -- stock load of its own checkpoint fails on the first unrouted expert
    texts = _failure_texts(_load_error(CheckpointManager.Config, stock_dir, mesh))
    assert texts == {"Missing key in checkpoint state_dict: optimizer.state.layers.0.experts.1.weight.step."}, (
        f"{UPSTREAM}: {texts}"
    )

    # -- with allow_partial_load: invented state for the unrouted experts, the next steps differ
    partial = tt.build(1, mesh)
    mgr = tt.manager(tt.PartialLoadManager.Config, stock_dir, *partial, tt.TrainState())
    assert mgr.load() is True
    mgr.close()
    got = _state(*partial[:2])
    assert sorted(k for k in got if k in UNROUTED) == sorted(UNROUTED), f"{UPSTREAM}: no state invented on load"
    assert all(_is_synthetic(got[k]) for k in UNROUTED)
    for objs in (ref, live, partial):
        tt.train(*objs, after, tt.ROUTED_AFTER, use_aux=True, rank=rank)
    expected, resumed = _snap(ref), _snap(partial)
    differ = [n for n in expected["params"] if not torch.equal(expected["params"][n], resumed["params"][n])]
    assert set(differ) >= {f"layers.{i}.experts.{e}.weight" for i in range(tt.LAYERS) for e in (1, 3)} | {
        "aux.weight"
    }, f"{UPSTREAM}: parameters that differ after the partial resume: {differ}"

    # -- SparseCheckpointManager refuses the stock checkpoint unless told to migrate it
    refused = _load_error(SparseCheckpointManager.Config, stock_dir, mesh)
    assert isinstance(refused, CheckpointMismatchError), f"{type(refused).__name__}: {refused}"
    assert "migrate_stock_checkpoints=True" in str(refused) and "exclude_from_loading" in str(refused), refused

    # -- migrated, dropping synthetic state: bit-exact with the uninterrupted run
    migrated = tt.build(1, mesh)
    mgr = tt.manager(
        SparseCheckpointManager.Config,
        stock_dir,
        *migrated,
        tt.TrainState(),
        migrate_stock_checkpoints=True,
        drop_synthetic_state=True,
    )
    assert mgr.load() is True
    mgr.close()
    report = mgr.migration_report
    assert [(d.leaf, d.fqn) for d in report.dropped] == [("optim0", f) for f in AUX], report
    assert sorted(report.dropped[0].keys) == [
        "state.aux.bias.exp_avg",
        "state.aux.bias.exp_avg_sq",
        "state.aux.bias.step",
    ]
    assert report.stateless == {"optim0": ("aux.weight", "aux.bias"), "optim1": tuple(sorted(UNROUTED, key=_order))}
    assert not _state(*migrated[:2]).keys() & set(AUX + UNROUTED), "state invented or kept"
    assert tt.lrs(migrated[1]) == [tt.LR * 3 / tt.WARMUP] * 2
    tt.train(*migrated, after, tt.ROUTED_AFTER, use_aux=True, rank=rank)
    assert_snapshots_equal(_snap(migrated), expected, "migrated (drop) vs uninterrupted", state_key_order=False)

    # -- migrated as saved: bit-exact with the run that kept the invented state
    as_saved = tt.build(1, mesh)
    mgr = tt.manager(
        SparseCheckpointManager.Config, stock_dir, *as_saved, tt.TrainState(), migrate_stock_checkpoints=True
    )
    assert mgr.load() is True
    mgr.close()
    assert mgr.migration_report.dropped == () and mgr.migration_report.stateless["optim0"] == ()
    tt.train(*as_saved, after, tt.ROUTED_AFTER, use_aux=True, rank=rank)
    assert_snapshots_equal(
        _snap(as_saved), _snap(live), "migrated (as saved) vs the stock-saving run", state_key_order=False
    )

    # -- the foreign-loader hazard: the stock manager pointed at a sparse_ckpt checkpoint
    sparse = tt.build(0, mesh)
    tt.train(*sparse, before, tt.ROUTED_BEFORE, use_aux=False, rank=rank)
    mgr = tt.manager(SparseCheckpointManager.Config, sparse_dir, *sparse, tt.TrainState(2))
    mgr.save(2)
    mgr.close()
    texts = _failure_texts(_load_error(CheckpointManager.Config, sparse_dir, mesh))
    assert texts == {"Missing key in checkpoint state_dict: optimizer.state.aux.weight.step."}, f"{UPSTREAM}: {texts}"
    # with allow_partial_load=True the checkpoint's foreign-loader guard refuses the plan: nothing is read
    # (without the guard it "loaded" step 1 instead of 2, the constructor's lr and invented state)
    untouched = full_snapshot(*tt.build(1, mesh)[:2])["params"]
    foreign = tt.build(1, mesh)
    texts = _failure_texts(_load_error(tt.PartialLoadManager.Config, sparse_dir, mesh, objs=foreign))
    guard = (
        "Invalid checkpoint metadata for optimizer.param_groups.aux.weight.lr, expected BytesStorageMetadata "
        "but found <class 'torch.distributed.checkpoint.metadata.TensorStorageMetadata'>"
    )
    assert texts == {guard}, texts
    assert_deep_equal(full_snapshot(*foreign[:2])["params"], untouched, "model after the refused foreign load")


def _snap(objs) -> dict:
    """:func:`full_snapshot` with each group's settings in key order: a load of the flat layout puts
    ``param_names`` last, as torch's own ``load_state_dict`` does."""
    snap = full_snapshot(objs[0], objs[1])
    snap["groups"] = {leaf: [(dict(sorted(s.items())), f) for s, f in g] for leaf, g in snap["groups"].items()}
    return snap


def _order(fqn: str) -> tuple:
    """``named_parameters`` order of the scenario's FQNs."""
    parts = fqn.split(".")
    return (int(parts[1]), int(parts[3]), parts[4] == "bias")


@_backends.only("python")
def test_stock_checkpoint_manager_pinned_and_migrated(tmp_path) -> None:
    """Once, on the python core: the stock path does not use the core, and the sparse drill
    (test_torchtitan.py) runs on both cores."""
    run_ranks(_stock, 2, str(tmp_path), timeout=300)
