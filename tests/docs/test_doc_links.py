"""The project's Markdown renders as meant: every relative link of README.md, docs/*.md,
docs/integrations/*.md, bench/README.md and CONTRIBUTING.md points to a file or folder of the checkout (and an anchor
to a heading of the target page, as GitHub names headings), and every table has as many cells
in each row as in its header (GitHub splits cells at every unescaped ``|``, inside code too)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_blocks import ROOT, fences

PAGES = tuple(
    p
    for p in (
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "integrations").glob("*.md")),
        ROOT / "bench" / "README.md",
        ROOT / "CONTRIBUTING.md",
    )
    if p.is_file()
)
PENDING: set[Path] = set()
"""Pages another branch adds: a link to one is checked once it exists (add one while its page is on
its way, remove it when the page has landed)."""

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _ids(paths: tuple[Path, ...]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line outside fenced code blocks, code spans removed."""
    lines = text.splitlines()
    inside = {j for start, end, _info, _indent in fences(text) for j in range(start, end + 1)}
    return [(i + 1, _CODE_SPAN.sub("", line)) for i, line in enumerate(lines) if i not in inside]


def links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every inline link, image and link reference definition."""
    out = []
    for n, line in prose_lines(text):
        out += [(n, m.group(1)) for m in _LINK.finditer(line)]
        ref = _REF.match(line)
        if ref:
            out.append((n, ref.group(1)))
    return out


def slug(title: str) -> str:
    """GitHub's anchor of a heading: formatting dropped, lower case, punctuation removed, spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title.strip())  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of the headings of ``path`` (a repeated one gets ``-1``, ``-2``, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for _n, line in prose_lines_with_code(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def prose_lines_with_code(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, code spans kept (a heading's anchor includes their text)."""
    lines = text.splitlines()
    inside = {j for start, end, _info, _indent in fences(text) for j in range(start, end + 1)}
    return [(i + 1, line) for i, line in enumerate(lines) if i not in inside]


def test_pages() -> None:
    names = _ids(PAGES)
    assert {"README.md", "bench/README.md", "docs/formats.md"} <= set(names), names


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_relative_links_resolve(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    problems = []
    for n, target in links(text):
        if _SCHEME.match(target):
            continue  # http(s), mailto: not checked here
        path_part, _hash, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{n}: {target}"
        if ROOT not in dest.parents and dest != ROOT:
            problems.append(f"{where} leaves the checkout")
        elif not dest.exists():
            if dest not in PENDING:
                problems.append(f"{where} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def cells(row: str) -> int:
    """How many cells GitHub makes of a table row: split at unescaped ``|``, outer pipes dropped."""
    parts = re.split(r"(?<!\\)\|", row.strip())
    if parts and parts[0] == "":
        parts = parts[1:]
    if parts and parts[-1] == "":
        parts = parts[:-1]
    return len(parts)


def tables(text: str) -> list[list[tuple[int, str]]]:
    """The tables of ``text`` (outside code blocks): runs of lines starting with ``|``."""
    out: list[list[tuple[int, str]]] = []
    previous = -1
    for n, line in prose_lines_with_code(text):
        if not line.lstrip().startswith("|"):
            continue
        if n == previous + 1 and out:
            out[-1].append((n, line))
        else:
            out.append([(n, line)])
        previous = n
    return out


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_tables_have_consistent_columns(page: Path) -> None:
    problems = []
    for table in tables(page.read_text(encoding="utf-8")):
        (n0, header), *rows = table
        width = cells(header)
        if not rows or not re.fullmatch(r"\|?(\s*:?-+:?\s*\|)*\s*:?-+:?\s*\|?", rows[0][1].strip()):
            problems.append(f"{page.name}:{n0}: a table without a delimiter row under its header")
        for n, row in rows:
            if cells(row) != width:
                problems.append(f"{page.name}:{n}: {cells(row)} cells, the header has {width}")
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n## Scale: DCP (`bench.scale`)\n\nSee [x](other.md#part), ![img](pic.png), `[y](no.md)`\n\n"
        "```bash\n[z](missing.md)\n```\n\n| a | b |\n| --- | --- |\n| `x|y` | c |\n| d \\| e | f |\n",
        encoding="utf-8",
    )
    text = page.read_text(encoding="utf-8")
    assert [t for _n, t in links(text)] == ["other.md#part", "pic.png"]  # not in code spans or blocks
    assert anchors(page) == {"top", "scale-dcp-benchscale"}
    (table,) = tables(text)
    assert [cells(row) for _n, row in table] == [2, 2, 3, 2]  # a pipe in code splits the cell on GitHub
