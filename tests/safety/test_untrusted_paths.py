"""Nothing is read outside a checkpoint's directory: a ``.metadata`` whose storage records point at a
file outside it (``../x``, an absolute path, a symbolic link inside leading out) is refused naming the
item by `sc.SafeFileSystemReader`, by ``SPARSE_CKPT_SAFE_LOAD=1`` with torch's own reader, and by the
tools; torch's reader alone reads the outside file (what the refusal prevents)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from untrusted import metadata, move_storage, write_metadata

import sparse_ckpt as sc
from sparse_ckpt.integrations import safe_load
from sparse_ckpt.tools import inspect_checkpoint, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WHERE = ("parent", "absolute", "symlink")


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, opt = build(0)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("clean") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=path)
    return path


@pytest.fixture(params=WHERE)
def moved(clean: Path, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, str]:
    path = tmp_path / "ckpt"
    shutil.copytree(clean, path)
    return path, move_storage(path, request.param)


def _load(path: Path, reader: object = None) -> nn.Module:
    model, opt = build(1)
    msd = model.state_dict()
    where = {"storage_reader": reader} if reader is not None else {"checkpoint_id": str(path)}
    dcp.load({"model": msd, "optim": sc.SparseOptimizerState(model, opt)}, planner=sc.SparseLoadPlanner(), **where)
    model.load_state_dict(msd)
    return model


def _refused(exc: BaseException, rel: str) -> None:
    text = str(exc)
    assert (
        f"is stored at {rel!r}" in text and "checkpoint item '" in text and "nothing outside the checkpoint" in text
    ), text[-1500:]


def test_torchs_reader_reads_outside(moved: tuple[Path, str], clean: Path) -> None:
    """The crafted checkpoints are loadable by torch's reader: the data really is read from outside."""
    path, _rel = moved
    assert _load(path).weight.equal(_load(clean).weight)


def test_safe_reader_refuses(moved: tuple[Path, str]) -> None:
    path, rel = moved
    with pytest.raises((sc.CheckpointFormatError, CheckpointException)) as err:
        _load(path, sc.SafeFileSystemReader(path))
    _refused(err.value, rel)


def test_safe_load_refuses_through_torchs_reader(moved: tuple[Path, str]) -> None:
    path, rel = moved
    safe_load.install()
    try:
        with pytest.raises(CheckpointException) as err:
            _load(path)
    finally:
        safe_load.uninstall()
    _refused(err.value, rel)


def test_tools_refuse(moved: tuple[Path, str]) -> None:
    path, rel = moved
    for call in (inspect_checkpoint, verify_checkpoint):
        with pytest.raises(sc.CheckpointFormatError) as err:
            call(path)
        _refused(err.value, rel)


def test_a_subdirectory_inside_is_fine(clean: Path, tmp_path: Path) -> None:
    """A storage path with ``..`` that stays inside the directory is not refused (the path is resolved)."""
    path = tmp_path / "ckpt"
    shutil.copytree(clean, path)
    (path / "sub").mkdir()
    md = metadata(path)
    for info in md.storage_data.values():
        info.relative_path = f"sub/../{info.relative_path}"
    write_metadata(path, md)
    assert _load(path, sc.SafeFileSystemReader(path)).weight.equal(_load(clean).weight)
