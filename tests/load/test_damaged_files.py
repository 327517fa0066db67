"""Damaged data files and lost storage records: an exact load or a sparse_ckpt error, never a raw one.

A deterministic sample of the damages ``python -m bench.damaged_files`` sweeps (zeroed byte ranges,
truncations, a removed data file, each storage record dropped from ``.metadata``), for the packed
format (``per_tensor`` and ``auto`` layouts) and the flat one, through `SparseOptimizerState` +
`SparseLoadPlanner` and through torch DSD's functions under ``integrations.dsd.install()``: no raw
exception, a refusal leaves the optimizer unchanged and never advises ``weights_only=False``. The
checkpoint tools read the same files and refuse them the same way. By default the sweep runs a
`_sampling.sample` of those damages (every kind at least once); CI runs each one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _sampling import sample

import sparse_ckpt as sc
from bench.drills import damaged_files
from sparse_ckpt.tools import convert_checkpoint, inspect_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STRIDE = 1999
"""Every 1999th byte offset of ~24 KiB data files (the bench: every one)."""


def _pick(cases: list[tuple[str, Any]], seed: str) -> list[tuple[str, Any]]:
    """A `_sampling.sample` of a variant's damages: every kind (delete, zero, truncate, record) at least once."""
    return sample(cases, seed, lambda case: case[0].split(" ")[0])


@pytest.mark.parametrize("surface", damaged_files.SURFACES)
def test_sampled_damages_are_exact_or_refused(surface: str) -> None:
    """Zeroed ranges, truncations, a removed file, every dropped storage record: 0 raw outcomes."""
    result = damaged_files.sweep(STRIDE, 16, surfaces=(surface,), pick=_pick)
    assert result["raw"] == 0, "\n".join(result["raw_cases"][:10])
    assert result["refused"] >= 20 and result["exact"] >= 1, result


@pytest.mark.parametrize(("fmt", "layout"), damaged_files.VARIANTS)
def test_refusal_names_item_and_file(tmp_path: Path, fmt: str, layout: str) -> None:
    """A data file cut short: a CheckpointFormatError naming an item and the file, the optimizer unchanged."""
    path, saved, model_sd = damaged_files.save(str(tmp_path), fmt, layout)
    data = os.path.join(path, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) // 2)
    model, opt = damaged_files._stepped(7)
    model.load_state_dict(model_sd)
    outcome, detail = damaged_files.classify(lambda: damaged_files._load_stateful(path, fmt, model, opt), opt, saved)
    assert outcome == "refused", detail
    assert "CheckpointFormatError" in detail and "__0_0.distcp" in detail and "checkpoint item" in detail, detail


def test_zeroed_table_bytes_never_advise_weights_only_false(tmp_path: Path) -> None:
    """Zeroing every byte of the data file: refused, and no message repeats torch's advice."""
    path, saved, model_sd = damaged_files.save(str(tmp_path), "packed", "per_tensor")
    data = os.path.join(path, "__0_0.distcp")
    damaged_files._zero(data, 0, os.path.getsize(data))
    model, opt = damaged_files._stepped(7)
    model.load_state_dict(model_sd)
    outcome, detail = damaged_files.classify(
        lambda: damaged_files._load_stateful(path, "packed", model, opt), opt, saved
    )
    assert outcome == "refused", detail
    assert damaged_files.BAD_ADVICE not in detail


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_tools_refuse_damaged_files(tmp_path: Path, damage: str) -> None:
    """The checkpoint tools' reader: a removed or cut data file is a CheckpointFormatError."""
    path, _saved, _model_sd = damaged_files.save(str(tmp_path), "packed", "per_tensor")
    data = os.path.join(path, "__0_0.distcp")
    if damage == "delete":
        os.remove(data)
    else:
        os.truncate(data, 100)
    with pytest.raises(sc.CheckpointFormatError, match="__0_0.distcp"):
        inspect_checkpoint(path)
    with pytest.raises(sc.CheckpointFormatError, match="__0_0.distcp"):
        convert_checkpoint(path, str(tmp_path / "out"), to="flat")
