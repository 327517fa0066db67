"""torchtitan's own checkpoint entry point with sparse_ckpt plugged in, on 2 Gloo ranks with FSDP2
(the real torchtitan package; skipped when it is not installed).

The scenario (bench/trainers/titan_scenario.py): experts 1 and 3 of every layer got no tokens before the save,
leaf ``optim0`` (Adam over ``aux``) never stepped while the warmup scheduler moved its lr.
``SparseCheckpointManager.Config(...).build(...)`` (as torchtitan's trainer builds its manager)
saves and restores it into fresh objects exactly: lrs, scheduler, train_state and dataloader
entries restored, no state invented (not in the live optimizer either), and the next steps -- the
first real ones of experts 1 and 3 and of ``aux`` -- bit-exact with a run that never
checkpointed. The stock ``CheckpointManager`` on the same scenario is pinned in
``test_torchtitan_stock.py``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install --no-deps -r .ci/requirements-torchtitan.txt)"
)

from _dist import assert_snapshots_equal, full_snapshot, run_ranks
from torch.distributed.device_mesh import init_device_mesh

from bench.trainers import titan_scenario as tt
from sparse_ckpt.integrations.torchtitan import SparseCheckpointManager

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]  # a trainer drill: slow


def _state_fqns(model, optimizers) -> dict[str, list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {leaf: sorted(names[id(p)] for p in o.state) for leaf, o in tt.leaves(optimizers).items()}


def _drill(rank: int, world_size: int, base: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    for async_mode in ("disabled", "async"):
        _drill_mode(rank, mesh, os.path.join(base, async_mode), async_mode)


def _drill_mode(rank: int, mesh, folder: str, async_mode: str) -> None:
    before = range(1, 3)
    after = range(3, 5)
    ref = tt.build(0, mesh)  # never checkpointed
    tt.train(*ref, before, tt.ROUTED_BEFORE, use_aux=False, rank=rank)
    model, optimizers, schedulers = live = tt.build(0, mesh)
    tt.train(*live, before, tt.ROUTED_BEFORE, use_aux=False, rank=rank)
    mgr = tt.manager(
        SparseCheckpointManager.Config,
        folder,
        model,
        optimizers,
        schedulers,
        tt.TrainState(2),
        tt.Loader(7),
        async_mode=async_mode,
    )
    stateless = [f"layers.{i}.experts.{e}.{w}" for i in range(tt.LAYERS) for e in (1, 3) for w in ("weight", "bias")]
    saved_fqns = _state_fqns(model, optimizers)
    assert saved_fqns["optim0"] == [] and not set(stateless) & set(saved_fqns["optim1"]), saved_fqns
    snap = full_snapshot(model, optimizers)
    assert mgr.save(2) is True
    mgr.maybe_wait_for_staging()
    mgr.maybe_wait_for_saving()
    assert_snapshots_equal(full_snapshot(model, optimizers), snap, "live objects after save")
    assert _state_fqns(model, optimizers) == saved_fqns, "the save created state in the live optimizer"
    mgr.close()

    # Restore into fresh objects (another init: the load must set everything), through Config.build.
    fresh = tt.build(1, mesh)
    m2, o2, s2 = fresh
    ts2, loader2 = tt.TrainState(), tt.Loader()
    mgr2 = tt.manager(SparseCheckpointManager.Config, folder, m2, o2, s2, ts2, loader2, async_mode=async_mode)
    assert mgr2.load() is True
    mgr2.close()
    assert mgr2.migration_report is None
    assert (ts2.value, loader2.value, s2.schedulers[0].last_epoch) == (2, 7, 2)
    assert tt.lrs(o2) == tt.lrs(optimizers) == [tt.LR * 3 / tt.WARMUP] * 2
    assert _state_fqns(m2, o2) == saved_fqns, "state invented on load"
    assert_snapshots_equal(full_snapshot(m2, o2), snap, "restored")

    # The next steps: every expert routed, aux used (their first real steps) -- bit-exact.
    for objs in (ref, live, fresh):
        tt.train(*objs, after, tt.ROUTED_AFTER, use_aux=True, rank=rank)
    expected = full_snapshot(ref[0], ref[1])
    assert_snapshots_equal(full_snapshot(m2, o2), expected, "resumed run vs uninterrupted run")
    assert_snapshots_equal(full_snapshot(model, optimizers), expected, "saving run vs uninterrupted run")
    assert tt.lrs(o2) == tt.lrs(ref[1])


def test_fsdp2_drill_through_config_build(tmp_path) -> None:
    """Sync and ``async`` saves (``async_with_pinned_mem`` needs an accelerator: see the GPU test)."""
    run_ranks(_drill, 2, str(tmp_path), timeout=240)
    for mode in ("disabled", "async"):
        assert os.path.isfile(tmp_path / mode / "checkpoint" / "step-2" / ".metadata")
