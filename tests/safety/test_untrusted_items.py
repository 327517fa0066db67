"""A bytes item from elsewhere never runs its code where sparse_ckpt is in the load: an optimizer item
(a packed group table, a flat or DSD-nested group setting) replaced by a pickle of a call that creates
a marker file is refused by name, the marker never created, through `sc.SparseLoadPlanner` and through
``install()`` with DCP's own planner (which DCP alone unpickles with ``weights_only=False``), and by
the tools. Under ``SPARSE_CKPT_SAFE_LOAD=1`` every bytes item, the model's too, is read weights-only;
a type one trusts loads once allowed, as the refusal advises."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import TwoLayerNet, assert_deep_equal, make_batch, snapshot_optimizer
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions
from untrusted import ITEM_GLOBAL, KINDS, Payload, bytes_keys, replace_item

import sparse_ckpt as sc
import sparse_ckpt.integrations.dsd as sc_dsd
from sparse_ckpt.integrations import safe_load
from sparse_ckpt.tools import convert_checkpoint, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

FORMATS = ("packed", "flat", "nested")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TwoLayerNet()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _optim_sd(fmt: str, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    if fmt == "nested":
        return sc_dsd.get_optimizer_state_dict(model, opt)
    return sc.SparseOptimizerState(model, opt, format=fmt)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint per format (a model with a bytes extra, a stepped AdamW)."""
    out = {}
    for fmt in FORMATS:
        model, opt = build()
        model(make_batch(0, dim=4)).sum().backward()
        opt.step()
        path = tmp_path_factory.mktemp(fmt) / "ckpt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(
                {"model": model.state_dict(), "extra": {"note": "epoch 3"}, "optim": _optim_sd(fmt, model, opt)},
                checkpoint_id=path,
            )
        out[fmt] = path
    return out


def _setting_key(path: Path) -> str:
    """An optimizer bytes item: the packed group table, or a flat / nested ``lr`` setting."""
    keys = bytes_keys(path, "optim.")
    return next((k for k in keys if k.endswith(".lr")), None) or next(k for k in keys if "__packed__" in k)


@pytest.fixture
def poisoned(
    saved: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[str, Path, str, str]]:
    """``(format, checkpoint, poisoned key, global)``; the marker must not exist afterwards."""
    fmt, kind = request.param
    path = tmp_path / "ckpt"
    shutil.copytree(saved[fmt], path)
    marker = tmp_path / "MARKER"
    key = _setting_key(path)
    replace_item(path, key, Payload(marker, kind))
    yield fmt, path, key, ITEM_GLOBAL[kind]
    assert not marker.exists(), "the checkpoint's code ran"


CASES = [(fmt, kind) for fmt in FORMATS for kind in KINDS]


def _refused(exc: BaseException, key: str, name: str) -> None:
    text = str(exc)
    assert repr(key) in text and f"global {name!r}" in text, text[-2000:]


@pytest.mark.parametrize("poisoned", CASES, indirect=True, ids=[f"{f}-{k}" for f, k in CASES])
def test_sparse_load_planner_refuses(poisoned: tuple[str, Path, str, str]) -> None:
    _fmt, path, key, name = poisoned
    model, opt = build(1)
    before = snapshot_optimizer(opt)
    with pytest.raises((sc.CheckpointFormatError, CheckpointException)) as err:
        dcp.load(
            {"optim": sc.SparseOptimizerState(model, opt)},
            storage_reader=sc.SafeFileSystemReader(path),
            planner=sc.SparseLoadPlanner(),
        )
    _refused(err.value, key, name)
    assert_deep_equal(snapshot_optimizer(opt), before)


@pytest.fixture
def installed() -> Iterator[None]:
    sc_dsd.install()
    try:
        yield
    finally:
        sc_dsd.uninstall()


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("poisoned", CASES, indirect=True, ids=[f"{f}-{k}" for f, k in CASES])
def test_install_refuses_with_dcps_own_planner(poisoned: tuple[str, Path, str, str]) -> None:
    """``install()``: the dict DSD's ``get_optimizer_state_dict`` hands out, loaded by ``dcp.load`` with
    DCP's default planner (and torch's reader): its items are read weights-only before DCP unpickles them."""
    fmt, path, key, name = poisoned
    model, opt = build(1)
    before = snapshot_optimizer(opt)
    target = sc_dsd.get_optimizer_state_dict(model, opt, options=FLAT if fmt == "flat" else None)
    with pytest.raises((sc.CheckpointFormatError, CheckpointException)) as err:
        dcp.load({"optim": target}, checkpoint_id=str(path))
    _refused(err.value, key, name)
    assert_deep_equal(snapshot_optimizer(opt), before)


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("fmt", ["flat", "nested"])
def test_install_still_loads_a_clean_checkpoint(saved: dict[str, Path], fmt: str) -> None:
    model, opt = build(1)
    options = FLAT if fmt == "flat" else None
    target = sc_dsd.get_optimizer_state_dict(model, opt, options=options)
    dcp.load({"optim": target}, checkpoint_id=str(saved[fmt]))
    sc_dsd.set_optimizer_state_dict(model, opt, target, options=options)
    assert len(opt.state) == 4 and opt.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("poisoned", [("packed", "exec"), ("flat", "dotted")], indirect=True, ids=["packed", "flat"])
def test_tools_refuse(poisoned: tuple[str, Path, str, str], tmp_path: Path) -> None:
    _fmt, path, key, name = poisoned
    report = verify_checkpoint(path)
    assert not report["ok"] and any(key in p["key"] or key in p["problem"] for p in report["problems"]), report
    with pytest.raises(sc.CheckpointFormatError) as err:
        convert_checkpoint(str(path), str(tmp_path / "out"), "flat" if _fmt == "packed" else "packed", key="optim")
    _refused(err.value, key, name)


@dataclass
class Note:
    """A trainer's own object saved as a bytes item (harmless, but not plain data)."""

    text: str


@pytest.fixture
def safe_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(safe_load.ENV, "1")
    sc_dsd.install()
    try:
        yield
    finally:
        sc_dsd.uninstall()
        safe_load.uninstall()


@pytest.mark.usefixtures("safe_env")
def test_safe_load_reads_the_models_bytes_items_weights_only(saved: dict[str, Path], tmp_path: Path) -> None:
    """``SPARSE_CKPT_SAFE_LOAD=1``: a model-side bytes item (``extra.note``) that pickles code is refused by
    name; one that holds a type the user allows, as the refusal advises, loads."""
    path = tmp_path / "ckpt"
    shutil.copytree(saved["packed"], path)
    marker = tmp_path / "MARKER"
    replace_item(path, "extra.note", Payload(marker))
    model, _opt = build(1)
    with pytest.raises(CheckpointException) as err:
        dcp.load({"model": model.state_dict(), "extra": {"note": ""}}, checkpoint_id=str(path))
    _refused(err.value, "extra.note", "exec")
    assert "add_safe_globals" in str(err.value) and not marker.exists()

    replace_item(path, "extra.note", Note("epoch 3"))
    extra = {"note": ""}
    with pytest.raises(CheckpointException, match=r"add_safe_globals"):
        dcp.load({"extra": extra}, checkpoint_id=str(path))
    with torch.serialization.safe_globals([Note]):
        dcp.load({"extra": extra}, checkpoint_id=str(path))
    assert extra == {"note": Note("epoch 3")}
