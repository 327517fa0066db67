"""Fixtures shared by the DCP tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from bench.drills.ranks import free_port
from sparse_ckpt._save.fill_plan import FillPlans


@pytest.fixture(scope="module")
def mesh() -> Iterator[object]:
    """A 1-rank CPU mesh on a single-process Gloo group (destroyed at the end if made here)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if made:
            dist.destroy_process_group()


@pytest.fixture
def takes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each capture used its speculative bucket copy (`sparse_ckpt._save.fill_plan`; one entry
    per leaf with buckets)."""
    seen: list[bool] = []
    real = FillPlans.take

    def spy(self: FillPlans, *args: Any) -> Any:
        out = real(self, *args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(FillPlans, "take", spy)
    return seen
