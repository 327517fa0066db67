"""The layout index of ``state_layout="buffers"`` on Gloo ranks (spawned, explicit CPU mesh; FSDP2
over ``dense``/``proj``, 6 rows each, plus plain experts): a resharding load reads only the layout
tables whose chunks overlap what the rank needs, counted at the storage reader, and loads
bit-exactly -- 4 -> 2 (expert parallelism 4 -> 2), 2 -> 4, 4 -> 1, 2 -> 1, 2 -> 2 with expert
parallelism 2 -> 1 and 4 -> 4 on an HSDP mesh (2 x 2). A checkpoint written
without an index (before it) still loads, reading every table; a lost or corrupted index is refused.
"""

from __future__ import annotations

import io
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import _backends
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _spawned import assert_matches, build_drill, cpu_mesh, local_view, merge_views, run_spawned, train_drill
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

import sparse_ckpt as sc
from sparse_ckpt._format.keys import BUFFERS_PREFIX, split_buffers_key
from sparse_ckpt._save import save as save_module
from sparse_ckpt.tools import verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

EXPERTS = 4
ROWS = 6
"""``dense`` and ``proj`` have 6 rows: FSDP2 chunks 3/3 on 2 ranks, 2/2/2/0 on 4."""


def _rows(world: int, rank: int) -> range:
    """The rows ``rank`` of ``world`` holds (torch's ``Shard``: chunks of ceil(rows / world))."""
    step = -(-ROWS // world)
    return range(min(step * rank, ROWS), min(step * rank + step, ROWS))


def _experts(world: int, rank: int) -> range:
    per = EXPERTS // world
    return range(rank * per, rank * per + per)


def expected_tables(saved: int, world: int, rank: int) -> dict[str, set[int]]:
    """Saved ranks whose layout a rank needs, by leaf: those holding rows that overlap its rows
    (one, any, for a rank without rows), and those holding its experts with state (the first
    expert of each saved rank is the only one that stepped)."""
    mine = set(_rows(world, rank))
    dense = {s for s in range(saved) if mine & set(_rows(saved, s))} or {0}
    experts = {e // (EXPERTS // saved) for e in _experts(world, rank) if e % (EXPERTS // saved) == 0}
    return {"dense": dense, "experts": experts}


@contextmanager
def counted_reads() -> Iterator[list[str]]:
    """Every item key this process reads through a ``FileSystemReader`` (DCP's read and the
    optimizer's own reads of layouts and buffers)."""
    read: list[str] = []
    original = dcp.FileSystemReader.read_data

    def recorded(self: Any, plan: Any, planner: Any) -> Any:
        read.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    with mock.patch.object(dcp.FileSystemReader, "read_data", recorded):
        yield read


def layouts_read(read: list[str]) -> dict[str, set[int]]:
    """The saved ranks whose layout table was read, by leaf (each table read at most once)."""
    out: dict[str, set[int]] = {"dense": set(), "experts": set()}
    tables = [k for k in read if k.startswith(f"optim.{BUFFERS_PREFIX}")]
    layouts = [k for k in tables if split_buffers_key(k[len(f"optim.{BUFFERS_PREFIX}") :])[1] == "layout"]
    assert len(layouts) == len(set(layouts)), layouts
    for key in layouts:
        leaf, _kind, _bucket, tag = split_buffers_key(key[len(f"optim.{BUFFERS_PREFIX}") :])
        out[leaf].update(int(r) for r in tag.partition("r")[2].split("+"))  # tags here list single ranks
    return out


def _save(rank: int, world_size: int, root: str) -> None:
    """Save at ``world_size`` ranks into ``ckpt{world_size}``, and (2 ranks) as a checkpoint written
    before the index into ``old2``."""
    model, opt = build_drill(_experts(world_size, rank), cpu_mesh(world_size))
    train_drill(model, opt, 2, seed=0, rank=rank)
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{root}/ckpt{world_size}")
    torch.save(local_view(model, opt), f"{root}/ref{world_size}_{rank}.pt")
    if world_size == 2:
        with mock.patch.object(save_module, "with_index_parts", lambda slots, _param_of: slots):
            dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{root}/old2")


def _load(path: str, world: int, rank: int, mesh: Any, experts: Any = None) -> tuple[Any, Any, list[str]]:
    model, opt = build_drill(_experts(world, rank) if experts is None else experts, mesh, seed=7)
    with counted_reads() as read:
        msd = model.state_dict()
        dcp.load({"model": msd, "optim": opt}, checkpoint_id=path, planner=sc.SparseLoadPlanner())
    model.load_state_dict(msd)
    return model, opt, read


def _reference(root: str, saved: int) -> dict[str, Any]:
    return merge_views([torch.load(f"{root}/ref{saved}_{r}.pt") for r in range(saved)])


def _load_resharded(rank: int, world_size: int, root: str, cases: list[tuple[str, int, bool]]) -> None:
    """Each ``(checkpoint, saved world, indexed)``: loads exactly, reading the tables overlap needs
    (every table of the leaf without an index)."""
    mesh = cpu_mesh(world_size)
    for name, saved, indexed in cases:
        model, opt, read = _load(f"{root}/{name}", world_size, rank, mesh)
        assert_matches(local_view(model, opt), _reference(root, saved), f"rank {rank}: {name} -> {world_size}")
        want = (
            expected_tables(saved, world_size, rank)
            if indexed
            else {leaf: set(range(saved)) for leaf in ("dense", "experts")}
        )
        assert layouts_read(read) == want, (name, rank, read)
        dist.barrier()
    if world_size == 4:  # the same world on another mesh: HSDP (2 replicas x 2 shards) reads the
        # index when its own layout does not cover its 3 rows, then the tables holding them
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model, opt, read = _load(f"{root}/ckpt4", world_size, rank, hsdp)
        assert_matches(local_view(model, opt), _reference(root, 4), f"rank {rank}: ckpt4 -> 4, HSDP 2x2")
        rows = {s for s in range(4) if set(_rows(2, rank % 2)) & set(_rows(4, s))}
        assert layouts_read(read) == {"dense": {rank} | rows, "experts": {rank}}, read
        dist.barrier()
    if world_size == 2:  # the same world, expert parallelism 2 -> 1: this rank's own dense layout, and
        # the experts' tables the index points to (experts 0 and 2 have state: saved ranks 0 and 1)
        model, opt, read = _load(f"{root}/ckpt2", world_size, rank, mesh, range(EXPERTS))
        assert_matches(local_view(model, opt), _reference(root, 2), f"rank {rank}: ckpt2 -> 2, expert parallelism 1")
        assert layouts_read(read) == {"dense": {rank}, "experts": {0, 1}}, read
        assert f"optim.{BUFFERS_PREFIX}dense.Iw2r0-1" not in read  # own layout covered: the index was not read
        dist.barrier()


def _refused(rank: int, world_size: int, root: str, cases: dict[str, list[str]]) -> None:
    """Each damaged checkpoint is refused (the error names the index), the optimizer untouched."""
    mesh = cpu_mesh(world_size)
    for name, (error, match) in cases.items():
        _model, opt = build_drill(_experts(world_size, rank), mesh, seed=7)
        # a damaged item is refused while DCP reads it, so DCP wraps the error in its CheckpointException
        with pytest.raises((getattr(sc, error), CheckpointException), match=match) as caught:
            dcp.load({"optim": opt}, checkpoint_id=f"{root}/{name}", planner=sc.SparseLoadPlanner())
        assert error in f"{type(caught.value).__name__} {caught.value}"
        assert not any(o.state for _leaf, o in opt.leaves())
        dist.barrier()


def _one_process(root: str, name: str, saved: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, read = _load(f"{root}/{name}", 1, 0, None)
    assert_matches(local_view(model, opt), _reference(root, saved), f"{name} -> 1")
    assert layouts_read(read) == expected_tables(saved, 1, 0), read


def _index_key(root: Path, name: str, leaf: str) -> str:
    keys = dcp.FileSystemReader(str(root / name)).read_metadata().state_dict_metadata
    return next(k for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}{leaf}.I"))


def _damaged(root: Path, name: str, edit: str) -> str:
    """A copy of ``ckpt4`` whose ``dense`` layout index is lost (``edit="lost"``: gone from the
    metadata) or corrupted (one letter of an FQN in it changed); returns the index key."""
    import pickle

    shutil.copytree(root / "ckpt4", root / name)
    key = _index_key(root, name, "dense")
    with open(root / name / ".metadata", "rb") as f:
        md = pickle.load(f)
    [index] = [i for i in md.storage_data if i.fqn == key]
    if edit == "lost":
        del md.state_dict_metadata[key]
        del md.storage_data[index]
        with open(root / name / ".metadata", "wb") as f:
            pickle.dump(md, f)
    else:
        info = md.storage_data[index]
        with open(root / name / info.relative_path, "r+b") as f:
            f.seek(info.offset)
            stored = f.read(info.length)  # DCP stores bytes as torch.save's (uncompressed) zip
            assert b"dense.weight" in torch.load(io.BytesIO(stored), weights_only=True)
            f.seek(info.offset + stored.index(b"dense.weight"))  # an FQN the index lists: one letter changed
            f.write(b"e")
    return key.removeprefix("optim.")


@_backends.only(_backends.DEFAULT)
def test_resharding_reads_only_overlapping_layouts(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_spawned(_save, 4, root)
    run_spawned(_save, 2, root)
    for name, saved in (("ckpt4", 4), ("ckpt2", 2), ("old2", 2)):
        index = [k for k in dcp.FileSystemReader(f"{root}/{name}").read_metadata().state_dict_metadata if ".I" in k]
        assert len(index) == (0 if name == "old2" else 2), index  # one per leaf, written once
    lost = _damaged(tmp_path, "lost4", "lost")
    corrupt = _damaged(tmp_path, "corrupt4", "corrupt")
    run_spawned(_load_resharded, 2, root, [("ckpt4", 4, True)])  # and ckpt2 at expert parallelism 1
    run_spawned(
        _refused,
        2,
        root,
        {
            "lost4": ("CheckpointMismatchError", f"item {lost!r} is missing"),
            # the changed byte fails the item's zip CRC-32 before the index's own sealed digest is checked
            "corrupt4": (
                "CheckpointFormatError",
                rf"layout table 'optim\.{re.escape(corrupt)}': .*fails its CRC-32 check",
            ),
        },
    )
    run_spawned(_load_resharded, 4, root, [("ckpt2", 2, True), ("old2", 2, False)])  # and ckpt4 on HSDP
    _one_process(root, "ckpt4", 4)
    _one_process(root, "ckpt2", 2)
    # verify checks each index against the layouts; the corrupted one fails its zip CRC already
    assert verify_checkpoint(f"{root}/ckpt4")["ok"] and verify_checkpoint(f"{root}/ckpt2")["ok"]
    report = verify_checkpoint(f"{root}/corrupt4")
    assert not report["ok"] and report["problems"][0]["key"] == f"optim.{corrupt}", report["problems"]


def test_expected_tables_follow_the_overlap() -> None:
    """The test's own geometry: 4 -> 2 needs two tables per leaf on each rank, 2 -> 4 one or two."""
    assert [expected_tables(4, 2, r) for r in range(2)] == [
        {"dense": {0, 1}, "experts": {0, 1}},
        {"dense": {1, 2}, "experts": {2, 3}},
    ]
    assert [expected_tables(2, 4, r) for r in range(4)] == [
        {"dense": {0}, "experts": {0}},
        {"dense": {0, 1}, "experts": set()},
        {"dense": {1}, "experts": {1}},
        {"dense": {0}, "experts": set()},
    ]
