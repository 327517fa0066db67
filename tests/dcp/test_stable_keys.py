"""Stable item keys (see *Table keys* in sparse_ckpt/_format/keys.py): keys stay while values move,
equal tables share a key, different ones never do, old digest-keyed checkpoints keep loading.

The two-rank part (spawned Gloo ranks, FSDP2 over an explicit CPU mesh) checks DCP's save-plan
caching: it hits on saves 2 and 3, in both state layouts, and a table change on one rank only
is written (both tables) and refused on load; expert-parallel ranks get tables of their own.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, ClassVar

import _backends
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _spawned import assert_matches, build_drill, cpu_mesh, local_view, run_spawned, train_drill
from helpers import assert_optimizer_equal, experts_and_dense, make_moe, train
from hypothesis import given, settings
from hypothesis import strategies as st
from legacy_checkpoints import legacy
from torch.distributed.checkpoint import DefaultSavePlanner

import sparse_ckpt as sc
from sparse_ckpt._format.keys import (
    BUFFERS_PREFIX,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    check_table,
    parse_rank_tag,
    rank_tag,
    tag_has_rank,
)
from sparse_ckpt._format.tags import Keying
from sparse_ckpt._save.save import build_state_dict
from sparse_ckpt.errors import CheckpointFormatError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# --------------------------------------------------------------------------- rank tags


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.integers(1, 3000).flatmap(lambda w: st.tuples(st.just(w), st.sets(st.integers(0, w - 1), min_size=1))))
def test_rank_tags_round_trip(spec: tuple[int, set[int]]) -> None:
    world, ranks = spec
    tag = rank_tag(world, ranks)
    assert "." not in tag and tag.startswith(f"w{world}r")
    assert parse_rank_tag(tag) is not None
    assert {r for r in range(world) if tag_has_rank(tag, world, r)} == ranks
    assert not tag_has_rank(tag, world + 1, min(ranks))


def test_rank_tags_are_compact() -> None:
    assert rank_tag(1, [0]) == "w1r0"
    assert rank_tag(1024, range(1024)) == "w1024r0-1023"
    assert rank_tag(1024, range(3, 1024, 8)) == "w1024r3-1019:8"  # an HSDP replica group
    assert rank_tag(8, [0, 5]) == "w8r0+5"
    assert rank_tag(8, [1, 2, 3, 7]) == "w8r1-3+7"


@pytest.mark.parametrize(
    "tag",
    ["w", "w2", "w2r", "w2r2", "w2r-1", "w2r0-", "w2r1-0", "w2r0:2", "w2r0-1:0", "wxr0", "w2r0++1", "w2r 0", "w02r0x"],
)
def test_malformed_rank_tags_are_refused(tag: str) -> None:
    with pytest.raises(CheckpointFormatError, match="is not a valid"):
        parse_rank_tag(tag)


def test_a_rank_tagged_table_is_sealed() -> None:
    model = make_moe(0)
    opt = torch.optim.AdamW(model.parameters())
    train(model, opt, 1)
    sd = sc.sparse_state_dict(model, opt)
    key = next(k for k in sd if k.startswith(PACKED_PREFIX))
    assert key == f"{PACKED_PREFIX}optim.w1r0"
    rest = key[len(PACKED_PREFIX) :]
    table = check_table(PACKED_PREFIX, rest, sd[key])[1]
    assert sd[key][: len(table)] == table and len(sd[key]) == len(table) + 8
    for at in (0, len(table) // 2, len(sd[key]) - 1):
        bad = bytearray(sd[key])
        bad[at] ^= 1
        with pytest.raises(CheckpointFormatError, match="does not match its sealed digest"):
            check_table(PACKED_PREFIX, rest, bytes(bad))
    with pytest.raises(CheckpointFormatError, match="does not match its sealed digest"):
        check_table(PACKED_PREFIX, rest, b"")


# --------------------------------------------------------------------------- one process


def test_keys_stay_when_values_move() -> None:
    """An lr change and another step change values only: the same keys, in both layouts."""
    model = make_moe(0)
    opt = experts_and_dense(model, lambda params: torch.optim.AdamW(params, lr=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt["dense"], step_size=1, gamma=0.5)
    for layout in ("per_tensor", "buffers"):
        train(model, opt, 1, only_experts=[0])
        first = sc.sparse_state_dict(model, opt, state_layout=layout)
        train(model, opt, 1, only_experts=[0])
        sched.step()
        second = sc.sparse_state_dict(model, opt, state_layout=layout)
        assert list(first) == list(second)
        tables = [k for k in first if k.startswith((PACKED_PREFIX, SCALARS_PREFIX))]
        assert [k.rpartition(".")[2] for k in tables] == ["w1r0"] * 4
        moved = [k for k in tables if first[k] != second[k]]  # the values moved: steps, the dense lr
        assert moved == [k for k in tables if k.startswith(SCALARS_PREFIX)] + [f"{PACKED_PREFIX}dense.w1r0"]


def test_ranks_that_cannot_coordinate_key_tables_by_content() -> None:
    """``sparse_state_dict`` on a rank of several (no collective): tables by digest, so equal
    tables still share a key and different ones never do; layouts by the rank itself."""
    model = make_moe(0)
    opt = torch.optim.AdamW(model.parameters())
    train(model, opt, 1)
    a, b = (build_state_dict(model, opt, "packed", Keying(world=2, rank=r), "buffers") for r in (0, 1))
    tables = [k for k in a if k.startswith((PACKED_PREFIX, SCALARS_PREFIX))]
    assert all(k.rpartition(".")[2].startswith("d") for k in tables) and tables == [
        k for k in b if k.startswith((PACKED_PREFIX, SCALARS_PREFIX))
    ]
    assert [k.rpartition(".")[2] for k in a if k.startswith(BUFFERS_PREFIX)] == ["Lw2r0", "B0_float32_w2r0"]
    assert [k.rpartition(".")[2] for k in b if k.startswith(BUFFERS_PREFIX)] == [
        "Lw2r1",
        "B0_float32_w2r1",
    ]  # bucket keys name their dtype
    for g in opt.param_groups:
        g["lr"] = 0.5
    c = build_state_dict(model, opt, "packed", Keying(world=2, rank=0))
    assert [k for k in c if k.startswith(PACKED_PREFIX)] != [k for k in a if k.startswith(PACKED_PREFIX)]


def test_digest_keyed_checkpoints_keep_loading(tmp_path: Path) -> None:
    model = make_moe(0)
    src = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, src, 2, only_experts=[1])
    old = legacy(sc.sparse_state_dict(model, src))
    assert all(len(k.rpartition(".")[2]) == 16 for k in old if "__packed__" in k)
    dcp.save({"optim": old}, checkpoint_id=tmp_path, no_dist=True)
    for how in ("dict", "dcp"):
        model2 = make_moe(1)
        model2.load_state_dict(model.state_dict())
        dst = torch.optim.AdamW(model2.parameters(), lr=0.5)
        if how == "dict":
            sc.load_sparse_state_dict(model2, dst, old)
        else:
            target = {"optim": sc.SparseOptimizerState(model2, dst).state_dict()}
            dcp.load(target, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner(), no_dist=True)
            sc.SparseOptimizerState(model2, dst).load_state_dict(target["optim"])
        assert_optimizer_equal(dst, src, grads=False, state_order=False)


FIXTURE = Path(__file__).resolve().parents[1] / "data" / "digest_keys_v0_1_0"
"""A DCP checkpoint written by sparse_ckpt before stable keys (commit f812b65) and the view its
load must give (``expected.pt``): see ``make_fixture.py`` there."""


def test_a_checkpoint_written_before_stable_keys_loads(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    keys = list(dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata)
    assert [k for k in keys if "__packed__" in k] and all(
        len(k.rpartition(".")[2]) == 16 for k in keys if "__packed__" in k
    )
    model, opt = build_drill(range(4), None, seed=3)
    expected = torch.load(FIXTURE / "expected.pt")
    with torch.no_grad():  # the fixture holds the optimizer only; the parameters come from the view
        for name, p in model.named_parameters():
            p.copy_(expected[name][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"optim": opt}, checkpoint_id=tmp_path / "ckpt", planner=sc.SparseLoadPlanner())
    assert_matches(local_view(model, opt), expected, "pre-stable-keys checkpoint")


# --------------------------------------------------------------------------- two ranks


def _probe(name: str) -> type[DefaultSavePlanner]:
    """A caching DefaultSavePlanner class (DCP caches per class name) recording, per save, whether
    this rank's local plan was unchanged (a hit: DCP then sends an empty plan)."""

    class Probe(DefaultSavePlanner):
        hits: ClassVar[list[bool]] = []

        def __init__(self) -> None:
            super().__init__(enable_plan_caching=True)

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            Probe.hits.append(not plan.usable)
            return plan

    Probe.__name__ = Probe.__qualname__ = f"Probe_{name}"
    return Probe


def _tables(path: str, kind: str, leaf: str) -> list[str]:
    md = dcp.FileSystemReader(path).read_metadata()
    return sorted(k.rpartition(".")[2] for k in md.state_dict_metadata if f".{kind}.__packed__.{leaf}." in k)


def _plan_caching(rank: int, world_size: int, root: str) -> None:
    mesh = cpu_mesh(world_size)
    for layout in ("per_tensor", "buffers"):
        probe = _probe(layout)
        model, opt = build_drill((2 * rank, 2 * rank + 1), mesh, state_layout=layout)
        sched = torch.optim.lr_scheduler.StepLR(opt["dense"], step_size=1, gamma=0.5)
        for i in range(3):
            train_drill(model, opt, 1, seed=i, rank=rank)
            sched.step()
            dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{root}/{layout}{i}", planner=probe())
        assert probe.hits == [False, True, True], (layout, rank, probe.hits)
        assert _tables(f"{root}/{layout}2", "param_groups", "dense") == ["w2r0-1"]  # equal on both: written once
        assert _tables(f"{root}/{layout}2", "param_groups", "experts") == ["w2r0", "w2r1"]  # expert parallel
        assert _tables(f"{root}/{layout}2", "state", "dense") == ["w2r0-1"]
        reference = local_view(model, opt)

        model2, opt2 = build_drill((2 * rank, 2 * rank + 1), mesh, seed=5, state_layout=layout)
        msd = model2.state_dict()
        dcp.load({"model": msd, "optim": opt2}, checkpoint_id=f"{root}/{layout}2", planner=sc.SparseLoadPlanner())
        model2.load_state_dict(msd)
        assert_matches(local_view(model2, opt2), reference, f"rank {rank} {layout}")

        # Only rank 1's dense lr moves: both tables are written, and the load refuses the conflict.
        if rank == 1:
            opt["dense"].param_groups[0]["lr"] = 0.125
        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{root}/{layout}3", planner=probe())
        assert probe.hits[-1] is False
        assert _tables(f"{root}/{layout}3", "param_groups", "dense") == ["w2r0", "w2r1"]
        assert _tables(f"{root}/{layout}3", "state", "dense") == ["w2r0-1"]  # the steps still agree
        _model3, opt3 = build_drill((2 * rank, 2 * rank + 1), mesh, seed=5, state_layout=layout)
        with pytest.raises(
            sc.CheckpointMismatchError, match=r"conflicting saved settings for parameter 'dense\.weight'"
        ):
            dcp.load({"optim": opt3}, checkpoint_id=f"{root}/{layout}3", planner=sc.SparseLoadPlanner())
        assert not opt3["dense"].state
        dist.barrier()


@_backends.ranks
def test_plan_caching_hits_and_a_one_rank_change_is_kept(tmp_path: Path) -> None:
    run_spawned(_plan_caching, 2, str(tmp_path))
    with open(tmp_path / "per_tensor3" / ".metadata", "rb") as f:
        md = pickle.load(f)
    assert len([k for k in md.state_dict_metadata if ".param_groups.__packed__.dense." in k]) == 2
