"""``integrations.dsd`` keeps torch DSD's semantics for extra entries, and refusals agree across ranks.

- A dict holding several optimizers' parameters (VeOmni's ``MultiOptimizer.load_state_dict`` hands
  each leaf optimizer the same merged flat dict) loads into each optimizer as DSD loads it: each
  takes its own entries; entries of model parameters outside the optimizer are ignored; an entry
  matching no model parameter stays refused under ``strict=True`` (the message says what to do).
- A rank whose optimizer lacks the parameters of its empty FSDP2 shards (Megatron-FSDP v2 builds
  its optimizers that way) resumes its own 2 -> 2 checkpoint bit-exactly: 22 of the MoE's 40
  parameters with state across the ranks, the scheduler's lrs.
  So does every layout (nested, whose ``param_groups.N.params`` DCP keeps one rank's copy of, and
  flat) into 2 ranks and into 1, and a 1-rank checkpoint into the asymmetric 2 ranks: exact.
- A refusal on one rank of a 2-rank load (``set_optimizer_state_dict``; a ``SparseOptimizerState``
  inside ``dcp.load``) raises on both ranks, naming the refusing rank, and no rank loads anything.
- ``set_optimizer_state_dict`` called on one rank only waits a bounded time for the others (not the
  process group's timeout) and refuses there, naming the rule; the other rank's next collective, and
  the next call on both ranks, work.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import _backends
import dsd_moe
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import MULTI_RANK, cpu_mesh, run_ranks
from helpers import assert_deep_equal
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from trainer_drill import SAVE_AT, STEPS, parallelize

import sparse_ckpt as sc
import sparse_ckpt.integrations.dsd as sc_dsd
from sparse_ckpt._dist import AGREEMENT_WAIT_ENV
from sparse_ckpt.integrations.dsd import functions

pytestmark = MULTI_RANK
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
STOCK = functions.torch_dsd


@pytest.fixture
def installed() -> Any:
    sc_dsd.install()
    yield
    sc_dsd.uninstall()


def two_optimizers(seed: int = 0) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
    """The MoE with VeOmni's split: the ``vision`` tower in one AdamW, the rest in another."""
    model = dsd_moe.model(seed)
    vision = [p for n, p in model.named_parameters() if n.startswith("vision.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("vision.")]
    opts = [torch.optim.AdamW(rest, lr=0.01), torch.optim.AdamW(vision, lr=dsd_moe.VISION_LR)]
    return model, opts, None


def merged_flat(get: Any, model: nn.Module, opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """VeOmni's ``MultiOptimizer.state_dict``: each optimizer's flat DSD dict, merged into one."""
    merged: dict[str, Any] = {}
    for opt in opts:
        merged.update(get(model, opt, options=FLAT))
    return merged


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    names = {p: n for n, p in model.named_parameters()}
    return {
        names[p]: {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in s.items()}
        for p, s in opt.state.items()
    }


@_backends.only(_backends.DEFAULT)
def test_a_merged_dict_of_two_optimizers_loads_into_each_as_with_stock_dsd(installed: Any) -> None:
    """VeOmni's load: the merged flat dict of two optimizers, given to each optimizer's
    ``set_optimizer_state_dict``, loads each optimizer exactly (22 parameters with state, the moved
    lr); and a merged dict stock DSD wrote and stock DSD loads (every parameter with state, from its
    synthetic step) loads with ``install()`` to the very same optimizers as with stock DSD."""
    model, opts, _ = two_optimizers()
    dsd_moe.train(model, _Both(opts), None, range(SAVE_AT))
    opts[1].param_groups[0]["lr"] = 0.005  # a scheduler moved the tower's lr (it never steps)
    merged = merged_flat(get_optimizer_state_dict, model, opts)
    fresh_model, fresh_opts, _ = two_optimizers(seed=1)
    for opt in fresh_opts:  # VeOmni's MultiOptimizer.load_state_dict, leaf by leaf
        set_optimizer_state_dict(fresh_model, opt, optim_state_dict=merged, options=FLAT)
    assert [g["lr"] for o in fresh_opts for g in o.param_groups] == [0.01, 0.005]
    got = [local_state(fresh_model, o) for o in fresh_opts]
    assert_deep_equal(got, [local_state(model, o) for o in opts], "installed")
    assert sum(map(len, got)) == dsd_moe.STEPPED

    stock_model, stock_opts, _ = two_optimizers()  # stock DSD's own round trip (it works when all have state)
    merged_flat(STOCK["get_optimizer_state_dict"], stock_model, stock_opts)  # its synthetic step: all 40
    dsd_moe.train(stock_model, _Both(stock_opts), None, range(SAVE_AT))
    stock_merged = merged_flat(STOCK["get_optimizer_state_dict"], stock_model, stock_opts)
    loaded = []
    for setter in (STOCK["set_optimizer_state_dict"], set_optimizer_state_dict):
        fresh_model, fresh_opts, _ = two_optimizers(seed=1)
        merged_flat(STOCK["get_optimizer_state_dict"], fresh_model, fresh_opts)  # what a stock trainer's target does
        for opt in fresh_opts:
            setter(fresh_model, opt, optim_state_dict=stock_merged, options=FLAT)
        loaded.append(
            ([local_state(fresh_model, o) for o in fresh_opts], [o.param_groups[0]["lr"] for o in fresh_opts])
        )
    assert sum(map(len, loaded[0][0])) == dsd_moe.PARAMS
    assert_deep_equal(loaded[1], loaded[0], "installed vs stock, on stock's dict")


class _Both:
    """Steps two optimizers (what VeOmni's MultiOptimizer.step does)."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


@_backends.only(_backends.DEFAULT)
def test_an_entry_matching_no_model_parameter_is_refused_under_strict_saying_what_to_do(installed: Any) -> None:
    """Entries of model parameters outside the optimizer are ignored, but one that matches no
    model parameter is refused under ``strict=True`` (the optimizer untouched, the message naming
    the FQN and ``strict=False``), and ignored under ``strict=False``."""
    model, opts, _ = two_optimizers()
    dsd_moe.train(model, _Both(opts), None, range(2))
    merged = merged_flat(get_optimizer_state_dict, model, opts)
    merged["param_groups.ghost.weight.lr"] = 0.01
    fresh_model, fresh_opts, _ = two_optimizers(seed=1)
    with pytest.raises(sc.CheckpointMismatchError, match=r"'ghost\.weight'.*strict=False"):
        set_optimizer_state_dict(fresh_model, fresh_opts[0], optim_state_dict=merged, options=FLAT)
    assert not fresh_opts[0].state
    lenient = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
    set_optimizer_state_dict(fresh_model, fresh_opts[0], optim_state_dict=merged, options=lenient)
    assert_deep_equal(local_state(fresh_model, fresh_opts[0]), local_state(model, opts[0]), "lenient")


def test_the_librarys_own_api_keeps_refusing_extra_fqns() -> None:
    """The packed format's strictness is unchanged: ``load_sparse_state_dict`` (the library's API)
    refuses a dict with another optimizer's parameters under ``strict=True``, saying to load all
    optimizers at once or pass ``strict=False``."""
    model, opts, _ = two_optimizers()
    dsd_moe.train(model, _Both(opts), None, range(2))
    sd = sc.sparse_state_dict(model, {"rest": opts[0], "vision": opts[1]})
    fresh_model, fresh_opts, _ = two_optimizers(seed=1)
    with pytest.raises(sc.CheckpointMismatchError, match=r"in no target optimizer group.*strict=False"):
        sc.load_sparse_state_dict(fresh_model, {"rest": fresh_opts[0]}, sd)


@_backends.only(_backends.DEFAULT)
def test_nested_groups_are_matched_by_their_members(installed: Any) -> None:
    """DSD's nested dict whose group lists only some of a live group's parameters (another rank's copy
    of ``param_groups.N.params``): the rest take that group's settings, their saved state loads, the
    dict is not changed; a live group none of whose parameters is listed stays refused (strict)."""
    model = dsd_moe.model(0)
    opt = dsd_moe.optimizer(model)
    dsd_moe.train(model, opt, dsd_moe.scheduler(opt), range(SAVE_AT))
    osd = dict(get_optimizer_state_dict(model, opt))
    short = [*osd["param_groups"][0]["params"][:-2]]  # head.weight, head.bias: listed by no group
    assert osd["param_groups"][0]["params"][-2:] == ["head.weight", "head.bias"] and "head.weight" in osd["state"]
    cut = {**osd, "param_groups": [{**osd["param_groups"][0], "params": short}, osd["param_groups"][1]]}
    fresh_model = dsd_moe.model(1)
    fresh = dsd_moe.optimizer(fresh_model)
    set_optimizer_state_dict(fresh_model, fresh, cut)
    assert cut["param_groups"][0]["params"] == short
    assert_deep_equal(local_state(fresh_model, fresh), local_state(model, opt), "members matched")
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in opt.param_groups]

    no_vision = {**osd, "param_groups": [osd["param_groups"][0], {**osd["param_groups"][1], "params": []}]}
    fresh_model = dsd_moe.model(1)
    fresh = dsd_moe.optimizer(fresh_model)
    with pytest.raises(sc.CheckpointMismatchError, match=r"no saved param-group settings: 'vision\."):
        set_optimizer_state_dict(fresh_model, fresh, no_vision)
    assert not fresh.state


# --------------------------------------------------------------------------- 2 ranks


def megatron_fsdp_v2_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """AdamW over :func:`dsd_moe.param_groups` without the parameters whose local FSDP2 shard is
    empty on this rank (what Megatron-FSDP v2 does): ``head`` (1 row) on rank 1."""
    groups = [
        {**g, "params": [p for p in g["params"] if p.to_local().numel() > 0]} for g in dsd_moe.param_groups(model)
    ]
    return torch.optim.AdamW(groups, lr=0.01)


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = parallelize(dsd_moe.model(0), cpu_mesh())
    opt = megatron_fsdp_v2_optimizer(model)
    return model, opt, dsd_moe.scheduler(opt)


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
        "state": local_state(model, opt),
        "lrs": [g["lr"] for g in opt.param_groups],
    }


def _with_state_everywhere(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    names = {p: n for n, p in model.named_parameters()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {names[p] for p in opt.state})
    return len(set().union(*gathered))


def asymmetric_and_refusals(rank: int, world_size: int, root: str) -> None:
    sc_dsd.install()
    model, opt, sched = _fresh()
    assert len(list(model.parameters())) == dsd_moe.PARAMS
    assert sum(len(g["params"]) for g in opt.param_groups) == (dsd_moe.PARAMS if rank == 0 else dsd_moe.PARAMS - 2)
    dsd_moe.train(model, opt, sched, range(STEPS), rank)
    reference = _snapshot(model, opt)

    model, opt, sched = _fresh()
    dsd_moe.train(model, opt, sched, range(SAVE_AT), rank)
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=FLAT)},
        checkpoint_id=f"{root}/asym",
    )
    sched_state = sched.state_dict()

    model, opt, sched = _fresh()
    target = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=FLAT)}
    dcp.load(target, checkpoint_id=f"{root}/asym")
    set_model_state_dict(model, target["model"])
    set_optimizer_state_dict(model, opt, target["optim"], options=FLAT)  # strict=True (DSD's default)
    sched.load_state_dict(sched_state)
    dsd_moe.train(model, opt, sched, range(SAVE_AT, STEPS), rank)
    got = _snapshot(model, opt)
    assert _with_state_everywhere(model, opt) == dsd_moe.STEPPED
    assert got["lrs"] == reference["lrs"] == sched.get_last_lr(), got["lrs"]
    assert_deep_equal(
        got, reference, f"rank {rank}: asymmetric 2 -> 2 resume", check_order=False
    )  # DCP: metadata order

    # a refusal on rank 1 only: set_optimizer_state_dict raises on both ranks, naming rank 1
    model, opt, sched = _fresh()
    bad = dict(target["optim"])
    if rank == 1:  # a dict that lost the tower's settings: strict refuses on rank 1 alone
        bad = {k: v for k, v in bad.items() if not k.startswith("param_groups.vision.weight.")}
    with pytest.raises(sc.CheckpointMismatchError, match=r"refused on rank\(s\) 1 of 2.*'vision\.weight'") as info:
        set_optimizer_state_dict(model, opt, bad, options=FLAT)
    assert ("nothing to refuse" in str(info.value)) == (rank == 0)
    assert not opt.state and [g["lr"] for g in opt.param_groups] == [0.01, dsd_moe.VISION_LR]

    # the same inside dcp.load: a SparseOptimizerState whose model on rank 0 has a parameter the
    # checkpoint lacks (its strict load refuses on rank 0 alone)
    plain = nn.Linear(4, 4) if rank == 1 else nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    first = plain if rank == 1 else plain[0]
    sgd = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    first(torch.ones(1, 4)).sum().backward()
    sgd.step()
    dcp.save({"optim": sc.SparseOptimizerState(first, sgd)}, checkpoint_id=f"{root}/plain")
    extra = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    state = sc.SparseOptimizerState(plain, extra)
    with pytest.raises(sc.CheckpointMismatchError, match=r"refused on rank\(s\) 0 of 2.*'0\.weight'") as info:
        dcp.load({"optim": state}, checkpoint_id=f"{root}/plain", planner=sc.SparseLoadPlanner())
    assert ("nothing to refuse" in str(info.value)) == (rank == 1)
    assert not extra.state
    dist.barrier()  # the next collective: no rank went on alone
    sc_dsd.uninstall()


@_backends.only(_backends.DEFAULT)
def test_an_asymmetric_optimizer_resumes_exactly_and_refusals_agree_on_two_ranks(tmp_path: Path) -> None:
    """2 Gloo ranks: the Megatron-FSDP-v2-style optimizer (rank 1 without ``head``) resumes its own
    checkpoint bit-exactly (22 of 40 with state, the scheduler's lrs); a refusal on one rank raises
    on both, naming the rank (``set_optimizer_state_dict`` and a Stateful inside ``dcp.load``)."""
    run_ranks(asymmetric_and_refusals, 2, str(tmp_path), timeout=120)


@_backends.only(_backends.DEFAULT)
@pytest.mark.parametrize("options", [StateDictOptions(), FLAT], ids=["nested", "flat"])
def test_a_shallow_copy_for_an_optimizer_with_partial_state_is_refused_not_partially_applied(
    installed: Any, tmp_path: Path, options: StateDictOptions
) -> None:
    """A trainer's shallow copy of the dict ``get_optimizer_state_dict`` returned for an optimizer
    that already holds state for some parameters asks DCP for only their state: the load is refused
    (naming the parameter whose saved state would be left unread), never applied in part; the
    optimizer keeps its state."""
    from torch.distributed.checkpoint.api import CheckpointException

    model = dsd_moe.model(0)
    opt = dsd_moe.optimizer(model)
    dsd_moe.train(model, opt, None, range(2))
    dcp.save({"optim": get_optimizer_state_dict(model, opt, options=options)}, checkpoint_id=str(tmp_path))

    def partial() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = dsd_moe.model(1)
        o = dsd_moe.optimizer(m)
        m.head(torch.randn(2, dsd_moe.DIM)).sum().backward()  # only the head steps: state for 2 of the 22
        o.step()
        o.zero_grad()
        return m, o

    m2, o2 = partial()
    assert len(o2.state) == 2
    before = local_state(m2, o2)
    target = {"optim": dict(get_optimizer_state_dict(m2, o2, options=options))}
    with pytest.raises(
        CheckpointException, match=r"holds optimizer state of '.*' under 'optim'.*only some of its parameters"
    ):
        dcp.load(target, checkpoint_id=str(tmp_path))
    assert_deep_equal(local_state(m2, o2), before, "the optimizer after the refusal")


# --------------------------------------------------------------------------- rank-asymmetric optimizers, every layout

LAYOUTS = {"nested": StateDictOptions(), "flat": FLAT}
SOURCES = {"sparse_ckpt": get_optimizer_state_dict, "stock": STOCK["get_optimizer_state_dict"]}
"""Who wrote the checkpoint: ``integrations.dsd`` (with its key record) or torch's own DSD."""


def _merged(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This process group's optimizer and parameters, whole (each FSDP2 shard list concatenated in rank
    order; a parameter's state only where some rank's optimizer holds it), and every parameter's group
    settings: comparable across world sizes. Rank-asymmetric optimizers welcome (no DTensor collective)."""
    names = {p: n for n, p in model.named_parameters()}
    mine = {
        "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
        "state": local_state(model, opt),
        "settings": {
            names[p]: {k: v for k, v in g.items() if k != "params"} for g in opt.param_groups for p in g["params"]
        },
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)

    def whole(parts: list[Any]) -> Any:
        return torch.cat(parts) if isinstance(parts[0], torch.Tensor) and parts[0].dim() else parts[0]

    fqns = sorted({f for r in ranks for f in r["state"]})
    return {
        "params": {n: whole([r["params"][n] for r in ranks]) for n in mine["params"]},
        "state": {
            f: {
                k: whole([r["state"][f][k] for r in ranks if f in r["state"]])
                for k in sorted(next(r["state"][f] for r in ranks if f in r["state"]))
            }
            for f in fqns
        },
        "settings": {f: next(r["settings"][f] for r in ranks if f in r["settings"]) for f in sorted(names.values())},
    }


def asymmetric_saves(rank: int, world_size: int, root: str) -> None:
    """Checkpoints of the asymmetric optimizer after ``SAVE_AT`` steps, in every layout, and what they hold."""
    sc_dsd.install()
    for (source, get), (layout, options) in itertools.product(SOURCES.items(), LAYOUTS.items()):
        model, opt, sched = _fresh()
        dsd_moe.train(model, opt, sched, range(SAVE_AT), rank)
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get(model, opt, options=options)},
            checkpoint_id=f"{root}/{world_size}-{source}-{layout}",
        )
        saved = _merged(model, opt)
        if rank == 0:
            torch.save(saved, f"{root}/{world_size}-{source}-{layout}.pt")
    dist.barrier()
    sc_dsd.uninstall()


def asymmetric_loads(rank: int, world_size: int, root: str, saved_by: int) -> None:
    """Every layout's checkpoint of ``saved_by`` ranks, loaded here exactly: the state that exists, no
    other, each parameter's settings (the scheduler's lrs)."""
    sc_dsd.install()
    for source, layout in itertools.product(SOURCES, LAYOUTS):
        options = LAYOUTS[layout]
        where = f"{saved_by} -> {world_size} ranks, {source} {layout}, rank {rank}"
        model, opt, _sched = _fresh()
        target = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=options)}
        dcp.load(target, checkpoint_id=f"{root}/{saved_by}-{source}-{layout}")
        set_model_state_dict(model, target["model"])
        set_optimizer_state_dict(model, opt, target["optim"], options=options)
        got = _merged(model, opt)
        want = torch.load(f"{root}/{saved_by}-{source}-{layout}.pt", weights_only=False)
        assert len(got["state"]) == dsd_moe.STEPPED, where
        assert_deep_equal(got, want, where, check_order=False)
    dist.barrier()
    sc_dsd.uninstall()


@_backends.only(_backends.DEFAULT)
def test_an_asymmetric_optimizer_resumes_exactly_in_every_layout_and_world_size(tmp_path: Path) -> None:
    """The Megatron-FSDP-v2-style optimizer (rank 1 without ``head``) in DSD's nested layout (whose
    replicated ``param_groups.N.params`` item DCP keeps from one rank: groups are matched by their
    members, per rank, as DSD matches them) and in the flat one, written by ``integrations.dsd`` and by
    torch's own DSD: 2 -> 2, 2 -> 1 and 1 -> 2 ranks, exact."""
    run_ranks(asymmetric_saves, 2, str(tmp_path), timeout=120)
    run_ranks(asymmetric_saves, 1, str(tmp_path), timeout=120)
    run_ranks(asymmetric_loads, 2, str(tmp_path), 2, timeout=120)
    run_ranks(asymmetric_loads, 1, str(tmp_path), 2, timeout=120)
    run_ranks(asymmetric_loads, 2, str(tmp_path), 1, timeout=120)


# --------------------------------------------------------------------------- a call on some ranks only

WAIT_S = "2"
"""The agreement's bound in this drill (``SPARSE_CKPT_AGREEMENT_WAIT_S``; 30 s by default)."""


def one_rank_calls(rank: int, world_size: int, root: str) -> None:
    os.environ[AGREEMENT_WAIT_ENV] = WAIT_S
    sc_dsd.install()
    model, opt, sched = _fresh()
    dsd_moe.train(model, opt, sched, range(SAVE_AT), rank)
    osd = get_optimizer_state_dict(model, opt, options=FLAT)
    fresh_model, fresh_opt, _sched = _fresh()
    if rank == 0:  # a rank-0-only restore: refused here within the bound, naming the rule, nothing loaded
        with pytest.raises(
            sc.CheckpointMismatchError,
            match=r"rank\(s\) 1 did not reach its agreement within 2 s.*"
            r"every rank of the default process group calls it",
        ) as info:
            set_optimizer_state_dict(fresh_model, fresh_opt, osd, options=FLAT)
        assert AGREEMENT_WAIT_ENV in str(info.value)
        assert not fresh_opt.state and [g["lr"] for g in fresh_opt.param_groups] == [0.01, dsd_moe.VISION_LR]
    total = torch.ones(1)
    dist.all_reduce(total)  # rank 1's next collective, and rank 0's: the process group is as it was
    assert total.item() == world_size
    set_optimizer_state_dict(fresh_model, fresh_opt, osd, options=FLAT)  # the advice: every rank calls it
    assert_deep_equal(local_state(fresh_model, fresh_opt), local_state(model, opt), f"rank {rank}: after the refusal")
    dist.barrier()
    sc_dsd.uninstall()


@_backends.only(_backends.DEFAULT)
def test_a_call_on_one_rank_only_is_refused_within_the_bound_and_the_group_goes_on(tmp_path: Path) -> None:
    """Only rank 0 calls ``set_optimizer_state_dict``: it refuses after the agreement's bound (not the
    group's 30-minute timeout), naming the rule; rank 1's next collective works, and the call made on
    both ranks then loads exactly."""
    run_ranks(one_rank_calls, 2, str(tmp_path), timeout=120)


@_backends.only(_backends.DEFAULT)
@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf"])
def test_the_agreement_bound_must_be_a_positive_number_of_seconds(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """``SPARSE_CKPT_AGREEMENT_WAIT_S`` is read at each call; a value that is no positive, finite number
    of seconds is refused naming the variable (unset: 30 s)."""
    from sparse_ckpt._dist import agreement_wait_s

    monkeypatch.delenv(AGREEMENT_WAIT_ENV, raising=False)
    assert agreement_wait_s() == 30.0
    monkeypatch.setenv(AGREEMENT_WAIT_ENV, "2.5")
    assert agreement_wait_s() == 2.5
    monkeypatch.setenv(AGREEMENT_WAIT_ENV, value)
    with pytest.raises(sc.SparseCheckpointError, match=f"{AGREEMENT_WAIT_ENV}=.*positive number of seconds"):
        agreement_wait_s()
