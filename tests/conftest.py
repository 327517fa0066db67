"""Run every test against both core backends.

The autouse fixture ``core_backend`` is parametrized over ``python`` and ``cpp``: it swaps
``sparse_ckpt._backend.core`` for the test and sets ``SPARSE_CKPT_BACKEND`` so that processes a
test spawns (multi-rank tests) use the same backend. ``cpp`` is skipped only when the extension
is not built and ``SPARSE_CKPT_REQUIRE_CPP`` is unset (CI sets it, so a missing build fails).
Folders and modules whose tests would only repeat the same run override it (tests/_backends.py).

``forbid_fork`` (used by the modules that start ranks) makes ``os.fork`` raise in the test process:
ranks forked from a process that may have touched CUDA crash on GPU machines, so they must start
from a fork server or by spawn (``bench/drills/ranks.py``).
"""

from __future__ import annotations

import os

import pytest
from _backends import cpp_core
from _dist import ForkForbidden

from sparse_ckpt import _backend, _core_py

BACKENDS = ("python", "cpp")


@pytest.fixture
def forbid_fork(monkeypatch):
    """``os.fork`` (what the ``fork`` start method of multiprocessing calls) raises for the test's duration."""

    def refuse(*_args, **_kwargs):
        raise ForkForbidden(
            "os.fork() in the test process: start ranks with forkserver or spawn (bench/drills/ranks.py), "
            "a forked rank cannot use CUDA once the parent has touched it"
        )

    monkeypatch.setattr(os, "fork", refuse)  # fork on purpose: the guard replaces it


@pytest.fixture(params=BACKENDS, autouse=True)
def core_backend(request, monkeypatch):
    """The active backend name; the core module is swapped for the test's duration."""
    name = request.param
    core = _core_py if name == "python" else cpp_core()
    monkeypatch.setattr(_backend, "core", core)
    monkeypatch.setattr(_backend, "NAME", name)
    monkeypatch.setenv("SPARSE_CKPT_BACKEND", name)
    return name
