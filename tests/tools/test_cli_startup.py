"""The entry points start without torch: ``python -m sparse_ckpt`` (``--help``, ``--version``, a usage
error), ``import sparse_ckpt`` itself, and ``inspect`` imports only the inspector (no export,
convert, diff, integrations, safetensors). Each case runs in a fresh interpreter that reports
``sys.modules`` at exit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import _backends
import child_process
import pytest
import torch
import torch.distributed.checkpoint as dcp
from child_process import repo_env

import sparse_ckpt as sc

core_backend = _backends.run_once
"""Start-up does not depend on the core: once."""

REPORT = (
    "import atexit, json, sys\n"
    "atexit.register(lambda: print('@@modules ' + json.dumps(sorted(sys.modules)), file=sys.stderr))\n"
)


def modules_after(code: str) -> tuple[int, str, set[str]]:
    """Run ``code`` after `REPORT` in a fresh interpreter: (exit status, stdout, modules imported at exit)."""
    proc = child_process.run([sys.executable, "-c", REPORT + code], env=repo_env(), timeout=300)
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("@@modules ")]
    return proc.returncode, proc.stdout, set(json.loads(line[len("@@modules ") :]))


def cli(*args: str) -> tuple[int, str, set[str]]:
    return modules_after(
        f"import runpy; sys.argv = ['sparse_ckpt', *{list(args)!r}]; "
        "runpy.run_module('sparse_ckpt', run_name='__main__', alter_sys=True)"
    )


@pytest.mark.parametrize(
    ("args", "status"),
    [(["--help"], 0), (["--version"], 0), (["nosuch"], 2), (["inspect"], 2), (["diff", "--help"], 0)],
)
def test_help_version_and_usage_errors_import_no_torch(args: list[str], status: int) -> None:
    got, out, modules = cli(*args)
    assert got == status
    assert "torch" not in modules, sorted(m for m in modules if m.startswith("torch"))[:5]
    if args == ["--version"]:
        assert out.startswith(f"sparse_ckpt {sc.__version__} (torch ") and "core " in out, out


def test_import_sparse_ckpt_imports_no_torch_until_a_name_is_used() -> None:
    _, out, modules = modules_after("import sparse_ckpt as sc; print(sc.__version__, 'torch' in sys.modules)")
    assert out.split() == [sc.__version__, "False"] and "torch" not in modules
    _, out, _ = modules_after(
        "from sparse_ckpt import MultiOptimizer; import sparse_ckpt as sc; "
        "print(MultiOptimizer.__module__, sc.sparse_state_dict.__module__)"
    )
    assert out.split() == ["sparse_ckpt._multi_optimizer", "sparse_ckpt._save.save"]


def test_public_names_resolve_lazily_to_their_homes() -> None:
    for name in sc.__all__:
        value = getattr(sc, name)
        assert name in dir(sc)
        if name != "__version__":
            assert value.__module__.startswith("sparse_ckpt."), name
    with pytest.raises(AttributeError, match="no attribute 'UsageError'"):
        sc.UsageError  # noqa: B018 - a name of sparse_ckpt.errors, not of the top level


def test_inspect_imports_only_the_inspector(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    status, out, modules = cli("inspect", str(tmp_path / "ckpt"))
    assert status == 0 and "packed format" in out, out
    assert "sparse_ckpt.tools.inspect" in modules
    unneeded = {
        "sparse_ckpt.tools.export",
        "sparse_ckpt.tools.convert",
        "sparse_ckpt.tools.diff",
        "sparse_ckpt.integrations",
        "sparse_ckpt._save",
        "safetensors",
    }
    assert not unneeded & modules, unneeded & modules
