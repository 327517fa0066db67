"""Structure checks: no import cycles in the package, the C++ core's constants and signatures
match the Python twin (``_core_py``) and the key grammar (``sparse_ckpt.keys``), and the
``_C.pyi`` stub describes exactly the functions both cores have."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import _backends
import pytest

from sparse_ckpt import _core_py, keys

PACKAGE = Path(__file__).resolve().parents[2] / "sparse_ckpt"

core_backend = _backends.run_once
"""Source and interface checks: once, not per backend."""


def _is_module(package: Path, name: str) -> bool:
    """``name`` is a module of ``package`` (a ``.py`` file, or an extension with its ``.pyi`` stub)."""
    return (package / f"{name}.py").exists() or (package / f"{name}.pyi").exists()


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


def _stub_functions() -> dict[str, list[str]]:
    tree = ast.parse((PACKAGE / "_C.pyi").read_text())
    return {n.name: [a.arg for a in n.args.args] for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_stub_matches_both_cores() -> None:
    c = _cpp()
    stub = _stub_functions()
    cpp_functions = {n for n in dir(c) if not n.startswith("_") and callable(getattr(c, n))}
    assert set(stub) == cpp_functions
    for name, params in stub.items():
        assert params == list(inspect.signature(getattr(_core_py, name)).parameters), name
        doc = getattr(c, name).__doc__ or ""
        assert doc.startswith(f"{name}("), name
        cpp_params = [p.split(":")[0].strip() for p in doc[len(name) + 1 : doc.index(")")].split(",") if p.strip()]
        assert cpp_params == params, (name, cpp_params, params)
