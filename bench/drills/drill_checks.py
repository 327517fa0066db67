"""The resume drill's checks: bit-identical snapshots, no optimizer state where none may exist."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from .drill_model import VISION_LR, DrillConfig, DrillModel


def compare_snapshots(ref: Mapping[str, Any], got: Mapping[str, Any], where: str) -> dict[str, int]:
    """Assert two :func:`snapshot` results are bit-identical; return counts of what was compared."""
    assert got["step"] == ref["step"], f"{where}: step {got['step']} vs {ref['step']}"
    assert got["lr"] == ref["lr"], f"{where}: lr {got['lr']} vs {ref['lr']}"
    assert got["sched"] == ref["sched"], f"{where}: scheduler state {got['sched']} vs {ref['sched']}"
    for part in ("params", "state"):
        assert list(got[part]) == list(ref[part]), f"{where}: {part} keys {list(got[part])} vs {list(ref[part])}"
    for name, value in ref["params"].items():
        other = got["params"][name]
        assert other.dtype == value.dtype and torch.equal(other, value), f"{where}: parameter {name} differs"
    n_tensors = 0
    for name, st in ref["state"].items():
        other = got["state"][name]
        assert list(other) == list(st), f"{where}: state keys of {name}: {list(other)} vs {list(st)}"
        for key, value in st.items():
            assert other[key].dtype == value.dtype and torch.equal(other[key], value), f"{where}: state {name}.{key}"
            n_tensors += 1
    return {"params": len(ref["params"]), "state_params": len(ref["state"]), "state_tensors": n_tensors}


def check_snapshot_sparsity(snap: Mapping[str, Any], cfg: DrillConfig, initial: DrillModel) -> None:
    """The snapshot has no state for unrouted experts or vision, and the frozen tower never moved."""
    unrouted = tuple(cfg.unrouted_prefixes())
    for key in snap["state"]:
        leaf, _, fqn = key.partition("/")
        assert leaf != "vision" and not fqn.startswith(unrouted), f"unexpected optimizer state for {key}"
    for name, p in initial.named_parameters():
        if name.startswith(unrouted) or name.startswith("vision."):
            assert torch.equal(snap["params"][name], p.detach()), f"{name} changed although it never had a grad"
    assert snap["lr"]["vision"] == [VISION_LR * 0.25], f"vision lr {snap['lr']['vision']} != [{VISION_LR * 0.25}]"


def check_checkpoint_keys(path: Path, cfg: DrillConfig) -> int:
    """No ``optim.state`` item in the checkpoint at ``path`` for unrouted experts or vision; count them."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    unrouted = tuple(cfg.unrouted_prefixes())
    n = 0
    for key in md.state_dict_metadata:
        if key.startswith("optim.state."):
            n += 1
            body = key[len("optim.state.") :]
            assert not body.startswith(unrouted) and not body.startswith("vision."), f"{path.name}: saved {key}"
    assert n, f"{path.name}: no optimizer state saved"
    return n
