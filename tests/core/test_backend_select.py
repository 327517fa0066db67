"""Backend selection at import time.

``SPARSE_CKPT_BACKEND=python`` forces the pure-Python core, ``cpp`` forces the extension (an
``ImportError`` when it is not built, never a silent fallback), anything else is an ``ImportError``;
unset picks ``_C`` when importable. "Not importable" is simulated with
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
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import _backends
import pytest

import sparse_ckpt

ROOT = Path(__file__).resolve().parents[2]

core_backend = _backends.run_once
"""Each test selects the backend itself (in a subprocess or a fresh ``_backend``): once, not per backend."""
PROBE = (
    "import json, sys\n"
    "{prelude}\n"
    "try:\n"
    "    import sparse_ckpt\n"
    "except ImportError as exc:\n"
    "    print(json.dumps({{'error': 'ImportError', 'message': str(exc)}}))\n"
    "else:\n"
    "    from sparse_ckpt import _backend\n"
    "    print(json.dumps({{'backend': sparse_ckpt.backend(), 'core': _backend.core.__name__}}))\n"
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
    module = fresh_backend(monkeypatch, value, block_c=True)
    assert module.backend() == "python" and module.core.__name__ == "sparse_ckpt._core_py"


def test_forced_cpp_without_extension_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImportError, match=r"sparse_ckpt\._C is not importable"):
        fresh_backend(monkeypatch, "cpp", block_c=True)
