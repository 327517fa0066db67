"""Complete or refused on 2 Gloo ranks (FSDP2 + expert parallelism, ``state_layout="buffers"``
and ``"per_tensor"``): a checkpoint that lost one rank's layout table and its buffers, or any one
table or buffer item, is refused on every rank (the group tables' item record lists every rank's
items, so a rank refuses also when it needed nothing of what was lost), the optimizers untouched;
the intact checkpoint loads exactly.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import _backends
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _spawned import assert_matches, build_drill, cpu_mesh, local_view, run_spawned, train_drill
from helpers import assert_optimizer_equal, snapshot_optimizer

import sparse_ckpt as sc
from sparse_ckpt._format.keys import BUFFERS_PREFIX, PACKED_PREFIX, SCALARS_PREFIX

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save(rank: int, world_size: int, root: str, layout: str) -> None:
    model, opt = build_drill((2 * rank, 2 * rank + 1), cpu_mesh(world_size), state_layout=layout)
    train_drill(model, opt, 2, seed=0, rank=rank)
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{root}/ckpt")
    torch.save(local_view(model, opt), f"{root}/ref{rank}.pt")


def _try_all(rank: int, world_size: int, root: str, cases: list[str], layout: str) -> None:
    outcomes = {}
    for case in cases:
        model, opt = build_drill((2 * rank, 2 * rank + 1), cpu_mesh(world_size), seed=7, state_layout=layout)
        train_drill(model, opt, 1, seed=3, rank=rank)
        before = snapshot_optimizer(opt)
        try:
            dcp.load({"optim": opt}, checkpoint_id=f"{root}/{case}", planner=sc.SparseLoadPlanner())
        except sc.SparseCheckpointError as exc:
            assert_optimizer_equal(opt, before)
            outcomes[case] = type(exc).__name__
            continue
        outcomes[case] = "loaded"
        if case == "intact":
            msd = model.state_dict()
            dcp.load({"model": msd}, checkpoint_id=f"{root}/{case}")
            model.load_state_dict(msd)
            assert_matches(local_view(model, opt), torch.load(f"{root}/ref{rank}.pt"), f"rank {rank} intact")
    Path(f"{root}/outcomes{rank}.json").write_text(json.dumps(outcomes))


def _without(root: Path, name: str, keys: list[str]) -> None:
    shutil.copytree(root / "ckpt", root / name)
    with open(root / name / ".metadata", "rb") as f:
        md = pickle.load(f)
    for key in keys:
        del md.state_dict_metadata[key]
        for index in [i for i in md.storage_data if i.fqn == key]:
            del md.storage_data[index]
    with open(root / name / ".metadata", "wb") as f:
        pickle.dump(md, f)


@_backends.ranks
@pytest.mark.parametrize("layout", ["buffers", "per_tensor"])
def test_a_lost_rank_or_table_is_refused_on_every_rank(tmp_path: Path, layout: str) -> None:
    root = str(tmp_path)
    run_spawned(_save, 2, root, layout)
    keys = list(dcp.FileSystemReader(f"{root}/ckpt").read_metadata().state_dict_metadata)
    tables = [
        k
        for k in keys
        if k.startswith((f"optim.{PACKED_PREFIX}", f"optim.{SCALARS_PREFIX}", f"optim.{BUFFERS_PREFIX}"))
    ]
    cases = {"intact": []}
    for i, key in enumerate(tables):
        cases[f"lost{i}"] = [key]
    rank1 = [k for k in tables if k.startswith(f"optim.{BUFFERS_PREFIX}") and k.endswith("w2r1")]
    if rank1:
        cases["rank1"] = rank1  # a lost rank: its layout tables and all its buffers
    for name, lost in cases.items():
        if name != "intact":
            _without(tmp_path, name, lost)
    if "intact" in cases:
        shutil.copytree(tmp_path / "ckpt", tmp_path / "intact")
    run_spawned(_try_all, 2, root, list(cases), layout)
    for rank in range(2):
        outcomes = json.loads(Path(f"{root}/outcomes{rank}.json").read_text())
        assert outcomes["intact"] == "loaded"
        refused = {name for name, got in outcomes.items() if got != "loaded"}
        assert refused == set(cases) - {"intact"}, (rank, {n: (cases[n], outcomes[n]) for n in cases})
