"""README.md's "## Use with torchtitan" example runs as written, with the real torchtitan package
(skipped without it), in a fresh working directory and a 1-rank Gloo group (as in a torchtitan job)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install --no-deps -r .ci/requirements-torchtitan.txt)")

import torch.distributed as dist
from test_readme_snippets import README, python_blocks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SECTION = "Use with torchtitan"


def test_use_with_torchtitan_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"), SECTION)
    assert len(blocks) == 1, f"'## {SECTION}' has {len(blocks)} python blocks"
    monkeypatch.chdir(tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    namespace: dict[str, Any] = {"__name__": "readme"}
    try:
        for line, code in blocks:
            exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "titan_run" / "checkpoint" / "step-2" / ".metadata").is_file()
    assert [len(o.state) for o in namespace["optimizers"].optimizers] == [0, 2], "the save created state"
