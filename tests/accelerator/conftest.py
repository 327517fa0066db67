"""The ``device_type`` fixture of the accelerator tests (tests/accelerator/accelerators.py)."""

from __future__ import annotations

import pytest
from accelerators import params


@pytest.fixture(params=params())
def device_type(request: pytest.FixtureRequest) -> str:
    """``cuda``, ``npu`` (each skipped with its reason where absent), or ``cpu`` in the dry run."""
    return request.param
