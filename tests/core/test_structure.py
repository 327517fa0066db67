"""Structure checks: no import cycles in the package, and the C++ core's constants match the Python
twin (``_core_py``) and the key grammar (``sparse_ckpt._format.keys``). The stub and the two cores' names
and signatures: tests/core/test_core_stub.py."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import _backends
import pytest

from sparse_ckpt import _core_py
from sparse_ckpt._format import keys

PACKAGE = Path(__file__).resolve().parents[2] / "sparse_ckpt"

core_backend = _backends.run_once
"""Source and interface checks: once, not per backend."""


def _is_module(package: Path, name: str) -> bool:
    """``name`` is a module of ``package`` (a ``.py`` file, a subpackage, or an extension with its
    ``.pyi`` stub)."""
    return any((package / f).exists() for f in (f"{name}.py", f"{name}.pyi", f"{name}/__init__.py"))


def _module_name(path: Path, root: Path) -> str:
    """The dotted name of ``path`` in the package at ``root``: ``sub.mod`` for ``sub/mod.py``,
    ``sub`` for ``sub/__init__.py``, ``__init__`` for the package's own ``__init__.py``."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _imports(path: Path, root: Path | None = None) -> set[str]:
    """Package-internal modules ``path`` imports (names as :func:`_module_name` gives them; ``root``:
    the package's folder, default ``path``'s), at module level or inside functions; a name that
    ``from . import name`` takes from a package itself (not a module) is that package."""
    root = root or path.parent
    here = path.relative_to(root).parent.parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = [*here[: len(here) - node.level + 1], *(node.module.split(".") if node.module else [])]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparse_ckpt."):
            target = node.module.split(".")[1:]
        else:
            continue
        package = ".".join(target) or "__init__"
        if node.module:
            found.add(package)
        for alias in node.names:
            found.add(".".join([*target, alias.name]) if _is_module(root.joinpath(*target), alias.name) else package)
    return found


def test_no_import_cycles() -> None:
    graph = {_module_name(p, PACKAGE): _imports(p, PACKAGE) for p in PACKAGE.rglob("*.py")}
    assert "_core_py.flat_keys" in graph and "_core_py" in graph  # subpackages are in the graph
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(node) :], node]))
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
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("from .m import f\n")
    (tmp_path / "sub" / "m.py").write_text("from ..a import y\nfrom sparse_ckpt.b import z\n")
    (tmp_path / "d.py").write_text("from .sub import m\n")
    assert _imports(tmp_path / "sub" / "__init__.py", tmp_path) == {"sub.m"}
    assert _imports(tmp_path / "sub" / "m.py", tmp_path) == {"a", "b"}
    assert _imports(tmp_path / "d.py") == {"sub", "sub.m"}
    assert [_module_name(tmp_path / f, tmp_path) for f in ("sub/__init__.py", "sub/m.py", "__init__.py")] == [
        "sub",
        "sub.m",
        "__init__",
    ]


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


def test_test_modules_share_code_through_the_helper_modules() -> None:
    """A test module imports another test module only from its own folder: pytest puts each test's
    folder on ``sys.path`` as it collects it, so a cross-folder import works in the whole suite and
    fails when the importing file runs alone. Shared code lives in the helper modules in tests/."""
    tests = PACKAGE.parent / "tests"
    crossing = []
    for path in sorted(tests.glob("*/test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            )
            crossing += [
                f"{path.relative_to(tests)} imports {name}"
                for name in names
                if name.startswith("test_") and not (path.parent / f"{name}.py").exists()
            ]
    assert not crossing, crossing
