"""VeOmni (the real package) through its own ``build_checkpointer``: one spawned 2-rank Gloo FSDP2 drill.

The drill (:mod:`veomni_drill`) runs once for this module (~25 s) and records facts; each test
asserts one of them. The scenario is the seed's: VeOmni's ``MultiOptimizer``, a leaf (``vit``)
that never stepped but whose lr VeOmni's linear scheduler moved from 0.01 to 0.0025, experts that
were never routed. Stock VeOmni's behaviour on it is pinned too (so an upstream fix is noticed),
as is what unpatched VeOmni does with a sparse_ckpt checkpoint (the foreign-loader hazard).

The module runs on one core backend (it overrides the suite's ``core_backend`` fixture with
``cpp``): the glue under test does not depend on the core, which the rest of the suite runs on
both. Skipped when veomni is not installed (``pip install --no-deps -r .ci/requirements-veomni.txt``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sparse_ckpt import _backend

if importlib.util.find_spec("veomni") is None:
    pytest.skip(
        "veomni is not installed (pip install --no-deps -r .ci/requirements-veomni.txt)", allow_module_level=True
    )

import _backends
import veomni_drill
from _dist import run_ranks

pytestmark = pytest.mark.slow  # every test reads the one trainer drill (two ranks, VeOmni's checkpointer)

STEPPED = ["dense.bias", "dense.weight", "experts.0.weight", "experts.1.weight"]
NEVER_STEPPED = ["experts.2.weight", "experts.3.weight", "tower.bias", "tower.weight"]
ADAM = {"exp_avg": "values", "exp_avg_sq": "values", "step": 3.0}
INVENTED = {"exp_avg": "zeros", "exp_avg_sq": "zeros", "step": 1.0}
"""What torch DSD's synthetic step leaves in a parameter that never stepped."""


@pytest.fixture(scope="module", autouse=True, params=["cpp"])
def core_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """One drill, on the C++ core (what users get); skipped like the suite's cpp runs when it is not built."""
    core = _backends.cpp_core()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_backend, "core", core)
        mp.setattr(_backend, "NAME", request.param)
        mp.setenv("SPARSE_CKPT_BACKEND", request.param)
        yield request.param


@pytest.fixture(scope="module")
def facts(core_backend: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("veomni-drill")
    run_ranks(veomni_drill.worker, 2, str(root), timeout=240)
    return torch.load(root / "facts.pt", weights_only=False)


def by_fqn(state: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {fqn: st for leaf in state.values() for fqn, st in leaf.items()}


# --------------------------------------------------------------------------- stock VeOmni, pinned


def test_stock_veomni_resume_is_wrong(facts: dict[str, Any]) -> None:
    """VeOmni 0.1.12's own checkpointer on the seed scenario (an upstream fix fails this: update the pin)."""
    stock = facts["stock"]
    assert stock["class"] == "DistributedCheckpointer"
    assert stock["save_left_live_unchanged"]
    assert stock["lrs_saved"] == {"non_extra_parallel": [0.0025], "vit": [0.0025]}
    assert stock["lrs_restored"] == {"non_extra_parallel": [0.0025], "vit": [0.01]}  # the moved lr is lost
    restored = by_fqn(stock["state_restored"])
    assert {f: restored[f] for f in STEPPED} == dict.fromkeys(STEPPED, ADAM)
    assert {f: restored[f] for f in NEVER_STEPPED} == dict.fromkeys(NEVER_STEPPED, INVENTED)  # invented state
    assert not stock["resumed_equals_reference"]
    assert 1e-3 < stock["max_delta_after_resume"] < 1e-1
    assert stock["items"] == (92, 84)  # DCP items: all, under 'optimizer'


# --------------------------------------------------------------------------- installed


def test_build_checkpointer_returns_the_sparse_one(facts: dict[str, Any]) -> None:
    assert facts["sparse"]["class"] == "SparseDistributedCheckpointer"
    assert facts["ddp_class"] == "SparseDistributedCheckpointer"
    assert facts["installed_twice_same"]
    assert facts["uninstalled_class"] == "DistributedCheckpointer"


@pytest.mark.parametrize("case", ["sparse", "sparse_single"])
def test_resume_is_exact(facts: dict[str, Any], case: str) -> None:
    """VeOmni's MultiOptimizer (and a single AdamW): lr restored, no invented state, next steps bit-exact."""
    got = facts[case]
    leaf = "vit" if case == "sparse" else "optim"
    assert got["save_left_live_unchanged"]
    assert got["lrs_restored"] == got["lrs_saved"]
    assert got["lrs_restored"][leaf] == [0.0025]
    assert got["state_restored"] == got["state_saved"]
    assert by_fqn(got["state_restored"]) == dict.fromkeys(STEPPED, ADAM)  # nothing for NEVER_STEPPED
    assert got["restored_equals_saved"]
    assert got["resumed_equals_reference"] and got["max_delta_after_resume"] == 0.0
    assert got["extra_global_step"] == 3  # extra_state saved and loaded as VeOmni does
    assert Path(got["path"]).name == "global_step_3"  # global_steps sub-directory


def test_fewer_dcp_items(facts: dict[str, Any]) -> None:
    # vs (92, 84) stock: 8 model items + 8 optimizer items (per leaf: group table, scalar table, and
    # the default layout's layout table and one buffer) + 3 foreign-loader guards (one per leaf, one nested)
    # + the layout index of the leaf with buffered state (its 2 ranks' layouts differ: written once)
    assert facts["sparse"]["items"] == (20, 12)
    assert facts["sparse_single"]["items"] == (18, 10)  # 4 optimizer items, the layout index, 2 guards


def test_async_save_uses_veomnis_future(facts: dict[str, Any]) -> None:
    """The pending save is DistributedCheckpointer's, which VeOmni's HF export waits on directly."""
    assert facts["async_future_on_base"] and facts["async_future_cleared"]
    assert facts["async_restored_equals_saved"]


def test_hf_conversion_unchanged(facts: dict[str, Any]) -> None:
    assert facts["hf_keys"] == sorted(STEPPED + NEVER_STEPPED)


def test_extra_parallel_is_refused(facts: dict[str, Any]) -> None:
    msg = facts["ep_refused"]
    assert msg is not None and "ExtraParallel" in msg and "_fqn2spec_info" in msg and "uninstall()" in msg
    assert not facts["ep_wrote"]


@pytest.mark.parametrize("order", veomni_drill.COMPOSED)
def test_every_checkpoint_loads_with_the_dsd_hook_active_too(facts: dict[str, Any], order: str) -> None:
    """The pair VeOmni + the DSD hook (the launcher's default selection), installed in either order,
    loads what VeOmni's integration loads alone: its own checkpoints (``MultiOptimizer``, one AdamW,
    an async save) exactly, and the stock one migrated as without the hook."""
    got = facts["with_dsd"][order]
    for case in ("sparse", "sparse_single"):
        alone = facts[case]
        assert got[case]["resumed_equals_reference"] and got[case]["restored_equals_saved"], (order, case)
        assert got[case]["state_restored"] == alone["state_restored"], (order, case)
        assert got[case]["lrs_restored"] == alone["lrs_restored"] == alone["lrs_saved"], (order, case)
    assert got["async_restored_equals_saved"]
    assert got["migrated_state"] == facts["migrated_state"] and got["migrated_lrs"] == facts["migrated_lrs"]


# --------------------------------------------------------------------------- stock checkpoints


def test_stock_checkpoint_is_refused_without_opt_in(facts: dict[str, Any]) -> None:
    msg = facts["stock_refused"]
    assert msg is not None and "stock DistributedCheckpointer" in msg
    assert "load_stock_checkpoint" in msg and "migrate_stock=True" in msg
    assert facts["stock_refusal_left_unchanged"]


def test_stock_checkpoint_migration_reports_every_gap(facts: dict[str, Any]) -> None:
    assert facts["migration_report"] == {
        "non_extra_parallel": (6, [], ["experts.2.weight", "experts.3.weight"]),
        "vit": (2, ["tower.weight", "tower.bias"], ["tower.weight", "tower.bias"]),
    }
    (warning,) = facts["migration_warnings"]
    assert "leaf 'vit' (2 params): 2 without saved settings (kept the current settings: tower.weight" in warning
    assert "leaf 'non_extra_parallel' (6 params): 0 without saved settings, 2 without saved state" in warning
    assert by_fqn(facts["migrated_state"]) == dict.fromkeys(STEPPED, ADAM)  # no invented state
    assert facts["migrated_lrs"] == {"non_extra_parallel": [0.0025], "vit": [0.01]}  # stock never saved vit's
    assert facts["migrated_extra_step"] == 3
    assert facts["trainer_migration_warned"] == 1  # install(migrate_stock=True): the trainer's own load


# --------------------------------------------------------------------------- foreign-loader hazard, pinned


def test_unpatched_veomni_reading_a_sparse_checkpoint(facts: dict[str, Any]) -> None:
    """What stock VeOmni (DefaultLoadPlanner with allow_partial_load=True) does with our checkpoint: its
    target asks for ``param_groups.{fqn}.lr`` as a number, where the checkpoint's foreign-loader guard
    is a tensor, so DCP refuses the plan before reading anything (without the guards it "loaded"
    silently, with step 1 and lr 0.01)."""
    target = set(facts["foreign_target_keys"])
    params = STEPPED + NEVER_STEPPED
    settings = {
        "amsgrad",
        "betas",
        "capturable",
        "decoupled_weight_decay",
        "differentiable",
        "eps",
        "foreach",
        "fused",
        "initial_lr",
        "lr",
        "maximize",
        "weight_decay",
    }
    assert target == {f"optimizer.param_groups.{f}.{k}" for f in params for k in settings} | {
        f"optimizer.state.{f}.{k}" for f in params for k in ("exp_avg", "exp_avg_sq", "step")
    }
    ours = set(facts["sparse_ckpt_keys"])
    guards = {k for k in target & ours if k.startswith("optimizer.param_groups.")}
    assert guards and all(k.endswith(".lr") for k in guards)
    assert target & ours - guards == set()  # the state is in the default layout's buffers: only the guards match
    error = facts["foreign_load_error"]
    assert error is not None and "Invalid checkpoint metadata for optimizer.param_groups." in error
    assert ".lr, expected BytesStorageMetadata" in error
    assert facts["foreign_lrs"] == {"non_extra_parallel": [0.01], "vit": [0.01]}  # the fresh optimizer's
    state = by_fqn(facts["foreign_state"])  # only what VeOmni's own target building invented: nothing was read
    assert {f: state[f] for f in params} == dict.fromkeys(params, INVENTED)


def test_unpatched_veomni_reading_a_sparse_single_optimizer_checkpoint(facts: dict[str, Any]) -> None:
    """The same with one AdamW (DSD's nested layout: settings asked for per group index, where the
    checkpoint's ``param_groups.0.lr`` guard refuses the plan)."""
    params = STEPPED + NEVER_STEPPED
    target = set(facts["foreign_single_target_keys"])
    assert {k for k in target if k.startswith("optimizer.param_groups.")} >= {
        "optimizer.param_groups.0.lr",
        "optimizer.param_groups.0.params",
    }
    assert {k for k in target if k.startswith("optimizer.state.")} == {
        f"optimizer.state.{f}.{k}" for f in params for k in ("exp_avg", "exp_avg_sq", "step")
    }
    error = facts["foreign_single_error"]
    assert error is not None and "Invalid checkpoint metadata for optimizer.param_groups." in error
    assert facts["foreign_single_lrs"] == {"optim": [0.01]}
    state = by_fqn(facts["foreign_single_state"])
    assert {f: state[f] for f in params} == dict.fromkeys(params, INVENTED)
