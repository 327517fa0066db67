"""Every bench result records where, when and with which package it was measured, and
``python -m bench.results_page --check`` refuses a page whose JSON files do not: a file without
provenance, or one measured before the package's default state layout, a format version or the
bench inputs version changed, fails naming the file and the command that re-measures it; current
files pass. Synthetic JSON files only (the committed ones are re-measured on a quiet machine with
bench/refresh_results.sh)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import _backends
import pytest
from doc_blocks import ROOT

import sparse_ckpt
from bench import provenance, results_page

core_backend = _backends.run_once
"""Nothing here depends on the core backend: once is enough."""

SCRIPT = ROOT / "bench" / "refresh_results.sh"


def _results(tmp_path: Path, record: dict[str, Any] | None) -> tuple[Path, Path]:
    """A copy of the committed JSON files, each with provenance ``record`` (none if ``None``), and a
    copy of the page rendered from them (so only provenance can fail the check)."""
    results = tmp_path / "results"
    results.mkdir()
    for name in results_page.SOURCES:
        data = json.loads((results_page.RESULTS / name).read_text(encoding="utf-8"))
        data.pop("provenance", None)
        if record is not None:
            data["provenance"] = record
        (results / name).write_text(json.dumps(data), encoding="utf-8")
    page = tmp_path / "results.md"
    page.write_text(results_page.render_page(results_page.PAGE.read_text(encoding="utf-8"), results), encoding="utf-8")
    return results, page


def _check(results: Path, page: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = results_page.main(["--check", "--results", str(results), "--page", str(page)])
    return rc, capsys.readouterr().err


def _rewrite(results: Path, name: str, change: Any) -> None:
    data = json.loads((results / name).read_text(encoding="utf-8"))
    change(data)
    (results / name).write_text(json.dumps(data), encoding="utf-8")


def test_current_results_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, page = _results(tmp_path, provenance.record())
    assert _check(results, page, capsys) == (0, "")


def test_missing_provenance_fails_naming_the_file_and_the_rerun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results, page = _results(tmp_path, provenance.record())
    _rewrite(results, "titan_compare.json", lambda d: d.pop("provenance"))
    rc, err = _check(results, page, capsys)
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "titan_compare.json" in lines[0] and "no provenance" in lines[0]
    assert "rerun: bash bench/refresh_results.sh titan_compare.json" in lines[0]


def test_every_file_without_provenance_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, page = _results(tmp_path, None)
    rc, err = _check(results, page, capsys)
    assert rc == 1
    for name in results_page.SOURCES:
        assert f"{name}: records no provenance" in err and f"refresh_results.sh {name}" in err, name


@pytest.mark.parametrize("field", provenance.FIELDS)
def test_a_provenance_missing_a_field_fails(field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, page = _results(tmp_path, provenance.record())
    _rewrite(results, "hot_path.json", lambda d: d["provenance"].pop(field))
    rc, err = _check(results, page, capsys)
    assert rc == 1 and f"hot_path.json: its provenance lacks {field}" in err, err


@pytest.mark.parametrize(
    "key, old",
    [
        ("bench_inputs_version", provenance.BENCH_INPUTS_VERSION - 1),
        ("default_state_layout", "per_tensor"),
        ("formats", {**provenance.current_inputs()["formats"], "core": 0}),
    ],
)
def test_stale_results_fail(key: str, old: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results, page = _results(tmp_path, provenance.record())
    _rewrite(results, "results.json", lambda d: d["provenance"]["inputs"].__setitem__(key, old))
    rc, err = _check(results, page, capsys)
    assert rc == 1, err
    assert re.search(rf"results\.json: measured at .* with {key} .*\(now .*\): stale; rerun: .* results\.json", err), (
        err
    )


def test_a_missing_file_fails(tmp_path: Path) -> None:
    results, _page = _results(tmp_path, provenance.record())
    (results / "hot_path.json").unlink()
    assert "hot_path.json: missing" in results_page.stale(results)[0]


def test_the_default_layout_and_formats_come_from_the_package() -> None:
    from sparse_ckpt._format.layout_index import INDEX_VERSION
    from sparse_ckpt._layouts import DEFAULT_STATE_LAYOUT

    inputs = provenance.current_inputs()
    assert inputs["default_state_layout"] == DEFAULT_STATE_LAYOUT
    assert inputs["formats"]["layout_index"] == INDEX_VERSION
    assert inputs["bench_inputs_version"] == provenance.BENCH_INPUTS_VERSION


def test_record_holds_commit_date_machine_and_load() -> None:
    rec = provenance.record()
    assert set(rec) == set(provenance.FIELDS)
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?|sparse_ckpt .* \(installed\)", rec["commit"]), rec["commit"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["date"]), rec["date"]
    assert rec["machine"]["cores"] >= 1 and rec["machine"]["torch"] and rec["machine"]["cpu"]
    for when in ("before", "after"):
        assert len(rec["load_average"][when]) == 3, rec["load_average"]
    assert results_page.machine("hot_path.json", {"provenance": rec}).startswith(rec["machine"]["cpu"])


def test_commit_names_a_dirty_tree_and_an_installed_package(tmp_path: Path) -> None:
    assert provenance.commit(tmp_path) == f"sparse_ckpt {sparse_ckpt.__version__} (installed)"
    if shutil.which("git") is None:
        pytest.skip("no git")
    (tmp_path / "sparse_ckpt").mkdir()
    (tmp_path / "sparse_ckpt" / "f.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "r.json").write_text("{}\n")

    def git(*args: str) -> str:
        cmd = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    sha = git("rev-parse", "--short=12", "HEAD")
    assert provenance.commit(tmp_path) == sha
    (tmp_path / "bench" / "results" / "r.json").write_text('{"a": 1}\n')  # a refresh's own output
    assert provenance.commit(tmp_path) == sha
    (tmp_path / "sparse_ckpt" / "f.py").write_text("x = 2\n")
    assert provenance.commit(tmp_path) == sha + "-dirty"


def test_the_refresh_script_makes_every_file_the_page_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    text = SCRIPT.read_text(encoding="utf-8")
    order = re.search(r"^ORDER=\(([^)]*)\)", text, re.MULTILINE)
    assert order is not None
    assert order.group(1).split() == list(results_page.SOURCES)
    for name in results_page.SOURCES:
        for table in ("FULL", "SMALL", "EST"):
            assert f"{table}[{name}]=" in text, (table, name)
    read: set[str] = set()
    real = results_page.load
    monkeypatch.setattr(
        results_page, "load", lambda name, results=results_page.RESULTS: read.add(name) or real(name, results)
    )
    results_page.render_page(results_page.PAGE.read_text(encoding="utf-8"))
    assert read <= set(results_page.SOURCES), read - set(results_page.SOURCES)
