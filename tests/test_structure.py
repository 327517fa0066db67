"""Structure checks: no import cycles in the package, and the C++ core's constants match the Python
twin (``_core_py``) and the key grammar (``sparse_ckpt.keys``). The stub and the two cores' names
and signatures: tests/test_core_stub.py."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from sparse_ckpt import _core_py, keys

PACKAGE = Path(__file__).resolve().parent.parent / "sparse_ckpt"


def _is_module(package: Path, name: str) -> bool:
    """``name`` is a module of ``package`` (a ``.py`` file, a subpackage, or an extension with its
    ``.pyi`` stub)."""
    return any((package / f).exists() for f in (f"{name}.py", f"{name}.pyi", f"{name}/__init__.py"))


def _imports(path: Path) -> set[str]:
    """Package-internal modules ``path`` imports, at module level or inside functions; a name
    that ``from . import name`` takes from the package itself (not a module) is ``__init__``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(
                    alias.name if _is_module(path.parent, alias.name) else "__init__" for alias in node.names
                )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparse_ckpt."):
            found.add(node.module.split(".")[1])
    return found


def test_no_import_cycles() -> None:
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py")}
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(node):], node]))
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*stack, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def test_cycle_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import y\n")
    (tmp_path / "c.py").write_text("from . import __version__, a\n")  # a name from the package: __init__
    assert _imports(tmp_path / "a.py") == {"b"} and _imports(tmp_path / "b.py") == {"a"}
    assert _imports(tmp_path / "c.py") == {"__init__", "a"}


def _cpp():
    try:
        return importlib.import_module("sparse_ckpt._C")
    except ImportError:
        pytest.skip("C++ extension not built")


GRAMMAR_CONSTANTS = (
    "PACKED_MARKER",
    "STATE_PREFIX",
    "GROUPS_PREFIX",
    "PACKED_PREFIX",
    "SCALARS_PREFIX",
    "ESCAPE",
    "ESCAPE_STR",
    "ESCAPE_INT",
    "STEP_KEY",
    "KEYS_ENTRY",
    "WRAPPER_CHILD",
)
"""The key grammar's constants the C++ core has its own copy of (csrc/common.hpp)."""


def test_cpp_constants_match_the_keys_module() -> None:
    c = _cpp()
    for name in GRAMMAR_CONSTANTS:
        assert getattr(c, name) == getattr(keys, name) == getattr(_core_py, name), name
        assert type(getattr(c, name)) is str, name
    assert c.MAGIC == _core_py.MAGIC and c.VERSION == _core_py.VERSION and c.MAX_DEPTH == _core_py.MAX_DEPTH
    assert keys.PACKED_PREFIX == f"{keys.GROUPS_PREFIX}{keys.PACKED_MARKER}."
    assert keys.SCALARS_PREFIX == f"{keys.STATE_PREFIX}{keys.PACKED_MARKER}."
    assert keys.ESCAPE_STR.startswith(keys.ESCAPE) and keys.ESCAPE_INT.startswith(keys.ESCAPE)
