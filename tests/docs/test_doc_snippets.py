"""Every ``python`` block of README.md, docs/*.md, docs/integrations/*.md and bench/README.md runs as
written: the blocks of one file in order, in one namespace, in a fresh working directory (they write ``ckpt/...``),
single process. Any exception fails the test, its traceback naming the file and line.

A block marked ``<!-- doc-test: skip; tests/... runs it (...) -->`` (see ``tests/doc_blocks.py``)
is only compiled here; the test it names must exist and read that file.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
from doc_blocks import DOC_FILES, ROOT, Block, blocks, fences, python_blocks, run_block

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DOCS = ("semantics", "dcp", "integrations", "cli", "export", "formats", "guarantees")


def _ids(paths: tuple[Path, ...]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def test_doc_files() -> None:
    names = _ids(DOC_FILES)
    assert names[0] == "README.md" and names[-1] == "bench/README.md"
    assert {f"docs/{d}.md" for d in DOCS} <= set(names), names
    assert all(p.is_file() for p in DOC_FILES)


@pytest.mark.parametrize("path", DOC_FILES, ids=_ids(DOC_FILES))
def test_blocks_are_found(path: Path) -> None:
    """Every ``python`` fence is found (none indented, so none missed), and every skip marker sits
    right above a ``python`` block and names a test that reads this file."""
    text = path.read_text(encoding="utf-8")
    for start, _end, info, indent in fences(text):
        assert not (indent and info.split()[:1] == ["python"]), f"{path.name}:{start + 1}: indented python block"
    found = blocks(path)
    lines = text.splitlines()
    for block in found:
        assert lines[block.line - 1] == block.code.splitlines()[0], block.where
    assert sum("doc-test:" in line for line in lines) == sum(b.skip is not None for b in found), (
        f"{path.name}: a doc-test marker that is malformed or not right above a python block"
    )
    for block in found:
        if block.skip is not None:
            test = ROOT / block.skip.split()[0]
            assert test.is_file(), f"{block.where}: {test} does not exist"
            assert str(path.relative_to(ROOT)) in test.read_text(encoding="utf-8"), (
                f"{block.where}: {test.name} does not read {path.relative_to(ROOT)}"
            )


def test_the_expected_blocks_run() -> None:
    """The README shows a save/load and a DCP example, and the reference pages' examples run: a
    block moved, dropped or fenced differently is noticed here."""
    runs = {str(p.relative_to(ROOT)): sum(b.skip is None for b in blocks(p)) for p in DOC_FILES}
    assert runs["README.md"] == 2
    assert runs["docs/dcp.md"] == 4 and runs["docs/export.md"] == 2 and runs["docs/formats.md"] == 1
    assert runs["docs/cli.md"] == 1
    integrations = {p.name: [b.skip is None for b in blocks(p)] for p in (ROOT / "docs" / "integrations").glob("*.md")}
    assert integrations == {  # every trainer block is run by its trainer's test, none here
        "README.md": [],
        "dsd.md": [False],
        "hugging-face.md": [False] * 2,
        "lightning.md": [False] * 2,
        "olmo-core.md": [False],
        "nemo-automodel.md": [False] * 2,
        "veomni.md": [False],
        "torchtitan.md": [False] * 2,
        "verl.md": [],
        "trl.md": [],
        "torchtune.md": [False],
        "ray.md": [False],
    }, integrations


@pytest.mark.parametrize("path", DOC_FILES, ids=_ids(DOC_FILES))
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "docs"}
    for block in blocks(path):
        if block.skip is None:
            run_block(block, namespace)
        else:
            compile(block.code, str(path), "exec")  # at least valid Python


def test_a_failing_block_names_its_file_and_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## Part\n\n```python\nx = 1\nraise ValueError(x)\n```\n", encoding="utf-8")
    (block,) = python_blocks(page, "Part")
    assert (block.line, block.section, block.skip) == (6, "Part", None)
    with pytest.raises(ValueError) as info:
        run_block(block, {})
    frame = traceback.extract_tb(info.tb)[-1]
    assert (frame.filename, frame.lineno) == (str(page), 7)


def test_skip_marker_is_read(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "## A\n\n<!-- doc-test: skip; tests/test_x.py runs it (2 ranks) -->\n```python\nimport nowhere\n```\n"
        "\n```bash\n## not a heading\n```\n\n```python\ny = 2\n```\n",
        encoding="utf-8",
    )
    found = blocks(page)
    assert [(b.skip, b.section, b.code) for b in found] == [
        ("tests/test_x.py runs it (2 ranks)", "A", "import nowhere\n"),
        (None, "A", "y = 2\n"),
    ]
    assert isinstance(found[0], Block)
