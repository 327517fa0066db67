"""``python -m bench.scale`` runs every mode end to end at tiny sizes and writes well-formed results: the
items and records each layout plans, the ratios' references, the threshold sweep's counts and
crossover rule, the report's tables and plot (never checks times)."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import _backends
import pytest

import sparse_ckpt as sc
from bench import provenance
from bench.scale import scale
from bench.scale.scale_dcp import FLOOR, crossover, parse_size, threshold_counts
from bench.scale.scale_metadata import auto_threshold, split
from bench.suite.fixtures import EMBED_NAMES, FixtureCache, FixtureSpec, Scale, parse_fixture_specs
from sparse_ckpt._format.keys import is_state_item
from sparse_ckpt._layouts import STATE_LAYOUTS

core_backend = _backends.run_once
"""The bench is not a backend test: running it once is enough."""


def _run(tmp_path: os.PathLike[str], *argv: str) -> dict:
    out = os.path.join(tmp_path, f"{argv[0]}.json")
    assert scale.main([*argv, "--out", out]) == 0
    with open(out) as f:
        data = json.load(f)
    assert provenance.problems(out, data, "rerun") == [], "a bench.scale result records its provenance"
    return data


def _mixed_spec() -> str:
    """A tiny MoE plus two embeddings whose state chunks reach ``auto``'s threshold where there is one
    (else 64 KiB): ``auto`` then keeps those four state tensors per item and buckets the rest."""
    threshold = auto_threshold()
    nbytes = threshold[1] if threshold else 1 << 16
    return f"1x4:h4:e{nbytes // 16}x4"


def test_fixture_specs_parse_and_build() -> None:
    specs = parse_fixture_specs("24x128:h0, 4x16:h512,8x64:h64:e32768x64,2x4,2x4:h0")
    assert [s.label for s in specs] == ["24x128:h0", "4x16:h512", "8x64:h64:e32768x64", "2x4:h0"]
    assert specs[2] == FixtureSpec(Scale(8, 64), 64, (32768, 64))
    for bad in ("", "2x4:64", "2x4:h4:e0x4", "2x4:e4", "x4:h1"):
        with pytest.raises(ValueError):
            parse_fixture_specs(bad)
    fx = FixtureCache(hidden=4, embed=(32, 4)).get(Scale(1, 2), "layer")
    names = [n for n, _ in fx.model.named_parameters()]
    assert names[0] == "embed_tokens.weight" and names[-1] == "lm_head.weight"
    embeds = [getattr(fx.model, n).weight for n in EMBED_NAMES]
    assert all(fx.optimizer.state[p]["exp_avg"].shape == (32, 4) for p in embeds), "embeddings always have state"
    assert [g["params"] for g in fx.optimizer.param_groups[:2]] == [[embeds[0]], [embeds[1]]]
    assert len(fx.optimizer.param_groups) == 3


def test_dcp_mode_measures_every_layout_and_the_floor(tmp_path: os.PathLike[str]) -> None:
    res = _run(tmp_path, "dcp", "--fixtures", f"1x4:h0,{_mixed_spec()}", "--repeats", "1")
    assert res["layouts"] == list(STATE_LAYOUTS)
    assert [r["fixture"] for r in res["runs"]] == ["1x4:h0", _mixed_spec()]
    for run in res["runs"]:
        rows = {r["layout"]: r for r in run["rows"]}
        assert list(rows) == [*STATE_LAYOUTS, FLOOR]
        n_state = run["info"]["n_param_shaped_state"]
        # per_tensor: one item per parameter-shaped state tensor, plus the tables and guards
        assert n_state < rows["per_tensor"]["items"] <= n_state + 8
        assert rows["buffers"]["items"] <= 8
        for lay in STATE_LAYOUTS:
            assert rows["buffers"]["items"] <= rows[lay]["items"] <= rows["per_tensor"]["items"]
        assert rows[FLOOR]["items"] == 1 and rows[FLOOR]["vs_floor"] == [1.0, 1.0]
        assert min(rows["per_tensor"]["vs_best"][0], rows["buffers"]["vs_best"][0]) == 1.0
        assert all(len(r["samples_s"][0]) == 1 and r["disk_bytes"] > 0 for r in rows.values())
        # like for like: each layout also saved without fsync against the floor's torch.save, and with it
        # against the floor's torch.save + fsync
        for lay in STATE_LAYOUTS:
            r = rows[lay]
            assert len(r["save_unsynced_samples_s"]) == 1 and r["save_unsynced_s"] > 0
            assert r["save_unsynced_vs_floor"] == r["save_unsynced_s"] / rows[FLOOR]["save_s"]
            assert r["save_vs_floor_synced"] == r["save_s"] / rows[FLOOR]["save_synced_s"]
        assert "save_unsynced_s" not in rows[FLOOR]


def test_metadata_mode_records_per_layout(tmp_path: os.PathLike[str]) -> None:
    spec = _mixed_spec()
    res = _run(tmp_path, "metadata", "--fixture", spec, "--ranks", "2,4", "--repeats", "1")
    n_state = res["n_param_shaped_state"]
    rows = {(r["ranks"], r["layout"]): r for r in res["rows"]}
    assert set(rows) == {(n, lay) for n in (2, 4) for lay in STATE_LAYOUTS}
    for n in (2, 4):
        per, buf = rows[n, "per_tensor"], rows[n, "buffers"]
        assert per["items"] > n_state and per["chunk_records"] > n_state * n  # every state tensor: n chunks
        assert buf["chunk_records"] == buf["items"]  # one chunk per item: each rank's table and buffer
        assert buf["vs_per_tensor"]["bytes"] < 1 and per["vs_per_tensor"]["bytes"] == 1
        for lay in STATE_LAYOUTS:
            assert buf["chunk_records"] <= rows[n, lay]["chunk_records"] <= per["chunk_records"]
    assert res["split"]["per_tensor"]["per_item_state"] == n_state
    assert res["split"]["buffers"]["per_item_state"] == 0 and res["split"]["buffers"]["layout_tables"] == 1
    if "auto" in STATE_LAYOUTS:  # the two embeddings' state (4 tensors) per item, the rest bucketed
        assert res["split"]["auto"]["per_item_state"] == 4
        assert (
            rows[4, "buffers"]["chunk_records"]
            < rows[4, "auto"]["chunk_records"]
            < rows[4, "per_tensor"]["chunk_records"]
        )


def test_threshold_mode_counts_and_crossover(tmp_path: os.PathLike[str]) -> None:
    res = _run(tmp_path, "threshold", "--sizes", "4K,16K", "--total", "64K", "--repeats", "1")
    assert [(p["chunk_bytes"], p["n_params"], p["n_state_tensors"]) for p in res["points"]] == [
        (4096, 8, 16),
        (16384, 2, 4),
    ]
    for p in res["points"]:
        assert [r["layout"] for r in p["rows"]] == ["per_tensor", "buffers"] and len(p["ratio"]) == 3
        assert p["state_bytes"] >= 64 << 10  # plus the 0-dim steps
    assert set(res) >= {
        "crossover_bytes",
        "crossover_save_bytes",
        "crossover_load_bytes",
        "crossover_sum_bytes",
        "first_bytes",
    }
    assert threshold_counts([4, 1 << 30], 1 << 20, 100) == [(4, 100), (1 << 30, 1)]
    assert parse_size("16K") == parse_size("16KiB") == 16384 and parse_size("1M") == 1 << 20
    pts = [
        {"chunk_bytes": s, "ratio": r}
        for s, r in ((1, [2.0, 2.0, 2.0]), (2, [0.9, 1.0, 0.95]), (4, [1.1, 0.5, 0.9]), (8, [0.8, 0.9, 0.85]))
    ]
    assert crossover(pts) == {
        "crossover_bytes": 8,
        "crossover_save_bytes": 8,
        "crossover_load_bytes": 2,
        "crossover_sum_bytes": 2,
        "first_bytes": 2,
    }
    assert set(crossover(pts[:1]).values()) == {None}


def test_async_mode_blocked_and_total(tmp_path: os.PathLike[str]) -> None:
    res = _run(tmp_path, "async", "--fixtures", "1x2:h4", "--repeats", "1")
    (run,) = res["runs"]
    assert [r["variant"] for r in run["rows"]] == [*STATE_LAYOUTS, "stock_dsd"]
    for r in run["rows"]:
        assert 0 < r["state_dict_s"] <= r["blocked_s"] <= r["total_s"] and r["disk_bytes"] > 0
    assert run["rows"][-1]["vs_stock"] == [1.0, 1.0]


def test_report_tables_and_svg(tmp_path: os.PathLike[str]) -> None:
    paths = []
    for argv in (
        ("dcp", "--fixtures", "1x2:h0", "--repeats", "1"),
        ("metadata", "--fixture", "1x2:h0", "--ranks", "2,4", "--repeats", "1"),
        ("threshold", "--sizes", "4K", "--total", "16K", "--repeats", "1"),
    ):
        _run(tmp_path, *argv)
        paths.append(os.path.join(tmp_path, f"{argv[0]}.json"))
    svg = os.path.join(tmp_path, "scale.svg")
    md = os.path.join(tmp_path, "scale.md")
    assert scale.main(["report", *paths, "--svg", svg, "--out", md]) == 0
    with open(md) as f:
        text = f.read()
    assert sum(line.startswith("| --- |") for line in text.splitlines()) == 3 and "Crossover" in text
    assert all(f"| {lay} |" in text for lay in STATE_LAYOUTS)
    assert text.count("without fsync)") == len(STATE_LAYOUTS) and text.count("(save both fsync: ") == len(STATE_LAYOUTS)
    assert text.count("; neither: ") == len(STATE_LAYOUTS)
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}polyline")) == len(STATE_LAYOUTS)  # metadata bytes vs ranks, one per layout
    bars = [r for r in root.findall(f"{ns}rect") if r.get("fill") not in ("white", "none")]
    assert len(bars) == 4 * len(STATE_LAYOUTS)  # save + load per layout, and each panel's legend squares


def test_state_layouts_come_from_the_library() -> None:
    assert scale.parse_args(["dcp"]).layouts == list(STATE_LAYOUTS)
    with pytest.raises(SystemExit):
        scale.parse_args(["dcp", "--layouts", "nope"])
    fx = FixtureCache().get(Scale(1, 2), "layer")
    sd = sc.sparse_state_dict(fx.model, fx.optimizer, state_layout="buffers")
    assert split(sd)["per_item_state"] == sum(1 for k in sd if is_state_item(k)) == 0


def test_dcp_spread_runs_each_layout_with_and_without_huge_pages(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dcp --spread``: every layout and the floor measured once with the huge-page advice on and once
    off, each with its samples' min <= median <= max, and the caller's setting restored after."""
    monkeypatch.setenv("SPARSE_CKPT_HUGE_PAGES", "on")
    res = _run(tmp_path, "dcp", "--fixtures", "1x4:h0", "--layouts", "auto,buffers", "--repeats", "2", "--spread")
    assert res["spread"] is True
    assert [run["huge_pages"] for run in res["runs"]] == ["1", "0"]
    for run in res["runs"]:
        assert [sp["layout"] for sp in run["spread"]] == ["auto", "buffers", FLOOR]
        for sp in run["spread"]:
            assert sp["n"] == 2
            for lo, mid, hi in (sp["save"], sp["load"]):
                assert 0 < lo <= mid <= hi
    assert os.environ["SPARSE_CKPT_HUGE_PAGES"] == "on"
