"""docs/integrations/torchtitan.md's examples run as written, with the real torchtitan package
(skipped without it), in a fresh working directory and a 1-rank Gloo group (as in a torchtitan job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan is not installed (pip install --no-deps -r .ci/requirements-torchtitan.txt)"
)

import torch.distributed as dist
from doc_blocks import ROOT, blocks, run_block

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PAGE = ROOT / "docs/integrations/torchtitan.md"


def test_torchtitan_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = blocks(PAGE)
    assert len(found) == 2, f"{PAGE.name} has {len(found)} python blocks"  # the example, the migration
    monkeypatch.chdir(tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    namespace: dict[str, Any] = {"__name__": "docs"}
    try:
        for block in found:
            run_block(block, namespace)
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "titan_run" / "checkpoint" / "step-2" / ".metadata").is_file()
    assert [len(o.state) for o in namespace["optimizers"].optimizers] == [0, 2], "the save created state"
