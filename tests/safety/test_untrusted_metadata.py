"""A ``.metadata`` from elsewhere never runs its code: one that pickles a call creating a marker file
(``builtins.exec``, or the dotted ``pathlib.Path.touch`` inside an allowed module) is refused naming
that global, and the marker never appears, by every tool (inspect, verify, diff, convert, export) and
every load path that reads it (`sc.SafeFileSystemReader` with `sc.SparseLoadPlanner`, ``install()``
with torch's own ``FileSystemReader`` under ``SPARSE_CKPT_SAFE_LOAD=1``, ``sparse-ckpt-run --safe-load``);
a clean checkpoint loads exactly through the same readers, and the refusal's advice (torch's reader, for
a checkpoint one trusts) works."""

from __future__ import annotations

import fractions
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _backends
import pytest
import torch.distributed.checkpoint as dcp
from helpers import assert_deep_equal, assert_optimizer_equal, moe_with_leaves, snapshot_optimizer, train
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from untrusted import GLOBAL, KINDS, metadata, poison_metadata, write_metadata

import sparse_ckpt as sc
import sparse_ckpt.integrations.dsd as sc_dsd
from sparse_ckpt.integrations import safe_load
from sparse_ckpt.tools import convert_checkpoint, diff_checkpoints, inspect_checkpoint, verify_checkpoint
from sparse_ckpt.tools._cli import main as cli_main
from sparse_ckpt.tools.export import export_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A packed checkpoint of a trained MoE with leaves (model and optimizer), saved with a ``Path``
    id (its ``.metadata`` pickles a ``PosixPath``)."""
    path = tmp_path_factory.mktemp("clean") / "ckpt"
    model, opt = moe_with_leaves(0)
    train(model, opt, 2, only_experts=[0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=path)
    return path


@pytest.fixture
def poisoned(clean: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path, str]]:
    """``(checkpoint, marker, global)``: a copy of ``clean`` whose ``.metadata`` pickles code creating ``marker``."""
    kind = getattr(request, "param", "exec")
    path = tmp_path / "ckpt"
    shutil.copytree(clean, path)
    marker = tmp_path / "MARKER"
    poison_metadata(path, marker, kind)
    yield path, marker, GLOBAL[kind]
    assert not marker.exists(), "the checkpoint's code ran"


def _refused(exc: BaseException, name: str) -> None:
    text = str(exc)
    assert repr(name) in text and "refused before anything in the file ran" in text, text[-2000:]


@pytest.mark.parametrize("poisoned", KINDS, indirect=True)
def test_tools_refuse_and_run_nothing(poisoned: tuple[Path, Path, str], clean: Path, tmp_path: Path) -> None:
    path, _marker, name = poisoned
    calls = {
        "inspect": lambda: inspect_checkpoint(path),
        "verify": lambda: verify_checkpoint(path),
        "diff a": lambda: diff_checkpoints(path, clean),
        "diff b": lambda: diff_checkpoints(clean, path),
        "convert": lambda: convert_checkpoint(str(path), str(tmp_path / "converted"), "flat", key="optim"),
        "export": lambda: export_checkpoint(path, tmp_path / "exported"),
    }
    for what, call in calls.items():
        with pytest.raises(sc.CheckpointFormatError) as err:
            call()
        _refused(err.value, name)
        assert ".metadata" in str(err.value), what
    assert not (tmp_path / "converted").exists() and not (tmp_path / "exported").exists()


@_backends.only(_backends.DEFAULT)
def test_cli_exits_with_the_refusal(poisoned: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    path, _marker, name = poisoned
    for command in ("inspect", "verify"):
        assert cli_main([command, str(path)]) != 0
        _refused(Exception(capsys.readouterr().err), name)


def _load(path: Path, reader: Any = None, **kw: Any) -> tuple[Any, Any]:
    model, opt = moe_with_leaves(1)
    msd = model.state_dict()
    where = {"storage_reader": reader} if reader is not None else {"checkpoint_id": path}
    dcp.load({"model": msd, "optim": opt}, planner=sc.SparseLoadPlanner(), **where, **kw)
    model.load_state_dict(msd)
    return model, opt


def test_safe_reader_loads_a_clean_checkpoint_exactly(clean: Path) -> None:
    model, opt = _load(clean, sc.SafeFileSystemReader(clean))
    src_model, src = moe_with_leaves(0)
    train(src_model, src, 2, only_experts=[0, 1])
    assert_optimizer_equal(src, opt, grads=False)
    for (name, a), b in zip(src_model.state_dict().items(), model.state_dict().values()):
        assert a.equal(b), name


@pytest.mark.parametrize("poisoned", KINDS, indirect=True)
def test_safe_reader_refuses_a_poisoned_checkpoint(poisoned: tuple[Path, Path, str]) -> None:
    path, _marker, name = poisoned
    model, opt = moe_with_leaves(1)
    before = snapshot_optimizer(opt)
    with pytest.raises((sc.CheckpointFormatError, CheckpointException)) as err:
        dcp.load(
            {"model": model.state_dict(), "optim": opt},
            storage_reader=sc.SafeFileSystemReader(path),
            planner=sc.SparseLoadPlanner(),
        )
    _refused(err.value, name)
    assert_deep_equal(snapshot_optimizer(opt), before)
    with pytest.raises(sc.CheckpointFormatError) as err:
        sc.SafeFileSystemReader(path).read_metadata()
    _refused(err.value, name)


@pytest.fixture
def safe_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``SPARSE_CKPT_SAFE_LOAD=1`` and ``install()``; both undone after the test."""
    monkeypatch.setenv(safe_load.ENV, "1")
    sc_dsd.install()
    try:
        assert safe_load.installed()
        yield
    finally:
        sc_dsd.uninstall()
        safe_load.uninstall()


@pytest.mark.usefixtures("safe_env")
def test_install_with_safe_load_refuses_through_torchs_reader(poisoned: tuple[Path, Path, str], clean: Path) -> None:
    path, _marker, name = poisoned
    model, opt = moe_with_leaves(1)
    target = {"model": model.state_dict(), "optim": sc_dsd.get_optimizer_state_dict(model, [opt[n] for n in opt])}
    for planner in (None, sc.SparseLoadPlanner()):
        with pytest.raises(CheckpointException) as err:
            dcp.load(target, checkpoint_id=str(path), planner=planner)
        _refused(err.value, name)
    with pytest.raises(sc.CheckpointFormatError) as err:
        FileSystemReader(str(path)).read_metadata()
    _refused(err.value, name)
    _load(clean)  # a clean checkpoint still loads through torch's (patched) reader


def test_safe_load_is_undone_and_not_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(safe_load.ENV, raising=False)
    read = FileSystemReader.read_metadata
    sc_dsd.install()
    try:
        assert not safe_load.installed() and FileSystemReader.read_metadata is read
    finally:
        sc_dsd.uninstall()
    safe_load.install()
    safe_load.install()  # idempotent
    assert FileSystemReader.read_metadata is not read
    safe_load.uninstall()
    assert FileSystemReader.read_metadata is read and not safe_load.installed()


def test_refusal_advice_works_for_a_trusted_checkpoint(clean: Path, tmp_path: Path) -> None:
    """A global DCP's metadata is not made of, but harmless (a custom planner's data): refused by the
    safe reader, naming it; torch's own reader, as the refusal advises for a checkpoint one trusts, reads it."""
    path = tmp_path / "ckpt"
    shutil.copytree(clean, path)
    md = metadata(path)
    md.planner_data = {**md.planner_data, "ratio": fractions.Fraction(1, 3)}
    write_metadata(path, md)
    with pytest.raises(sc.CheckpointFormatError, match=r"'fractions\.Fraction'.*torch's own FileSystemReader reads it"):
        sc.SafeFileSystemReader(path).read_metadata()
    assert FileSystemReader(str(path)).read_metadata().planner_data["ratio"] == fractions.Fraction(1, 3)


def test_garbage_metadata_is_a_format_error(clean: Path, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(clean, path)
    (path / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(sc.CheckpointFormatError, match="corrupt, or not a DCP checkpoint"):
        sc.SafeFileSystemReader(path).read_metadata()
    (path / ".metadata").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(sc.CheckpointFormatError, match="holds a list, not DCP metadata"):
        inspect_checkpoint(path)


SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp
    from helpers import moe_with_leaves
    model, opt = moe_with_leaves(1)
    try:
        dcp.load({"model": model.state_dict()}, checkpoint_id=sys.argv[1])
    except BaseException as exc:
        print("REFUSED", exc)
    else:
        print("LOADED")
    """
)


@_backends.only(_backends.DEFAULT)
def test_launcher_safe_load_refuses_in_the_child(poisoned: tuple[Path, Path, str], tmp_path: Path) -> None:
    """``sparse-ckpt-run --safe-load`` sets ``SPARSE_CKPT_SAFE_LOAD=1``; a training script with no sparse_ckpt
    line and torch's default reader (a model-only ``dcp.load``) is refused, nothing of the file run."""
    path, _marker, name = poisoned
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    tests = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSE_CKPT_") or k == "SPARSE_CKPT_BACKEND"}
    env.update(PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]), OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "sparse_ckpt",
        "run",
        "--safe-load",
        "--integrations",
        "none",
        sys.executable,
        str(script),
        str(path),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert "REFUSED" in proc.stdout, proc.stdout + proc.stderr
    _refused(Exception(proc.stdout), name)


def test_trainer_readers_become_safe_readers(clean: Path) -> None:
    """The integrations' choice of reader: a trainer's default ``FileSystemReader`` (VeOmni's
    ``_create_storage_reader``) and a local ``checkpoint_id`` (torchtitan) become `SafeFileSystemReader`\\ s of
    the same directory; another storage reader is kept."""
    from sparse_ckpt._dcp.safe_reader import safe_reader_for, safe_reader_like

    safe = safe_reader_like(FileSystemReader(str(clean)))
    assert type(safe) is sc.SafeFileSystemReader and Path(safe.path) == clean
    other = sc.SafeFileSystemReader(clean)
    assert safe_reader_like(other) is other
    assert type(safe_reader_for(str(clean))) is sc.SafeFileSystemReader
