"""``sparse_ckpt.integrations.dsd``: torch DSD's functions, exact and sparse, directly and through ``install()``.

One spawned 2-rank Gloo job (FSDP2 over an explicit CPU mesh) runs every multi-rank case on one
process group: the drills' MoE (:mod:`dsd_moe`: 40 parameters, 22 with gradients, ``vision`` in
its own group whose lr a scheduler moves) saved after step 3 with DSD's calls and ``dcp.save``,
resumed into a fresh model and optimizer the way trainers do it (``get_optimizer_state_dict`` for
the load target, ``dcp.load`` with the trainer's own planner, ``set_optimizer_state_dict``), and
compared bit for bit with the uninterrupted run. The DSD names are imported here, at module level,
before ``install()`` runs in the ranks: the trainer's import order. The single-process tests
cover what needs no process group (torch DSD works on a plain CPU model without one).
"""

from __future__ import annotations

import copy
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import _backends
import dsd_moe
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import cpu_mesh, full_copy, run_ranks
from doc_blocks import ROOT, python_blocks, run_block
from helpers import assert_deep_equal
from legacy_checkpoints import drop_from_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

import sparse_ckpt as sc
import sparse_ckpt.integrations.dsd as sc_dsd
from sparse_ckpt._format.keys_record import is_record_key, without_key_record
from sparse_ckpt.integrations.dsd import functions

pytestmark = pytest.mark.usefixtures("forbid_fork")

NESTED = StateDictOptions()
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
STOCK = functions.torch_dsd


class TrainerPlanner(DefaultLoadPlanner):
    """A trainer's own planner subclass (calls ``super().set_up_planner``)."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)


def sharded(seed: int = 0) -> dsd_moe.Moe:
    m = dsd_moe.model(seed)
    mesh = cpu_mesh()
    for layer in m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def fresh(two: bool = False) -> tuple[dsd_moe.Moe, Any, Any]:
    """A fresh sharded MoE, its optimizer(s) and scheduler(s); ``two``: ``vision`` in an optimizer of its own."""
    m = sharded()
    if not two:
        opt = dsd_moe.optimizer(m)
        return m, opt, dsd_moe.scheduler(opt)
    rest, vision = dsd_moe.param_groups(m)
    opts = [torch.optim.AdamW([rest], lr=0.01), torch.optim.AdamW([vision], lr=dsd_moe.VISION_LR)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o, lam in zip(opts, (lambda s: 0.9**s, lambda s: 0.5**s))]
    return m, opts, scheds


def _each(x: Any) -> list[Any]:
    return list(x) if isinstance(x, list) else [x]


def train(m: Any, opt: Any, sched: Any, steps: range, rank: int) -> None:
    for step in steps:
        x, y = dsd_moe.batch(step, rank)
        m(x, y)["loss"].backward()
        for o in _each(opt):
            o.step()
        for s in _each(sched):
            s.step()
        for o in _each(opt):
            o.zero_grad(set_to_none=True)


def with_state(opt: Any) -> int:
    return sum(len(o.state) for o in _each(opt))


def snapshot(m: Any, opt: Any) -> dict[str, Any]:
    return {
        "params": {n: full_copy(p) for n, p in m.named_parameters()},
        "lrs": [g["lr"] for o in _each(opt) for g in o.param_groups],
    }


def state_snapshot(m: Any, opt: Any) -> dict[str, Any]:
    """Full copies of the optimizer state by FQN and the lrs (comparable across world sizes)."""
    names = {id(p): n for n, p in m.named_parameters()}
    state = {names[id(p)]: st for o in _each(opt) for p, st in o.state.items()}
    return {
        "state": {n: full_copy(state[n]) for n in sorted(state)},
        "lrs": [g["lr"] for o in _each(opt) for g in o.param_groups],
    }


# --------------------------------------------------------------------------- what trainers do


def save(
    m: Any,
    opt: Any,
    sched: Any,
    path: str,
    options: StateDictOptions,
    *,
    combined: bool = False,
    writer: Any = dcp.save,
) -> Any:
    """A trainer's save: DSD's dicts into ``dcp.save`` (``combined``: ``get_state_dict``)."""
    if combined:
        model_sd, optim_sd = get_state_dict(m, _each(opt), options=options)
    else:
        model_sd, optim_sd = get_model_state_dict(m), get_optimizer_state_dict(m, _each(opt), options=options)
    torch.save([s.state_dict() for s in _each(sched)], f"{path}-sched-{dist.get_rank()}.pt")
    return writer({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def resume(
    path: str, options: StateDictOptions, planner: Any, *, two: bool = False, combined: bool = False
) -> tuple[Any, Any, Any]:
    """A trainer's resume into a fresh model, optimizer(s) and scheduler(s)."""
    m, opt, sched = fresh(two)
    if combined:
        model_sd, optim_sd = get_state_dict(m, _each(opt), options=options)
    else:
        model_sd, optim_sd = get_model_state_dict(m), get_optimizer_state_dict(m, _each(opt), options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, planner=planner)
    if combined:
        set_state_dict(m, _each(opt), model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    else:
        set_model_state_dict(m, state["model"])
        set_optimizer_state_dict(m, _each(opt), state["optim"], options=options)
    for s, sd in zip(_each(sched), torch.load(f"{path}-sched-{dist.get_rank()}.pt", weights_only=False)):
        s.load_state_dict(sd)
    return m, opt, sched


def check_exact(rank: int, resumed: tuple[Any, Any, Any], reference: dict[str, Any], where: str) -> None:
    m, opt, sched = resumed
    assert with_state(opt) == dsd_moe.STEPPED, f"{where}: {with_state(opt)} states"
    train(m, opt, sched, range(3, 5), rank)
    assert_deep_equal(snapshot(m, opt), reference, where, nan_equal="none")


# --------------------------------------------------------------------------- the 2-rank job


def cases(rank: int, world_size: int, root: str) -> None:
    """Every multi-rank case, on one process group."""
    for two in (False, True):
        m, opt, sched = fresh(two)
        train(m, opt, sched, range(3), rank)
        assert with_state(opt) == dsd_moe.STEPPED
        if not two:  # (torch's get would step the vision optimizer, which has no state)
            stock_pinned(rank, root, m, opt, sched)
            layouts_match_torch(m, opt)
        sc_dsd.install()
        try:
            variants(rank, root, m, opt, sched, two)
        finally:
            sc_dsd.uninstall()
    direct(rank, root)


def stock_pinned(rank: int, root: str, m: Any, opt: Any, sched: Any) -> None:
    """Stock torch DSD: the save holds the 22 states; the resume target of a fresh optimizer gets
    DSD's synthetic step (40 states, 18 invented) and the load fails."""
    save(m, opt, sched, f"{root}/stock", NESTED)
    m2, opt2, _ = fresh()
    target = {"model": get_model_state_dict(m2), "optim": get_optimizer_state_dict(m2, opt2, options=NESTED)}
    assert len(opt2.state) == dsd_moe.PARAMS
    with pytest.raises(
        CheckpointException,
        match=r"Missing key in checkpoint state_dict: optim\.state\.layers\.0\.experts\.4\.weight\.step",
    ):
        dcp.load(target, checkpoint_id=f"{root}/stock")


def layouts_match_torch(m: Any, opt: Any) -> None:
    """For an optimizer with state (DSD steps none then), torch's dicts and ours (but its key record) are
    equal (also gathered with ``full_state_dict``), keys in the same order."""
    for options in (
        NESTED,
        FLAT,
        StateDictOptions(full_state_dict=True),
        StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
    ):
        ours = sc_dsd.get_optimizer_state_dict(m, _each(opt), options=options)
        assert isinstance(ours, sc_dsd.DsdStateDict)
        theirs = STOCK["get_optimizer_state_dict"](m, _each(opt), options=options)
        assert sum(map(is_record_key, ours)) == 1  # and the key record, which DSD's loaders do not read
        assert_deep_equal(without_key_record(ours), theirs, f"layout {options}", nan_equal="none")


def same_as_at_save(rank: int, root: str, tag: str, m: Any, opt: Any, where: str) -> None:
    """Every rank snapshots (a collective); rank 0 compares with run ``tag``'s state at its save."""
    got = state_snapshot(m, opt)
    if rank == 0:
        assert_deep_equal(
            got,
            torch.load(f"{root}/{tag}-at-save.pt", weights_only=False),
            f"{tag}: {where}",
            nan_equal="none",
            check_order=False,
        )


def variants(rank: int, root: str, m: Any, opt: Any, sched: Any, two: bool) -> None:
    """Installed: every layout, planner and call style resumes exactly; a stock checkpoint loads as it is."""
    tag = "two" if two else "one"
    plans = [("nested", NESTED, False), ("flat", FLAT, False), ("combined", NESTED, True)]
    for name, options, combined in plans:
        save(m, opt, sched, f"{root}/{tag}-{name}", options, combined=combined)
        assert with_state(opt) == dsd_moe.STEPPED  # a save changes nothing
    offload = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
    save(m, opt, sched, f"{root}/{tag}-offload", offload)
    save(m, opt, sched, f"{root}/{tag}-async", NESTED, writer=dcp.async_save).result()
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_optimizer_state_dict(m, _each(opt), options=full_options)
    model_full = get_model_state_dict(m, options=full_options)
    assert (len(full) > 0) == (rank == 0)  # DSD's cpu_offload full dict: rank 0 only
    if rank == 0:
        torch.save(dict(full), f"{root}/{tag}-full.pt")
        torch.save(model_full, f"{root}/{tag}-model.pt")
        torch.save(state_snapshot(m, opt), f"{root}/{tag}-at-save.pt")
    else:
        state_snapshot(m, opt)  # the same collectives
    dist.barrier()

    train(m, opt, sched, range(3, 5), rank)
    reference = snapshot(m, opt)
    for name, options, combined in [*plans, ("offload", offload, False), ("async", NESTED, False)]:
        for planner in (None, DefaultLoadPlanner(), TrainerPlanner()):
            where = f"{tag}: {name}, planner {type(planner).__name__}"
            check_exact(
                rank, resume(f"{root}/{tag}-{name}", options, planner, two=two, combined=combined), reference, where
            )

    # full_state_dict + broadcast_from_rank0 (set_state_dict): rank 0 reads the files, the others pass {}
    m2, opt2, _ = fresh(two)
    full = torch.load(f"{root}/{tag}-full.pt", weights_only=False) if rank == 0 else {}
    model_full = torch.load(f"{root}/{tag}-model.pt", weights_only=False) if rank == 0 else {}
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_state_dict(m2, _each(opt2), model_state_dict=model_full, optim_state_dict=full, options=broadcast)
    assert with_state(opt2) == dsd_moe.STEPPED
    same_as_at_save(rank, root, tag, m2, opt2, "broadcast")
    if not two:  # a dict rank 0 refuses (torch's id-keyed one) is refused on every rank, none left waiting
        ids = opt2.state_dict() if rank == 0 else {}
        with pytest.raises(sc.CheckpointFormatError, match="keyed by parameter ids"):
            set_optimizer_state_dict(m2, opt2, ids, options=broadcast)
        assert with_state(opt2) == dsd_moe.STEPPED
    # full_state_dict without broadcast: every rank has the whole dict
    full = torch.load(f"{root}/{tag}-full.pt", weights_only=False)
    m3, opt3, _ = fresh(two)
    set_optimizer_state_dict(m3, _each(opt3), full, options=StateDictOptions(full_state_dict=True))
    same_as_at_save(rank, root, tag, m3, opt3, "full")

    if not two:  # a stock checkpoint (DSD's own save) loads as it is, by every planner
        for planner in (None, TrainerPlanner()):
            check_exact(
                rank, resume(f"{root}/stock", NESTED, planner), reference, f"stock checkpoint, {type(planner).__name__}"
            )


def direct(rank: int, root: str) -> None:
    """Without install(): this module's functions called directly, loaded with SparseLoadPlanner."""
    m, opt, sched = fresh()
    train(m, opt, sched, range(3), rank)
    for options in (NESTED, FLAT):
        osd = sc_dsd.get_optimizer_state_dict(m, opt, options=options)
        dcp.save({"optim": osd}, checkpoint_id=f"{root}/direct")
        m2, opt2, _ = fresh()
        target = {"optim": sc_dsd.get_optimizer_state_dict(m2, opt2, options=options)}
        dcp.load(target, checkpoint_id=f"{root}/direct", planner=sc.SparseLoadPlanner())
        sc_dsd.set_optimizer_state_dict(m2, opt2, target["optim"], options=options)
        assert len(opt2.state) == dsd_moe.STEPPED
        assert_deep_equal(
            state_snapshot(m2, opt2), state_snapshot(m, opt), f"direct {options}", nan_equal="none", check_order=False
        )


@pytest.mark.slow  # every case on two ranks: the fast tier has the single-process ones
@_backends.only(_backends.DEFAULT)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dsd_cases_on_two_ranks(tmp_path: Path) -> None:
    """Once, on the default core (the single-process tests run both): ~20 s of 2-rank cases."""
    run_ranks(cases, 2, str(tmp_path), timeout=600)
    two_to_one(tmp_path)


def two_to_one(root: Path) -> None:
    """A 2-rank checkpoint into one process (no process group, plain model), installed: the state
    at the save, by FQN, nothing else."""
    m = dsd_moe.model(0)
    opt = dsd_moe.optimizer(m)
    sc_dsd.install()
    try:
        state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}
        dcp.load(state, checkpoint_id=str(root / "one-nested"))
        set_optimizer_state_dict(m, opt, state["optim"])
    finally:
        sc_dsd.uninstall()
    assert len(opt.state) == dsd_moe.STEPPED
    assert_deep_equal(
        state_snapshot(m, opt),
        torch.load(root / "one-at-save.pt", weights_only=False),
        "2 -> 1",
        nan_equal="none",
        check_order=False,
    )


# --------------------------------------------------------------------------- one process


@pytest.fixture
def restore() -> Any:
    yield
    sc_dsd.uninstall()


def test_get_invents_nothing_and_keeps_every_group() -> None:
    m = dsd_moe.model(0)
    opt = dsd_moe.optimizer(m)
    opt.param_groups[1]["lr"] = 0.125  # a scheduler moved vision's lr; nothing has stepped
    nested = sc_dsd.get_optimizer_state_dict(m, opt)
    flat = sc_dsd.get_optimizer_state_dict(m, opt, options=FLAT)
    assert not opt.state and all(p.grad is None for p in m.parameters())  # no synthetic step
    assert nested["state"] == {} and [g["lr"] for g in nested["param_groups"]] == [0.01, 0.125]
    assert [len(g["params"]) for g in nested["param_groups"]] == [dsd_moe.PARAMS - 2, 2]
    assert not [k for k in flat if k.startswith("state.")]
    assert {k.split(".")[-1] for k in flat if not is_record_key(k)} == set(opt.param_groups[0]) - {"params"}
    assert (
        len({k.rsplit(".", 1)[0] for k in flat if not is_record_key(k)}) == dsd_moe.PARAMS
    )  # param_groups.{fqn}.* for all 40
    assert flat["param_groups.vision.weight.lr"] == 0.125
    # torch's own, for the record: the same call steps the optimizer first
    STOCK["get_optimizer_state_dict"](m, opt)
    assert len(opt.state) == dsd_moe.PARAMS


def test_install_routes_torchs_own_functions_and_uninstall_restores_their_code(restore: Any) -> None:
    import inspect

    import torch.distributed.checkpoint.state_dict as dsd_module

    names = ("get_optimizer_state_dict", "set_optimizer_state_dict", "get_state_dict", "set_state_dict")
    before = {n: getattr(dsd_module, n) for n in names}
    codes = {n: f.__code__ for n, f in before.items()}
    signatures = {n: inspect.signature(f) for n, f in before.items()}
    planner = DefaultLoadPlanner.__dict__["set_up_planner"]
    here = globals()
    assert all(here[n] is before[n] for n in names)  # bound at this module's import, before install()
    sc_dsd.install()
    sc_dsd.install()  # idempotent
    assert sc_dsd.installed()
    for n in names:  # torch's objects stay where they are; their code is routed, their signature the same
        assert getattr(dsd_module, n) is before[n] and here[n] is before[n] and before[n].__code__ is not codes[n]
        assert inspect.signature(before[n]) == signatures[n] and STOCK[n].__code__ is codes[n]
    assert DefaultLoadPlanner.__dict__["set_up_planner"] is not planner
    sc_dsd.uninstall()
    assert not sc_dsd.installed()
    assert all(getattr(dsd_module, n) is before[n] and before[n].__code__ is codes[n] for n in names)
    assert DefaultLoadPlanner.__dict__["set_up_planner"] is planner
    sc_dsd.uninstall()  # no-op


def test_install_refuses_a_torch_whose_dsd_differs(restore: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def get_optimizer_state_dict(model, optimizers, *, options=None):  # type: ignore[no-untyped-def]
        raise AssertionError

    monkeypatch.setitem(functions.torch_dsd, "get_optimizer_state_dict", get_optimizer_state_dict)
    with pytest.raises(RuntimeError, match=r"written for torch .*get_optimizer_state_dict.*Nothing was installed"):
        sc_dsd.install()
    assert not sc_dsd.installed() and DefaultLoadPlanner.__dict__["set_up_planner"] is torchs_planner()


def torchs_planner() -> Any:
    from sparse_ckpt.integrations.dsd import patching

    return patching._TORCH_SET_UP_PLANNER


def trained(seed: int = 0) -> tuple[Any, Any]:
    m = dsd_moe.model(seed)
    opt = dsd_moe.optimizer(m)
    dsd_moe.train(m, opt, dsd_moe.scheduler(opt), range(2))
    return m, opt


@pytest.mark.parametrize("options", [NESTED, FLAT], ids=["nested", "flat"])
def test_strict_refuses_missing_fqns_and_lenient_keeps_the_groups_settings(options: StateDictOptions) -> None:
    m, opt = trained()
    osd = sc_dsd.get_optimizer_state_dict(m, opt, options=options)
    if options.flatten_optimizer_state_dict:
        osd = {k: v for k, v in osd.items() if ".vision." not in k}
    else:
        osd = {"state": osd["state"], "param_groups": osd["param_groups"][:1]}
    m2 = dsd_moe.model(0)
    opt2 = dsd_moe.optimizer(m2)
    opt2.param_groups[1]["lr"] = 0.5
    with pytest.raises(sc.CheckpointMismatchError, match="vision.weight"):
        sc_dsd.set_optimizer_state_dict(m2, opt2, osd, options=options)
    assert not opt2.state  # transactional
    lenient = StateDictOptions(strict=False, flatten_optimizer_state_dict=options.flatten_optimizer_state_dict)
    sc_dsd.set_optimizer_state_dict(m2, opt2, osd, options=lenient)
    assert len(opt2.state) == dsd_moe.STEPPED and opt2.param_groups[1]["lr"] == 0.5


def test_get_state_dict_ignore_frozen_params_is_torchs_model_dict() -> None:
    m, opt = trained()
    m.vision.requires_grad_(False)
    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, osd = sc_dsd.get_state_dict(m, opt, options=options)
    assert not [k for k in model_sd if k.startswith("vision.")]
    assert_deep_equal(model_sd, STOCK["get_model_state_dict"](m, options=options), "model dict")
    assert len(osd["state"]) == dsd_moe.STEPPED and len(osd["param_groups"]) == 2


class OwnStateDict(torch.optim.AdamW):
    """An optimizer class that overrides ``state_dict`` (no adapter registered)."""

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict()


@pytest.mark.parametrize("case", ["fqn_modifiers", "own_state_dict"])
def test_what_it_cannot_serve_goes_to_torch(case: str) -> None:
    """A model using DSD's ``_fqn_modifiers`` hook, an optimizer the library cannot capture: torch's
    own function runs (and steps, as torch does), so install() breaks no call that worked."""
    m = dsd_moe.model(0)
    if case == "fqn_modifiers":
        m.layers[0]._fqn_modifiers = dict  # type: ignore[assignment]
        opt = dsd_moe.optimizer(m)
    else:
        opt = OwnStateDict(dsd_moe.param_groups(m), lr=0.01)
    osd = sc_dsd.get_optimizer_state_dict(m, opt)
    assert len(opt.state) == dsd_moe.PARAMS and not isinstance(osd, sc_dsd.DsdStateDict)
    sc_dsd.set_optimizer_state_dict(m, opt, osd)


def test_a_copy_of_the_marked_dict_loads_or_is_refused_never_silently_stateless(restore: Any, tmp_path: Path) -> None:
    """Installed: a load target holding a *copy* of the dict ``get_optimizer_state_dict`` returned
    for a fresh optimizer (the mark is lost) asks for no state. A shallow copy (the same value
    objects, as NeMo Automodel's ``OptimizerState`` merges the dicts) is recognised and loads like
    the dict itself; any other copy (here one through pickle: new value objects) fails the load
    instead of reading only the settings. Unmarked targets that ask for state load as DCP loads them."""
    m, opt = trained()
    sc_dsd.install()
    for options in (NESTED, FLAT):
        dcp.save({"optim": get_optimizer_state_dict(m, opt, options=options)}, checkpoint_id=str(tmp_path / "c"))
        m2 = dsd_moe.model(0)
        opt2 = dsd_moe.optimizer(m2)
        other = {"optim": pickle.loads(pickle.dumps(dict(get_optimizer_state_dict(m2, opt2, options=options))))}
        with pytest.raises(
            CheckpointException,
            match=r"CheckpointMismatchError: the checkpoint holds optimizer state under 'optim'.*asks for none of it",
        ):
            dcp.load(other, checkpoint_id=str(tmp_path / "c"))
        for made in (dict, lambda d: {k: v for k, v in d.items()}):  # a temporary, copied: NeMo's pattern
            m2 = dsd_moe.model(0)
            opt2 = dsd_moe.optimizer(m2)
            copied = {"optim": made(get_optimizer_state_dict(m2, opt2, options=options))}
            dcp.load(copied, checkpoint_id=str(tmp_path / "c"))
            assert type(copied["optim"]) is dict
            set_optimizer_state_dict(m2, opt2, copied["optim"], options=options)
            assert with_state(opt2) == dsd_moe.STEPPED
            assert_deep_equal(
                state_snapshot(m2, opt2), state_snapshot(m, opt), "a copied target", nan_equal="none", check_order=False
            )
        marked = {"optim": get_optimizer_state_dict(m2, opt2, options=options)}
        dcp.load(marked, checkpoint_id=str(tmp_path / "c"))
        torchs = {"optim": STOCK["get_optimizer_state_dict"](m2, opt2, options=options)}  # unmarked, with state
        dcp.load(torchs, checkpoint_id=str(tmp_path / "c"))


@pytest.mark.parametrize(
    "options",
    [
        NESTED,
        FLAT,
        StateDictOptions(full_state_dict=True),
        StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True),
    ],
    ids=["nested", "flat", "full", "full-flat"],
)
def test_a_returned_dict_round_trips_through_torch_save_and_a_weights_only_load(
    tmp_path: Path, options: StateDictOptions
) -> None:
    """``torch.save`` of a returned dict (what Lightning Fabric's one-file checkpoint does) reads back
    with ``torch.load``'s default ``weights_only=True`` and loads exactly; copies are plain dicts."""
    m, opt = trained()
    osd = sc_dsd.get_optimizer_state_dict(m, opt, options=options)
    torch.save(osd, tmp_path / "osd.pt")
    back = torch.load(tmp_path / "osd.pt")
    assert isinstance(back, dict) and list(back) == list(osd)
    assert type(copy.copy(osd)) is dict and type(copy.deepcopy(osd)) is dict
    m2 = dsd_moe.model(0)
    opt2 = dsd_moe.optimizer(m2)
    sc_dsd.set_optimizer_state_dict(m2, opt2, back, options=options)
    assert_deep_equal(
        state_snapshot(m2, opt2), state_snapshot(m, opt), "through torch.save", nan_equal="none", check_order=False
    )


@pytest.mark.parametrize("options", [NESTED, FLAT], ids=["nested", "flat"])
def test_an_optimizer_that_never_stepped_round_trips_without_state(
    restore: Any, tmp_path: Path, options: StateDictOptions
) -> None:
    """Installed: saved before the first step (nothing invented), resumed with every group's settings
    and no state (DCP writes no ``state`` entry for the nested layout's empty dict)."""
    sc_dsd.install()
    m = dsd_moe.model(0)
    opt = dsd_moe.optimizer(m)
    opt.param_groups[1]["lr"] = 0.125
    dcp.save({"optim": get_optimizer_state_dict(m, opt, options=options)}, checkpoint_id=str(tmp_path))
    assert not opt.state
    m2 = dsd_moe.model(1)
    opt2 = dsd_moe.optimizer(m2)
    target = {"optim": get_optimizer_state_dict(m2, opt2, options=options)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(m2, opt2, target["optim"], options=options)
    assert not opt2.state and [g["lr"] for g in opt2.param_groups] == [0.01, 0.125]


def test_the_docs_block_runs_as_written(restore: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/integrations/dsd.md, "The lines": its block, as written, in a module of its
    own (as a script runs in ``__main__``: install() finds the names it imported before). The
    section's other blocks are the trainer drills' (test_lightning.py, test_olmo_core.py,
    test_nemo_automodel.py run them)."""
    (block,) = python_blocks(ROOT / "docs/integrations/dsd.md", "The lines")
    assert "def experts(" in block.code
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType("docs_dsd_block")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    run_block(block, vars(module))
    assert not sc_dsd.installed() and len(module.optimizer.state) == 2


def test_a_partial_load_of_a_checkpoint_without_optimizer_leaves_the_marked_dict(restore: Any, tmp_path: Path) -> None:
    """Installed, ``allow_partial_load=True`` (VeOmni's stock planner), a model-only checkpoint: the
    marked optimizer dict is left as it is, as DCP leaves what the checkpoint lacks; without partial
    loading it is a mismatch naming the path."""
    m, _ = trained()
    dcp.save({"model": get_model_state_dict(m)}, checkpoint_id=str(tmp_path))
    sc_dsd.install()
    m2 = dsd_moe.model(1)
    opt2 = dsd_moe.optimizer(m2)
    target = {"model": get_model_state_dict(m2), "optim": get_optimizer_state_dict(m2, opt2)}
    dcp.load(target, checkpoint_id=str(tmp_path), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert target["optim"]["state"] == {} and len(target["optim"]["param_groups"]) == 2
    with pytest.raises(CheckpointException, match=r"no optimizer entries under 'optim'"):
        dcp.load(target, checkpoint_id=str(tmp_path))


@pytest.mark.parametrize("options", [NESTED, FLAT], ids=["nested", "flat"])
def test_a_copy_loads_like_the_marked_dict_from_a_checkpoint_without_its_state(
    restore: Any, tmp_path: Path, options: StateDictOptions
) -> None:
    """Installed: a shallow copy of the dict returned for a fresh optimizer is rebuilt like the marked
    dict also where the checkpoint holds no state under its path: a library checkpoint saved before
    the first step (packed settings) loads every group's settings, a model-only checkpoint is left as
    it is with ``allow_partial_load`` and without it is the marked dict's mismatch (the copy was
    planned as DCP plans it: refused for the packed settings' storage type, DCP's missing key)."""
    sc_dsd.install()
    m = dsd_moe.model(0)
    opt = dsd_moe.optimizer(m)
    opt.param_groups[1]["lr"] = 0.125
    dcp.save({"optim": sc.SparseOptimizerState(m, opt)}, checkpoint_id=str(tmp_path / "library"))
    dcp.save({"model": get_model_state_dict(m)}, checkpoint_id=str(tmp_path / "model"))
    for made in (dict, lambda d: d):  # a shallow copy, the marked dict itself
        m2 = dsd_moe.model(1)
        opt2 = dsd_moe.optimizer(m2)
        target = {"optim": made(get_optimizer_state_dict(m2, opt2, options=options))}
        dcp.load(target, checkpoint_id=str(tmp_path / "library"))
        set_optimizer_state_dict(m2, opt2, target["optim"], options=options)
        assert not opt2.state and [g["lr"] for g in opt2.param_groups] == [0.01, 0.125]
        target = {"optim": made(get_optimizer_state_dict(m2, opt2, options=options))}
        before = copy.deepcopy(dict(target["optim"]))
        dcp.load(target, checkpoint_id=str(tmp_path / "model"), planner=DefaultLoadPlanner(allow_partial_load=True))
        assert_deep_equal(dict(target["optim"]), before, "a partial load without the optimizer")
        target = {"optim": made(get_optimizer_state_dict(m2, opt2, options=options))}  # DCP's load replaced a value
        with pytest.raises(
            CheckpointException, match=r"CheckpointMismatchError: the checkpoint has no optimizer entries under 'optim'"
        ):
            dcp.load(target, checkpoint_id=str(tmp_path / "model"))


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_a_lost_param_group_is_refused_by_name_and_the_optimizer_is_untouched(
    restore: Any, tmp_path: Path, strict: bool
) -> None:
    """Installed: a nested checkpoint that lost every entry of ``param_groups.0`` from its metadata (a
    partial copy) while ``param_groups.1`` is there is refused by ``set_optimizer_state_dict`` naming
    the lost item, as ``SparseOptimizerState``'s load refuses it, strict or not, the optimizer as it
    was (it was refused for missing settings when strict and, lenient, loaded without group 1's saved
    settings)."""
    m, opt = trained()
    sc_dsd.install()
    dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=str(tmp_path))
    for key in [
        k
        for k in dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
        if k.startswith("optim.param_groups.0.")
    ]:
        drop_from_metadata(tmp_path, key)
    m2, opt2 = trained(1)
    opt2.param_groups[1]["lr"] = 0.5
    before = state_snapshot(m2, opt2)
    target = {"optim": get_optimizer_state_dict(m2, opt2)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    with pytest.raises(
        sc.CheckpointMismatchError,
        match=r"optimizer item 'param_groups\.0' is missing from the checkpoint, and its list has items after it",
    ):
        set_optimizer_state_dict(m2, opt2, target["optim"], options=StateDictOptions(strict=strict))
    assert_deep_equal(state_snapshot(m2, opt2), before, "after the refused load", nan_equal="none")


def test_a_copy_is_rebuilt_or_refused_also_with_the_librarys_planner(restore: Any, tmp_path: Path) -> None:
    """Installed, ``planner=sparse_ckpt.SparseLoadPlanner()``: a shallow copy of the dict returned for
    a fresh optimizer is rebuilt and loads as with DCP's default planner, any other copy is refused,
    and the marked dict loads (the copies loaded only the settings, silently: the patched
    ``set_up_planner`` skipped the copies' rebuild and the refusal for the library's planner)."""
    m, opt = trained()
    sc_dsd.install()
    dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=str(tmp_path))
    for made in (dict, lambda d: d):  # a shallow copy, the marked dict itself
        m2 = dsd_moe.model(0)
        opt2 = dsd_moe.optimizer(m2)
        target = {"optim": made(get_optimizer_state_dict(m2, opt2))}
        dcp.load(target, checkpoint_id=str(tmp_path), planner=sc.SparseLoadPlanner())
        set_optimizer_state_dict(m2, opt2, target["optim"])
        assert with_state(opt2) == dsd_moe.STEPPED
        assert_deep_equal(
            state_snapshot(m2, opt2), state_snapshot(m, opt), "SparseLoadPlanner", nan_equal="none", check_order=False
        )
    m2 = dsd_moe.model(0)
    opt2 = dsd_moe.optimizer(m2)
    other = {"optim": pickle.loads(pickle.dumps(dict(get_optimizer_state_dict(m2, opt2))))}
    with pytest.raises(
        CheckpointException,
        match=r"CheckpointMismatchError: the checkpoint holds optimizer state under 'optim'.*asks for none of it",
    ):
        dcp.load(other, checkpoint_id=str(tmp_path), planner=sc.SparseLoadPlanner())


def test_a_copys_bytes_items_are_read_weights_only_by_the_librarys_planner(
    restore: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed, ``planner=sparse_ckpt.SparseLoadPlanner()``: the bytes items a rebuilt shallow copy
    reads (its ``param_groups`` values) are unpickled with ``weights_only=True``, as the planner's own
    targets' are (they went through DCP's full unpickler)."""
    import sparse_ckpt._dcp.planner as sc_planner

    m, opt = trained()
    sc_dsd.install()
    dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=str(tmp_path))
    bytes_items = {
        k
        for k, md in dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata.items()
        if type(md).__name__ == "BytesStorageMetadata"
    }
    assert bytes_items
    restricted: list[str] = []
    real = sc_planner.weights_only_item

    def counted(key: str, value: Any, table: bool) -> Any:
        restricted.append(key)
        return real(key, value, table)

    monkeypatch.setattr(sc_planner, "weights_only_item", counted)
    m2 = dsd_moe.model(0)
    opt2 = dsd_moe.optimizer(m2)
    target = {"optim": dict(get_optimizer_state_dict(m2, opt2))}
    dcp.load(target, checkpoint_id=str(tmp_path), planner=sc.SparseLoadPlanner())
    set_optimizer_state_dict(m2, opt2, target["optim"])
    assert set(restricted) == bytes_items
    assert_deep_equal(
        state_snapshot(m2, opt2), state_snapshot(m, opt), "weights-only copy", nan_equal="none", check_order=False
    )
