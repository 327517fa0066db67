"""The code, tests and docs say what they guarantee, never which tracker ticket asked for it: no file
of the package, the C++ core, the tests, the docs, the bench, the CI scripts, README.md or
CONTRIBUTING.md names an internal ticket (by its number, in parentheses, or as "the ticket's ..."),
which no user or contributor can follow. CHANGELOG.md may keep version history and is not scanned."""

from __future__ import annotations

import re
from pathlib import Path

from doc_blocks import ROOT

SCANNED = (
    "sparse_ckpt",
    "csrc",
    "tests",
    "docs",
    "bench",
    ".ci",
    "README.md",
    "CONTRIBUTING.md",
    "setup.py",
    "pyproject.toml",
)
"""What is scanned: every text file under these paths (folders recursively)."""
SUFFIXES = {".py", ".pyi", ".md", ".cpp", ".h", ".hpp", ".sh", ".txt", ".toml", ".cfg", ".in", ".yml", ".yaml", ""}
"""The kinds of text file scanned (``""``: extension-less scripts such as ``.ci/run``)."""
SKIPPED_DIRS = {"__pycache__", "out", "build", ".pytest_cache"}

_WORD = "iss" + "ue"  # spelled in two parts so this file does not match itself
REFERENCE = re.compile(rf"\b{_WORD}s?[ -]#?\d|\({_WORD}\b|\bthe {_WORD}'s\b", re.IGNORECASE)
"""A reference to a tracker ticket: the word followed by a number (``#`` optional, space or hyphen),
an opening parenthesis before the word, or "the ...'s" (a ticket as the subject)."""


def scanned_files() -> list[Path]:
    """Every scanned text file of the checkout."""
    out = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += [
                p
                for p in sorted(path.rglob("*"))
                if p.is_file() and p.suffix in SUFFIXES and not SKIPPED_DIRS.intersection(p.relative_to(ROOT).parts)
            ]
    return out


def references(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line of ``text`` that names a ticket."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if REFERENCE.search(line)]


def test_no_file_names_a_tracker_ticket() -> None:
    files = scanned_files()
    assert len(files) > 100 and ROOT / "README.md" in files and ROOT / ".ci" / "run" in files
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text
        found += [f"{path.relative_to(ROOT)}:{n}: {line}" for n, line in references(text)]
    assert not found, "say what is guaranteed instead of which ticket asked for it:\n" + "\n".join(found)


def test_the_pattern_finds_what_it_looks_for() -> None:
    word = _WORD
    hits = [
        f"({word} 28, item 4)",
        f"{word.title()} 28, item 6: a dtype",
        f"{word}s 23 and 31",
        f"the {word}-30 drill",
        f"{word} #37",
        f"the {word}'s MoE",
    ]
    misses = [f"raise an error or {word} a warning", f"a known {word} of torch", f"t{word} 3", f"{word}d 3 times"]
    assert all(references(h) for h in hits), [h for h in hits if not references(h)]
    assert not any(references(m) for m in misses), [m for m in misses if references(m)]
