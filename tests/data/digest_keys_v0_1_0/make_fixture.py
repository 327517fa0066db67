"""Writes this directory's DCP checkpoint with sparse_ckpt as it was before stable keys.

Run from the repository root with that version's package first on the path, e.g.::

    git archive f812b65 sparse_ckpt | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:tests SPARSE_CKPT_BACKEND=python python tests/data/digest_keys_v0_1_0/make_fixture.py

It trains ``_spawned.DrillNet`` (every expert, no mesh) two steps with the MultiOptimizer of
``_spawned.build_drill`` (built here with that version's API), saves it with ``dcp.save`` and
writes ``expected.pt``: ``_spawned.local_view`` of the source (what a load must reproduce).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from _spawned import DENSE_LR, EXPERT_LR, DrillNet, local_view, train_drill

import sparse_ckpt as sc

HERE = Path(__file__).parent

model = DrillNet(range(4))
opt = sc.MultiOptimizer(
    model,
    {
        "dense": torch.optim.AdamW([*model.dense.parameters(), *model.proj.parameters()], lr=DENSE_LR),
        "experts": torch.optim.AdamW(model.experts.parameters(), lr=EXPERT_LR),
    },
)
train_drill(model, opt, 2, seed=0, rank=0)
for name in (".metadata", "__0_0.distcp"):
    (HERE / name).unlink(missing_ok=True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save({"optim": opt}, checkpoint_id=str(HERE / "ckpt"))
for f in (HERE / "ckpt").iterdir():
    shutil.move(str(f), HERE / f.name)
(HERE / "ckpt").rmdir()
torch.save(local_view(model, opt), HERE / "expected.pt")
