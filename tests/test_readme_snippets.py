"""README.md's Python examples run as written: the ``python`` blocks of "## Usage", "## DCP usage"
and "## Export (pickle-free)", in that order and in one namespace (the DCP example continues the
Usage example, the Export example continues the DCP one), in a fresh working directory (they write
``ckpt/step_100`` and so on), single process. Any exception of a snippet fails the test."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

README = Path(__file__).resolve().parents[1] / "README.md"
SECTIONS = {"Usage": 1, "DCP usage": 2, "Export (pickle-free)": 1}
"""The sections whose ``python`` blocks run, in order, and how many blocks each has (a block
added, removed or fenced differently is noticed here)."""

_FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str, title: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of each ``python`` block of section ``## title`` (up to the
    next ``## `` heading; its ``###`` subsections included)."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip("\n") == f"## {title}"), None)
    assert start is not None, f"README.md has no section '## {title}'"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = "".join(lines[start:end])
    offset = len("".join(lines[:start]))
    return [(text.count("\n", 0, offset + m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(body)]


def test_sections_are_found() -> None:
    text = README.read_text(encoding="utf-8")
    for title, count in SECTIONS.items():
        assert len(python_blocks(text, title)) == count, title
    # the extractor reports where a block starts, so a failing snippet's traceback names its README line
    line, code = python_blocks(text, "Usage")[0]
    assert text.splitlines()[line - 1] == code.splitlines()[0]


def test_readme_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text(encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "readme"}
    for title in SECTIONS:
        for line, code in python_blocks(text, title):
            # Padded so that line numbers in a traceback are README.md's own.
            exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)  # noqa: S102 - our own README
    for done in ("ckpt/step_100/.metadata", "ckpt/step_200/.metadata", "ckpt/nested/.metadata",
                 "export/step_200/manifest.json"):
        assert (tmp_path / done).is_file(), done
    opt, opt2, opt3 = namespace["opt"], namespace["opt2"], namespace["opt3"]
    for restored in (opt2, opt3):
        assert restored["dense"].param_groups[0]["lr"] == opt["dense"].param_groups[0]["lr"] == 0.000625
        assert len(restored["experts"].state) == len(opt["experts"].state) == 2
    assert namespace["target"]["step"] == 200

