"""Backend selection at import time.

``SPARSE_CKPT_BACKEND=python`` forces the pure-Python core, ``cpp`` forces the extension (an
``ImportError`` when it is not built, never a silent fallback), anything else is an ``ImportError``
(on first use: ``import sparse_ckpt`` itself imports no core); unset picks ``_C`` when it is built in
the package's folder from the sources beside it, else the Python core with one warning. "Not importable"
is simulated with
``sys.modules['sparse_ckpt._C'] = None``.

The main cases run ``import sparse_ckpt`` in fresh interpreters. Importing the package (torch,
DCP) costs seconds of CPU, so those probes are launched together, once per session, and cached:
the second conftest backend parameter costs nothing. Variants of the selection rule are then
checked in-process by executing ``_backend.py`` afresh under a patched environment.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import _backends
import pytest

import sparse_ckpt
from sparse_ckpt.errors import CoreFallbackWarning

ROOT = Path(__file__).resolve().parents[2]

core_backend = _backends.run_once
"""Each test selects the backend itself (in a subprocess or a fresh ``_backend``): once, not per backend."""
PROBE = (
    "import json, sys\n"
    "{prelude}\n"
    "import sparse_ckpt\n"
    "try:\n"
    "    name = sparse_ckpt.backend()  # the core is chosen on first use (import sparse_ckpt imports no torch)\n"
    "except ImportError as exc:\n"
    "    print(json.dumps({{'error': 'ImportError', 'message': str(exc)}}))\n"
    "else:\n"
    "    from sparse_ckpt import _backend\n"
    "    print(json.dumps({{'backend': name, 'core': _backend.core.__name__}}))\n"
)
BLOCK_C = "sys.modules['sparse_ckpt._C'] = None"


def _cpp_built() -> bool:
    try:
        return importlib.util.find_spec("sparse_ckpt._C") is not None
    except (ImportError, ValueError):
        return False


# name -> (SPARSE_CKPT_BACKEND value or None for unset, block _C)
PROBES: dict[str, tuple[str | None, bool]] = {
    "python": ("python", False),
    "invalid": ("rust", False),
    "cpp_blocked": ("cpp", True),
    "cpp": ("cpp", False),
}


@functools.cache
def probes() -> dict[str, dict[str, str]]:
    """Run every probe interpreter concurrently (once per session); name -> backend or ImportError."""
    procs: dict[str, subprocess.Popen[str]] = {}
    for name, (value, block_c) in PROBES.items():
        if name == "cpp" and not _cpp_built():
            continue
        env = {k: v for k, v in os.environ.items() if k != "SPARSE_CKPT_BACKEND"}
        if value is not None:
            env["SPARSE_CKPT_BACKEND"] = value
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        code = PROBE.format(prelude=BLOCK_C if block_c else "")
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out: dict[str, dict[str, str]] = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"probe {name!r} failed:\n{stderr}"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_forced_python() -> None:
    assert probes()["python"] == {"backend": "python", "core": "sparse_ckpt._core_py"}


def test_invalid_value_is_import_error() -> None:
    out = probes()["invalid"]
    assert out["error"] == "ImportError"
    assert "SPARSE_CKPT_BACKEND" in out["message"] and "'rust'" in out["message"], out


def test_forced_cpp_when_built() -> None:
    if not _cpp_built():
        pytest.skip("C++ extension sparse_ckpt._C is not built")
    assert probes()["cpp"] == {"backend": "cpp", "core": "sparse_ckpt._C"}


def test_forced_cpp_without_extension_is_clear_import_error() -> None:
    out = probes()["cpp_blocked"]
    assert out["error"] == "ImportError"
    msg = out["message"]
    assert "SPARSE_CKPT_BACKEND=cpp" in msg and "sparse_ckpt._C" in msg and "not importable" in msg, msg


# ----------------------------------------------------------------------------- in-process variants


def fresh_backend(monkeypatch: pytest.MonkeyPatch, value: str | None, *, block_c: bool = False) -> ModuleType:
    """Execute ``sparse_ckpt/_backend.py`` anew (not registered in sys.modules) under ``value``."""
    if value is None:
        monkeypatch.delenv("SPARSE_CKPT_BACKEND", raising=False)
    else:
        monkeypatch.setenv("SPARSE_CKPT_BACKEND", value)
    if block_c:
        monkeypatch.setitem(sys.modules, "sparse_ckpt._C", None)
        monkeypatch.delattr(sparse_ckpt, "_C", raising=False)  # `from . import _C` looks here first
    spec = importlib.util.spec_from_file_location("sparse_ckpt._backend_probe", ROOT / "sparse_ckpt" / "_backend.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("value", ["python", " Python ", "PYTHON"])
def test_python_value_is_case_and_space_insensitive(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    assert fresh_backend(monkeypatch, value).backend() == "python"


@pytest.mark.parametrize("value", ["rust", "c++", "pythonn", "auto"])
def test_invalid_values_raise(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    with pytest.raises(ImportError, match="SPARSE_CKPT_BACKEND"):
        fresh_backend(monkeypatch, value)


@pytest.mark.parametrize("value", [None, ""])
def test_unset_prefers_cpp_when_built(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    assert fresh_backend(monkeypatch, value).backend() == ("cpp" if _cpp_built() else "python")


@pytest.mark.parametrize("value", [None, "python"])
def test_without_extension_python_is_used(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = fresh_backend(monkeypatch, value, block_c=True)
    assert module.backend() == "python" and module.core.__name__ == "sparse_ckpt._core_py"
    # a fallback says so once; a forced Python core is what was asked for
    assert [type(w.message) for w in caught] == ([CoreFallbackWarning] if value is None else [])


def test_forced_cpp_without_extension_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImportError, match=r"sparse_ckpt\._C is not importable"):
        fresh_backend(monkeypatch, "cpp", block_c=True)


# ----------------------------------------------------------------------------- the core you built

CLONE_PROBE = (
    "import json, sys, warnings\n"
    "from importlib.machinery import PathFinder\n"
    "class Elsewhere:  # another checkout's _C, reachable the way an editable install of it makes it\n"
    "    @staticmethod\n"
    "    def find_spec(name, path=None, target=None):\n"
    "        return PathFinder.find_spec(name, [{built!r}]) if name == 'sparse_ckpt._C' else None\n"
    "sys.meta_path.append(Elsewhere)\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    try:\n"
    "        import sparse_ckpt\n"
    "        out = {{'backend': sparse_ckpt.backend(), 'again': sparse_ckpt.backend()}}\n"
    "        import sparse_ckpt._backend\n"
    "    except ImportError as exc:\n"
    "        out = {{'error': str(exc)}}\n"
    "out['file'] = sparse_ckpt.__file__\n"
    "out['warnings'] = [(w.category.__name__, str(w.message)) for w in caught]\n"
    "out['C'] = getattr(sys.modules.get('sparse_ckpt._C'), '__file__', None)\n"
    "print(json.dumps(out))\n"
)


def _clone(tmp_path: Path, *, with_c: bool, csrc_edit: str | None = None) -> Path:
    """A copy of this package (a second checkout): its own ``_C`` or none, and ``csrc/`` (edited) or none."""
    root = tmp_path / "clone"
    ignore = shutil.ignore_patterns("__pycache__", *(() if with_c else ("_C*.so", "_C*.pyd")))
    shutil.copytree(ROOT / "sparse_ckpt", root / "sparse_ckpt", ignore=ignore)
    if csrc_edit is not None:
        shutil.copytree(ROOT / "csrc", root / "csrc")
        with open(root / "csrc" / "common.hpp", "a") as f:
            f.write(csrc_edit)
    return root


def _run_clone(root: Path, backend: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SPARSE_CKPT_BACKEND", "PYTHONWARNINGS")}
    if backend is not None:
        env["SPARSE_CKPT_BACKEND"] = backend
    env["PYTHONPATH"] = str(root)
    code = CLONE_PROBE.format(built=str(ROOT / "sparse_ckpt"))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["file"] == str(root / "sparse_ckpt" / "__init__.py")
    return out


def _needs_built_core() -> None:
    if not _cpp_built():
        pytest.skip("C++ extension sparse_ckpt._C is not built")


def test_an_unbuilt_clone_never_uses_another_clones_core(tmp_path: Path) -> None:
    """A second, unbuilt checkout first on PYTHONPATH, this checkout's ``_C`` importable by name: the
    clone runs its Python core, imports no foreign ``_C``, and says so once."""
    _needs_built_core()
    out = _run_clone(_clone(tmp_path, with_c=False))
    assert (out["backend"], out["again"], out["C"]) == ("python", "python", None), out
    [(category, message)] = out["warnings"]
    assert category == "CoreFallbackWarning" and "runs its Python core" in message and "not built in" in message, (
        message
    )
    assert "SPARSE_CKPT_BACKEND=python" in message and "build_ext --inplace" in message


def test_forced_cpp_in_an_unbuilt_clone_says_it_is_not_built(tmp_path: Path) -> None:
    _needs_built_core()
    out = _run_clone(_clone(tmp_path, with_c=False), backend="cpp")
    msg = out["error"]
    assert msg.startswith(
        "SPARSE_CKPT_BACKEND=cpp but the C++ core cannot be used: sparse_ckpt._C is not importable"
    ), msg
    assert "not built in" in msg and "circular import" not in msg and out["C"] is None, msg


def test_a_core_built_from_other_sources_is_not_used(tmp_path: Path) -> None:
    """``csrc/`` changed since ``_C`` was built: the build ids differ, the Python core runs (one
    warning), and ``SPARSE_CKPT_BACKEND=cpp`` refuses, saying to rebuild."""
    _needs_built_core()
    root = _clone(tmp_path, with_c=True, csrc_edit="\n// an edit after the build\n")
    out = _run_clone(root)
    assert out["backend"] == "python", out
    [(category, message)] = out["warnings"]
    assert category == "CoreFallbackWarning" and "does not match the C++ sources" in message, message
    forced = _run_clone(root, backend="cpp")
    assert "does not match the C++ sources" in forced["error"] and "rebuild it" in forced["error"], forced
    same = _clone(tmp_path / "same", with_c=True, csrc_edit="")  # unchanged sources: the build is used, silently
    assert _run_clone(same) | {"C": None} == {
        "backend": "cpp",
        "again": "cpp",
        "file": str(same / "sparse_ckpt" / "__init__.py"),
        "warnings": [],
        "C": None,
    }


def test_the_built_core_carries_the_build_id_of_this_tree() -> None:
    from sparse_ckpt import _backend

    _needs_built_core()
    built = _backend.built_core()
    assert built._BUILD_ID == _backend.source_build_id() and len(built._BUILD_ID) == 64


def test_source_build_id_follows_every_source_file(tmp_path: Path) -> None:
    from sparse_ckpt._backend import source_build_id

    assert source_build_id(tmp_path) is None
    (tmp_path / "a.cpp").write_text("int a;\n")
    (tmp_path / "notes.txt").write_text("not a source")
    first = source_build_id(tmp_path)
    (tmp_path / "notes.txt").write_text("still not a source")
    assert source_build_id(tmp_path) == first
    (tmp_path / "b.hpp").write_text("#pragma once\n")
    second = source_build_id(tmp_path)
    (tmp_path / "a.cpp").write_text("int a = 1;\n")
    assert len({first, second, source_build_id(tmp_path)}) == 3
