"""Multi-process code runs on GPU machines too: no fork, no default mesh.

On a GPU machine the resume drill and every multi-rank test crashed: ranks were forked from a
process that had touched CUDA ("Cannot re-initialize CUDA in forked subprocess"), and
``fully_shard`` without ``mesh=`` builds its default mesh on the machine's accelerator (CUDA)
even for a Gloo/CPU run. Neither shows on a CPU-only machine, so:

* the source of the package, the bench and the tests is scanned: every ``fully_shard`` call passes
  ``mesh=``, and nothing starts processes by fork (``os.fork``, a ``"fork"`` start method, or
  multiprocessing's default context, which is fork on Linux before Python 3.14);
* the guards the multi-rank tests run under are checked to bite: ``forbid_fork`` (tests/conftest.py)
  makes ``os.fork`` raise in the test process, ``_dist.forbid_default_mesh`` (in every rank) makes
  a mesh-less ``fully_shard`` raise. The drill and the multi-rank tests pass under both.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing
import os
from pathlib import Path

import _backends
import pytest
from _dist import DefaultMeshForbidden, ForkForbidden, cpu_mesh, run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard

from bench.drills import ranks

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("sparse_ckpt", "bench", "tests")
MP_MODULES = {"multiprocessing", "mp", "torch.multiprocessing"}
"""Names a multiprocessing module is used under here; ``<module>.Process(...)`` uses the default context."""


@functools.lru_cache(maxsize=1)
def _sources() -> list[tuple[str, ast.AST, list[str]]]:
    """``(path, tree, lines)`` of every Python file of :data:`SCANNED` (parsed once per session)."""
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text(encoding="utf-8")
            out.append((rel, ast.parse(text, filename=rel), text.splitlines()))
    return out


core_backend = _backends.run_once
"""Source scans and launcher guards do not depend on the core backend: once, not per backend."""


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


ON_PURPOSE = "# fork on purpose"
"""A line with this comment may name the start method ``"fork"`` (the guards and this scan)."""


def fork_uses(tree: ast.AST, lines: list[str] | None = None) -> list[tuple[int, str]]:
    """``(line, what)`` for everything in ``tree`` that starts processes by fork: the start method
    ``"fork"`` named anywhere (``get_context("fork")``, ``start_method=method`` after ``method = "fork"``,
    ...), ``os.fork()``, and multiprocessing's default context (``mp.Process``, ``Pool``,
    ``ProcessPoolExecutor`` without ``mp_context``). ``lines``: the source, for :data:`ON_PURPOSE`."""
    found: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == "fork":  # fork on purpose: what the scan looks for
            found.setdefault(node.lineno, 'the start method "fork"')
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        last = name.rsplit(".", 1)[-1]
        if name == "os.fork" or last == "forkpty":
            found.setdefault(node.lineno, f"{name}()")
        elif last in ("Process", "Pool") and name.rsplit(".", 1)[0] in MP_MODULES:
            found.setdefault(node.lineno, f"{name}(...) (the default context: fork on Linux)")
        elif last == "ProcessPoolExecutor" and "mp_context" not in {k.arg for k in node.keywords}:
            found.setdefault(node.lineno, "ProcessPoolExecutor without mp_context (the default context: fork on Linux)")
    return sorted((line, what) for line, what in found.items() if not (lines and ON_PURPOSE in lines[line - 1]))


def meshless_fully_shard(tree: ast.AST) -> list[int]:
    """Lines of ``fully_shard(...)`` calls in ``tree`` without ``mesh=`` (or with ``mesh=None``; a call
    with ``**kwargs`` is taken to pass one)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func).rsplit(".", 1)[-1] == "fully_shard":
            mesh = [k.value for k in node.keywords if k.arg in ("mesh", None)]
            if not mesh or any(isinstance(v, ast.Constant) and v.value is None for v in mesh):
                found.append(node.lineno)
    return found


def test_scanners_see_what_they_look_for() -> None:
    source = (
        "import multiprocessing as mp, os\n"
        "mp.get_context('fork')\n"
        "multiprocessing.set_start_method(method='fork')\n"
        "torch.multiprocessing.start_processes(f, start_method='fork')\n"
        "os.fork()\n"
        "mp.Process(target=f)\n"
        "ProcessPoolExecutor(2)\n"
        "method = 'fork' if linux else 'spawn'\n"
        "fully_shard(layer)\n"
        "fsdp.fully_shard(model, reshard_after_forward=False)\n"
        "fully_shard(model, mesh=None)\n"
        # fine:
        "mp.get_context('spawn').Process(target=f)\n"
        "ctx.Process(target=f)\n"
        "ProcessPoolExecutor(2, mp_context=ctx)\n"
        "fully_shard(layer, mesh=mesh)\n"
        "fully_shard(layer, **kw)\n"
        "ctx = mp.get_context('fork')  # fork on purpose\n"
    )
    tree = ast.parse(source)
    assert [line for line, _ in fork_uses(tree, source.splitlines())] == [2, 3, 4, 5, 6, 7, 8]
    assert [line for line, _ in fork_uses(tree)] == [2, 3, 4, 5, 6, 7, 8, 17]  # (without the source lines)
    assert meshless_fully_shard(tree) == [9, 10, 11]


def test_no_fork_in_the_source() -> None:
    found = [f"{rel}:{line}: {what}" for rel, tree, lines in _sources() for line, what in fork_uses(tree, lines)]
    assert not found, (
        "processes started by fork (a forked rank cannot use CUDA once its parent has touched it; "
        "use bench/drills/ranks.py's forkserver/spawn):\n" + "\n".join(found)
    )


def test_every_fully_shard_gets_a_mesh() -> None:
    found = [f"{rel}:{line}" for rel, tree, _lines in _sources() for line in meshless_fully_shard(tree)]
    assert not found, (
        "fully_shard without mesh= builds the default mesh on the machine's accelerator (CUDA on a "
        "GPU machine) even for a Gloo/CPU run; pass mesh=init_device_mesh('cpu', ...):\n" + "\n".join(found)
    )


def test_ranks_never_start_by_fork(forbid_fork: None) -> None:
    assert ranks.rank_start_method() in ("forkserver", "spawn")
    method = "fork"  # fork on purpose: the guard must refuse it
    with pytest.raises(ForkForbidden):
        multiprocessing.get_context(method).Process(target=os.getpid).start()


def _default_mesh_refused(rank: int, world_size: int) -> None:
    no_mesh = None  # (a variable: the source scan above looks for calls without a mesh)
    with pytest.raises(DefaultMeshForbidden, match="without mesh="):
        fully_shard(nn.Linear(2, 2), mesh=no_mesh)
    sharded = fully_shard(nn.Linear(2, 2), mesh=cpu_mesh())
    assert sharded.weight.device_mesh.device_type == "cpu"


def test_ranks_refuse_the_default_mesh(forbid_fork: None) -> None:
    run_ranks(_default_mesh_refused, 2)
