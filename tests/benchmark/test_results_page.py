"""docs/results.md shows what the committed JSON of bench/results/ holds: every marked table of the
page is exactly what ``python -m bench.results_page`` renders from those files (a number typed into
the page, or a JSON file re-measured without re-rendering, fails here), a changed measurement
changes the table, and the plots it draws exist, are linked from the page and are written anew from
the JSON, each naming its data files, the command and the machine."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from doc_blocks import ROOT

from bench import results_page


def test_the_page_is_what_the_json_gives() -> None:
    text = results_page.PAGE.read_text(encoding="utf-8")
    assert results_page.render_page(text) == text, "docs/results.md is out of date: run python -m bench.results_page"


def test_the_committed_results_are_current() -> None:
    """``python -m bench.results_page --check`` on the committed files: each records its provenance and
    was measured with the current default layout, formats and bench inputs (the rule's details are
    tests/benchmark/test_results_provenance.py's, on synthetic files)."""
    assert results_page.stale() == []
    assert results_page.main(["--check"]) == 0


def test_every_table_is_marked_and_rendered() -> None:
    text = results_page.PAGE.read_text(encoding="utf-8")
    for name in results_page.TABLES:
        begin = results_page.BEGIN.format(name=name)
        assert text.count(begin) == 1, name
        body = text.split(begin, 1)[1].split(results_page.END, 1)[0]
        assert body.strip().startswith("|") and body.count("\n|") >= 3, f"table {name} is empty"


def test_a_changed_measurement_changes_the_page(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(results_page.RESULTS, results, ignore=shutil.ignore_patterns("*.png", "*.svg", "*.md"))
    titan = json.loads((results / "titan_compare.json").read_text(encoding="utf-8"))
    stock, before = (titan["results"][f"moe/{kind}"]["optimizer_items"] for kind in ("stock", "sparse"))
    assert before != 12345
    titan["results"]["moe/sparse"]["optimizer_items"] = 12345
    (results / "titan_compare.json").write_text(json.dumps(titan), encoding="utf-8")
    text = results_page.PAGE.read_text(encoding="utf-8")
    assert results_page.render_page(text, results) != text
    table = results_page.stock_table(results)
    n = results_page._n
    assert f"{n(stock)} -> 12 345 ({results_page._x(stock, 12345)})" in table
    assert f"{n(stock)} -> {n(before)} " not in table


def test_the_plots_are_drawn_from_the_json_and_linked(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    text = results_page.PAGE.read_text(encoding="utf-8")
    for plot in results_page.PLOTS:
        path = plot(tmp_path)
        assert path.stat().st_size > 10_000, path
        committed = results_page.IMG / path.name
        assert committed.is_file(), f"{committed} is not committed"
        assert f"](img/{path.name})" in text, f"docs/results.md does not show {path.name}"


def test_each_plot_names_its_command_and_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    footers: list[str] = []
    real = results_page._footer
    monkeypatch.setattr(
        results_page,
        "_footer",
        lambda fig, sources, results: (
            footers.append(
                "\n".join([results_page.COMMAND, *(results_page.machine(s, results_page.load(s)) for s in sources)])
            ),
            real(fig, sources, results),
        ),
    )
    for plot in results_page.PLOTS:
        plot(tmp_path)
    assert len(footers) == len(results_page.PLOTS)
    for footer in footers:
        assert results_page.COMMAND in footer and re.search(r"2[- ]core|\d+ cores", footer), footer


def test_the_readme_links_the_page_near_the_top() -> None:
    head = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:25]
    assert any("(docs/results.md)" in line for line in head), "README.md's first lines do not link docs/results.md"
