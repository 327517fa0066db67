"""The ``python`` blocks of the project's Markdown files, for the tests that run them.

Every ```` ```python ```` block of :data:`DOC_FILES` runs as a test (``tests/docs/test_doc_snippets.py``):
the blocks of one file in order, in one namespace, in a fresh working directory. A block that
cannot run there (it needs several ranks, a process group or a trainer package) carries a marker
on the line right above its opening fence, naming the test that runs it instead::

    <!-- doc-test: skip; tests/integrations/test_accelerate.py runs it (2 ranks, accelerate) -->

That test reads the block with :func:`python_blocks` (by file and section) and runs it with
:func:`run_block`, so what the page shows is what runs. The marker is an HTML comment: rendered
Markdown does not show it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = (
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "integrations").glob("*.md")),
    ROOT / "bench" / "README.md",
)
"""The Markdown files whose ``python`` blocks run as tests."""

SKIP_MARKER = re.compile(r"^<!-- doc-test: skip; (?P<reason>(?P<test>tests/[\w/]+\.py) runs it \(.+\)) -->$")
"""A skip marker: why the block is not run here, beginning with the test that runs it."""

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>```+)(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced ``python`` block of a Markdown file."""

    path: Path
    line: int
    """Line number (1-based) of the block's first code line."""
    code: str
    section: str
    """Title of the ``## `` section it is in (``""`` before the first one)."""
    skip: str | None
    """The skip marker's reason, ``None`` for a block that runs."""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fences(text: str) -> list[tuple[int, int, str, str]]:
    """``(opening line index, closing line index, info string, indent)`` of every fenced code block
    (0-based line indexes; an unclosed fence runs to the end of the text)."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        ticks, indent = m.group("ticks"), m.group("indent")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), len(lines))
        out.append((i, end, m.group("info").strip(), indent))
        i = end + 1
    return out


def blocks(path: Path) -> list[Block]:
    """Every ``python`` block of ``path``, in order."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    fenced = fences(text)
    inside = {j for start, end, _info, _indent in fenced for j in range(start, end + 1)}
    out = []
    for start, end, info, _indent in fenced:
        if info.split()[:1] != ["python"]:
            continue
        section = next(
            (lines[j][3:].strip() for j in range(start - 1, -1, -1) if j not in inside and lines[j].startswith("## ")),
            "",
        )
        marker = SKIP_MARKER.match(lines[start - 1]) if start > 0 else None
        code = "\n".join(lines[start + 1 : end]) + "\n"
        out.append(Block(path, start + 2, code, section, marker.group("reason") if marker else None))
    return out


def python_blocks(path: Path, section: str) -> list[Block]:
    """The ``python`` blocks of section ``## {section}`` of ``path`` (its ``###`` subsections included)."""
    found = [b for b in blocks(path) if b.section == section]
    headings = path.read_text(encoding="utf-8").splitlines()
    assert f"## {section}" in headings, f"{path.relative_to(ROOT)} has no section '## {section}'"
    return found


def run_block(block: Block, namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute ``block`` in ``namespace``; a traceback names the Markdown file and its line."""
    padded = "\n" * (block.line - 1) + block.code
    exec(compile(padded, str(block.path), "exec"), namespace)  # noqa: S102 - the project's own documentation
    return namespace
