"""Choose the core implementation: the C++ extension ``_C`` or the pure-Python twin.

``SPARSE_CKPT_BACKEND=python`` forces the twin; ``SPARSE_CKPT_BACKEND=cpp`` forces the
extension and raises `ImportError` when it is not built. Unset: ``_C`` if importable.
"""

from __future__ import annotations

import os
from types import ModuleType

_ENV = "SPARSE_CKPT_BACKEND"


def _load() -> tuple[str, ModuleType]:
    choice = os.environ.get(_ENV, "").strip().lower()
    if choice not in ("", "cpp", "python"):
        raise ImportError(f"{_ENV}={choice!r} is not valid; use 'python' or 'cpp' (or leave it unset)")
    if choice == "python":
        from . import _core_py

        return "python", _core_py
    try:
        from . import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        if choice == "cpp":
            raise ImportError(
                f"{_ENV}=cpp but the C++ extension sparse_ckpt._C is not importable ({exc}); "
                "build it with `pip install .` or unset the variable to use the Python core"
            ) from exc
        from . import _core_py

        return "python", _core_py
    return "cpp", _C


NAME, core = _load()


def backend() -> str:
    """Return the active core backend: ``"cpp"`` or ``"python"``."""
    return NAME
