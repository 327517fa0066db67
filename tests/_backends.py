"""Which core backend a test runs on.

The suite's autouse ``core_backend`` fixture (tests/conftest.py) runs every test once per core
backend, ``python`` and ``cpp``. Where that would only repeat the same run, a folder's conftest.py
or a module binds one of these fixtures to the name ``core_backend``, which overrides it there:

* ``core_backend = _backends.run_once``: tests that never call the core (docs, packaging, source
  scans, the bench that measures both backends itself) run once, on the backend the import chose
  (``cpp`` where it is built, what users get);
* ``core_backend = _backends.both_cores_directly``: tests that call both cores themselves (the
  differential tests of ``core/``) run once, with the id ``cpp`` so that ``-k cpp`` (the sanitizer
  job, ``.ci/sanitize.sh``) selects them.

A single test whose subject does not depend on the core but whose run is costly takes
``@_backends.only(name)``: it runs on that backend only. A test that starts ranks, whose core calls
the single-process tests and the differential tests of ``core/`` already cover on both cores, takes
``@_backends.ranks``: the default backend by default, both under ``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1``
(.ci/run; :mod:`_sampling`).
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest
from _sampling import EXHAUSTIVE

from sparse_ckpt import _backend, _core_py


def cpp_core() -> ModuleType:
    """``sparse_ckpt._C``; the test (or, called at import, the module) is skipped when it is not
    built (in this package's folder, from these sources: `sparse_ckpt._backend.built_core`), unless
    ``SPARSE_CKPT_REQUIRE_CPP`` is set (CI), which makes a missing or stale build an error."""
    try:
        return _backend.built_core()
    except ImportError as exc:
        if os.environ.get("SPARSE_CKPT_REQUIRE_CPP"):
            raise
        pytest.skip(f"C++ extension not built: {exc}", allow_module_level=True)


def cores() -> list[ModuleType]:
    """Every core there is: the Python twin, and ``sparse_ckpt._C`` where it is built (required
    under ``SPARSE_CKPT_REQUIRE_CPP``)."""
    try:
        return [_core_py, _backend.built_core()]
    except ImportError:
        if os.environ.get("SPARSE_CKPT_REQUIRE_CPP"):
            raise
        return [_core_py]


@pytest.fixture
def run_once() -> str:
    """The backend ``import sparse_ckpt`` chose; nothing is swapped."""
    return _backend.NAME


@pytest.fixture(scope="module", params=["cpp"])
def both_cores_directly(request: pytest.FixtureRequest) -> str:
    """One run per test, id ``cpp``; the tests call ``sparse_ckpt._C`` and ``_core_py`` directly."""
    return request.param


def only(name: str) -> pytest.MarkDecorator:
    """Mark a test to run on core backend ``name`` only (the core swapped in as usual): for a test
    whose subject does not depend on the core but whose run is costly (ranks, subprocesses)."""
    return pytest.mark.parametrize("core_backend", [name], indirect=True)


DEFAULT = _backend.NAME
"""The backend ``import sparse_ckpt`` chose: ``cpp`` where it is built (what users get)."""


ranks = pytest.mark.parametrize("core_backend", ["python", "cpp"] if EXHAUSTIVE else [DEFAULT], indirect=True)
"""A multi-rank test's backends: `DEFAULT` only, both under ``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1`` (.ci/run).
The ranks run the same Python layers on either core; the cores' outputs and errors are the same
(``core/``'s differential tests), and the single-process tests run on both."""
