"""Choose the core implementation: the C++ extension ``_C`` or the pure-Python twin.

``SPARSE_CKPT_BACKEND=python`` forces the twin; ``SPARSE_CKPT_BACKEND=cpp`` forces the
extension and raises `ImportError` when it is not usable. Unset: ``_C`` when it is usable, else the
twin, with one `CoreFallbackWarning` saying why.

``_C`` is usable when it is built in this package's own folder (an extension found elsewhere, such
as another checkout's through an editable install, is never used) and, where the package sits in a
source tree (``csrc/`` next to it), when it was built from these sources: CMakeLists.txt embeds the
hash of ``csrc/``'s C++ files (`source_build_id`) in ``_C`` as ``_BUILD_ID``, and the same hash of
the tree must match it. An installed package has no ``csrc/``; its ``_C`` is the one built with it.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import warnings
from importlib.machinery import PathFinder
from pathlib import Path
from types import ModuleType

from .errors import CoreFallbackWarning

_ENV = "SPARSE_CKPT_BACKEND"
PACKAGE_DIR = Path(__file__).resolve().parent
"""The folder of this package: the only place ``_C`` is taken from."""
CSRC = PACKAGE_DIR.parent / "csrc"
"""The C++ sources of a source tree (absent in an installed package)."""
SOURCE_SUFFIXES = (".cpp", ".hpp")
REBUILD = "rebuild it with `pip install --no-build-isolation --no-deps -e .` (or `python setup.py build_ext --inplace`)"


def source_build_id(csrc: Path = CSRC) -> str | None:
    """The build id of the C++ sources in ``csrc`` (``None`` when there are none): the SHA-256 of
    one line ``NAME:SHA256(content)`` per ``*.cpp``/``*.hpp`` file, in name order. CMakeLists.txt
    computes the same at configure time and embeds it in ``_C`` as ``_BUILD_ID``."""
    try:
        files = sorted((p for p in csrc.iterdir() if p.suffix in SOURCE_SUFFIXES and p.is_file()), key=lambda p: p.name)
    except OSError:
        return None
    if not files:
        return None
    lines = "".join(f"{p.name}:{hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def built_core() -> ModuleType:
    """This package's own ``_C``, built from this source tree; `ImportError` saying why not otherwise."""
    package = __package__ or "sparse_ckpt"
    name = f"{package}._C"
    if sys.modules.get(name, False) is None:  # blocked on purpose (``sys.modules[name] = None``)
        raise ImportError(f"{name} is not importable (import of {name} halted; None in sys.modules)")
    if PathFinder.find_spec(name, [str(PACKAGE_DIR)]) is None:
        raise ImportError(f"{name} is not importable: it is not built in {PACKAGE_DIR}")
    try:
        module = sys.modules[name] if name in sys.modules else importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{name} is not importable ({exc})") from exc
    where = Path(getattr(module, "__file__", "") or "").resolve().parent
    if where != PACKAGE_DIR:  # another folder's _C (only possible where the import system was bent)
        raise ImportError(f"{name} is not importable from {PACKAGE_DIR}: the one imported is in {where}")
    expected = source_build_id()
    built = getattr(module, "_BUILD_ID", None)
    if expected is not None and built != expected:
        raise ImportError(
            f"{name} ({module.__file__}) does not match the C++ sources in {CSRC} (built from "
            f"{str(built)[:12] if built else 'sources without a build id'}, the sources are {expected[:12]}): "
            "it was built before they changed"
        )
    return module


def _load() -> tuple[str, ModuleType]:
    choice = os.environ.get(_ENV, "").strip().lower()
    if choice not in ("", "cpp", "python"):
        raise ImportError(f"{_ENV}={choice!r} is not valid; use 'python' or 'cpp' (or leave it unset)")
    if choice == "python":
        from . import _core_py

        return "python", _core_py
    try:
        c = built_core()
    except ImportError as exc:
        if choice == "cpp":
            raise ImportError(
                f"{_ENV}=cpp but the C++ core cannot be used: {exc}; {REBUILD}, or unset {_ENV} to use the Python core"
            ) from None
        warnings.warn(
            f"sparse_ckpt runs its Python core (slower): {exc}; {REBUILD}, or set {_ENV}=python to silence this",
            CoreFallbackWarning,
            stacklevel=2,
        )
        from . import _core_py

        return "python", _core_py
    return "cpp", c


NAME, core = _load()


def backend() -> str:
    """Return the active core backend: ``"cpp"`` or ``"python"``."""
    return NAME
