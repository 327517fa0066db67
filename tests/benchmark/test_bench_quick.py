"""The bench runs end to end on a tiny scale and writes well-formed results (never checks times).

Also checks the bench's fixtures against torch: the O(groups) optimizer construction must give the
same param groups as ``torch.optim.AdamW(specs)``, and the directly filled state must have the
structure one real AdamW step creates. The bench covers both core backends itself, so these tests
run once (under the ``python`` backend parameter).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import subprocess
import sys

import _backends
import pytest
import torch
from helpers import small_bench_args

import sparse_ckpt as sc
from bench import provenance
from bench import run as bench_run
from bench.run import main
from bench.suite import information, plots, report_markdown, verdicts
from bench.suite.fixtures import (
    ADAMW_KWARGS,
    FixtureCache,
    Scale,
    build_adamw,
    group_specs,
    param_shaped_state_tensors,
    parse_scales,
    step_state,
)
from bench.suite.measure import (
    LEAF,
    FixtureContext,
    naive_items,
    naive_state_dict,
    runner_for,
)
from bench.suite.methods import (
    CORE_FUNCTIONS,
    DCP_NAIVE_SAVE,
    DCP_STATEFUL_SAVE,
    FLOOR_STATE_DICT,
    Method,
    plan_methods,
    planned_ids,
)

STATUSES = {"ok", "skipped", "unavailable"}


core_backend = _backends.run_once
"""The bench measures both backends itself: running it once is enough."""


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("bench"))
    code = main(
        [
            "--quick",
            "--scales",
            "1x2,2x4",
            "--repeats",
            "1",
            "--budget",
            "0.5",
            "--out",
            out,
            "--no-progress",
            "--dsd-max-params",
            "20",
            "--dcp-max-items",
            "200",
        ]
    )
    assert code == 0
    return out


def _load(out: str) -> dict:
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        return json.load(f)


def test_results_json_schema(bench_out: str) -> None:
    res = _load(bench_out)
    assert res["schema"] == "sparse_ckpt-bench/1"
    assert provenance.problems("results.json", res, "rerun") == [], res.get("provenance")
    m = res["machine"]
    for key, typ in (("cpu_model", str), ("cores", int), ("torch", str), ("python", str), ("device", str)):
        assert isinstance(m[key], typ), key
    assert m["device"] == "cpu"
    assert m["backends"]["python"] == "available"
    assert m["backends"]["cpp"] == "available" or m["backends"]["cpp"].startswith("unavailable")
    assert res["config"]["scales"] == ["1x2", "2x4"]
    ids = [meth.id for meth in plan_methods()]
    assert res["config"]["methods"] == ids
    runs = res["runs"]
    assert [(r["scale"], r["layout"]) for r in runs] == [(s, lay) for s in ("1x2", "2x4") for lay in ("layer", "param")]
    for run in runs:
        assert run["n_params"] == Scale(run["layers"], run["experts"]).n_params
        assert 0 < run["n_stateful"] < run["n_params"]
        assert run["n_groups"] == (run["layers"] if run["layout"] == "layer" else run["n_params"])
        assert list(run["figures"]) == ids, "every method is present, in plan order"
        for mid, fig in run["figures"].items():
            assert fig["status"] in STATUSES, (mid, fig)
            if fig["status"] != "ok":
                assert isinstance(fig["reason"], str) and fig["reason"], mid
                continue
            for key in ("median_s", "min_s", "max_s"):
                assert isinstance(fig[key], float) and math.isfinite(fig[key]) and fig[key] >= 0, (mid, key)
            assert fig["min_s"] <= fig["median_s"] <= fig["max_s"]
            assert isinstance(fig["n"], int) and fig["n"] == len(fig["samples_s"]) >= 1
            if fig["family"] == "dcp" and fig["op"] == "save":
                assert isinstance(fig["items"], int) and fig["items"] >= 1
                assert isinstance(fig["bytes"], int) and fig["bytes"] > 0
            if fig["family"] == "export" and fig["op"] == "save" and fig["status"] == "ok":
                assert isinstance(fig["bytes"], int) and fig["bytes"] > 0  # the export directory's size


def test_skips_and_unavailable_are_explicit(bench_out: str) -> None:
    res = _load(bench_out)
    cpp_ok = res["machine"]["backends"]["cpp"] == "available"
    for run in res["runs"]:
        figs = run["figures"]
        big = run["n_params"] > 20
        assert (figs["dsd/get"]["status"] == "skipped") == big
        if big:
            assert "--dsd-max-params" in figs["dsd/set"]["reason"]
        for mid, fig in figs.items():
            if fig["backend"] == "cpp" and not cpp_ok:
                assert fig["status"] == "unavailable", mid
            elif fig["family"] in ("dcp", "export") and fig["status"] == "skipped":
                assert "--dcp-max-items" in fig["reason"], mid
            elif fig["family"] != "dsd":
                assert fig["status"] == "ok", (mid, fig)
        assert figs["dcp/save/packed/groups"]["status"] == "ok"
    # the smallest scale is under every limit: all of its figures are measured
    for run in res["runs"][:2]:
        assert all(f["status"] == "ok" for f in run["figures"].values() if f["backend"] != "cpp" or cpp_ok)


def test_targets_and_outputs(bench_out: str) -> None:
    res = _load(bench_out)
    rows = res["targets"]
    # quick mode: no verdicts, only indicative ratios (and N/A where a figure is missing)
    assert res["targets_mode"]["judged"] is False and "quick" in res["targets_mode"]["why"]
    assert [r["target"] for r in rows] == [t.name for t in verdicts.TARGETS]
    assert all(r["status"] in {verdicts.INDICATIVE, verdicts.NA} for r in rows)
    assert all(r["verdict"] in {verdicts.PASS, verdicts.MISS, verdicts.NA} for r in rows)
    assert all((r["status"] == verdicts.NA) == (r["verdict"] == verdicts.NA) for r in rows)
    by_name = {r["target"]: r for r in rows}
    for t in (
        verdicts.SAVE_COST_PARAM,
        verdicts.SAVE_COST_LAYER,
        verdicts.LOAD_COST_PARAM,
        verdicts.LOAD_COST_LAYER,
        verdicts.BACKEND_SPEEDUP,
        verdicts.DCP_ITEMS_PARAM,
        verdicts.DCP_ITEMS_LAYER,
        verdicts.DCP_VS_NAIVE_LAYER,
    ):
        row = by_name[t.name]
        assert row["value"] is not None and row["where"].startswith(f"2x4, {t.layout} (largest measured"), t.name
    # the naive layout of 2x4 with one group per param exceeds --dcp-max-items 200: measured at 1x2 instead
    assert by_name[verdicts.DCP_VS_NAIVE_PARAM.name]["where"].startswith("1x2, param (largest measured; 24x128")
    for t in (verdicts.GROWTH_SAVE_PARAM, verdicts.GROWTH_LOAD_LAYER):  # needs 61x256 and 200x1024: no fallback
        assert by_name[t.name]["status"] == verdicts.NA and "not run" in by_name[t.name]["reason"]
    info = {(r["name"], r["where"].split(",")[1].split()[0] if "," in r["where"] else ""): r for r in res["info"]}
    assert (information.INFO_DCP_GROUPS_BYTES, "param") in info and (information.INFO_DSD_SET, "layer") in info
    export = [r for r in res["info"] if r["name"] == information.INFO_EXPORT_BYTES]
    assert export and all(r["value"] is not None and r["value"] > 0 for r in export), export
    with open(os.path.join(bench_out, "results.md"), encoding="utf-8") as f:
        md = f.read()
    assert "## Targets" in md and "### 2x4, one group per param" in md
    assert "## Information (no targets)" in md and "## Growth of every figure (information)" in md
    assert "INDICATIVE ONLY (quick mode" in md and "| PASS |" not in md and "| MISS |" not in md
    assert "indicative: within" in md or "indicative: outside" in md
    assert md.count("| method | backend | format | median (min–max) | n | note |") == 4
    pngs = [os.path.join(bench_out, name) for name in plots.FIGURE_NAMES]
    if importlib.util.find_spec("matplotlib") is not None:
        for png in pngs:
            with open(png, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    else:
        assert not any(os.path.exists(png) for png in pngs)


def test_dcp_item_counts(bench_out: str) -> None:
    """The naive layout writes one item per state value and per group key; the run records what the
    DCP items target divides by (param-shaped state tensors, leaves)."""
    res = _load(bench_out)
    cache = FixtureCache()
    for run in res["runs"]:
        fx = cache.get(Scale(run["layers"], run["experts"]), run["layout"])
        assert run["n_param_shaped_state"] == param_shaped_state_tensors(fx.optimizer) == 2 * run["n_stateful"]
        assert run["n_leaves"] == 1
        naive = run["figures"][DCP_NAIVE_SAVE]
        if naive["status"] == "ok":
            assert naive["items"] == naive_items(fx.optimizer) == run["n_state_tensors"] + 12 * run["n_groups"]
        else:
            assert "--dcp-max-items" in naive["reason"]
        stateful = run["figures"][DCP_STATEFUL_SAVE]
        # the Stateful (state_layout="auto": these small tensors go into one layout table and one
        # float32 bucket instead of an item each) adds the planner guard and the foreign-loader
        # guards (one leaf: its first FQN, and the nested one)
        packed = run["figures"]["dcp/save/packed/all"]["items"]
        assert stateful["status"] == "ok" and stateful["items"] == packed - run["n_param_shaped_state"] + 2 + 1 + 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_naive_and_stateful_round_trip(tmp_path) -> None:
    """What the DCP figures time really round-trips: the naive dict into its target, and the whole
    optimizer (SparseOptimizerState + SparseLoadPlanner) into a fresh optimizer."""
    fx = FixtureCache().get(Scale(2, 4), "param")
    ctx = FixtureContext(fx, str(tmp_path))
    try:
        naive = naive_state_dict(fx.model, fx.optimizer)
        assert set(naive["state"]) == {n for n, p in fx.model.named_parameters() if p in fx.optimizer.state}
        fqn_of = {id(p): n for n, p in fx.model.named_parameters()}
        assert [g["params"] for g in naive["param_groups"]] == [
            [fqn_of[id(p)] for p in g["params"]] for g in fx.optimizer.param_groups
        ]
        for m in (Method("dcp", "save", None, "naive", "all"), Method("dcp", "save", None, "packed", "stateful")):
            call, setup = runner_for(m, ctx, None)
            call(setup())
        call, setup = runner_for(Method("dcp", "load", None, "naive", "all"), ctx, None)
        target, path = setup()
        call((target, path))
        loaded = target[LEAF]
        assert loaded["param_groups"] == naive["param_groups"]
        for fqn, state in naive["state"].items():
            assert all(torch.equal(loaded["state"][fqn][k], v) for k, v in state.items())
        call, setup = runner_for(Method("dcp", "load", None, "packed", "stateful"), ctx, None)
        target, path = setup()
        fresh = target[LEAF].optimizer
        assert not fresh.state
        call((target, path))
        assert sc.sparse_state_dict(fx.model, fresh).keys() == sc.sparse_state_dict(fx.model, fx.optimizer).keys()
        assert fresh.state_dict()["param_groups"] == fx.optimizer.state_dict()["param_groups"]
        assert len(fresh.state) == len(fx.optimizer.state)
    finally:
        ctx.close()


def test_method_ids_are_named_constants() -> None:
    """Every id the targets and plots divide is one the bench plans: renaming a method fails loudly."""
    ids = planned_ids()
    assert set(verdicts.target_method_ids()) <= ids
    assert set(information.info_method_ids()) <= ids
    assert set(plots.plot_method_ids()) <= ids
    verdicts.check_method_ids()
    with pytest.raises(RuntimeError, match="core/encode/cpp"):
        verdicts.check_method_ids(["core/encode/cpp"])
    assert set(information.INFO_CORE_FUNCTIONS) <= set(CORE_FUNCTIONS)
    assert len({t.name for t in verdicts.TARGETS}) == len(verdicts.TARGETS)


def _fig(t: float, **extra: object) -> dict:
    return {"status": "ok", "median_s": t, "min_s": t, "max_s": t, "n": 1, **extra}


def _results(runs: list[dict], quick: bool = False, cpp: str = "available") -> dict:
    return {
        "machine": {"backends": {"cpp": cpp, "python": "available"}},
        "config": {"layouts": ["param", "layer"], "scales": sorted({r["scale"] for r in runs}), "quick": quick},
        "runs": runs,
    }


def _run(scale: str, layout: str, figures: dict, **info: object) -> dict:
    return {"scale": scale, "layout": layout, "n_params": parse_scales(scale)[0].n_params, "figures": figures, **info}


def test_full_run_at_target_scale_gets_verdicts() -> None:
    """Only a non-quick run that measured a row's own scale gets PASS/MISS; anything else is INDICATIVE."""

    def results(scale: str, quick: bool) -> dict:
        figures = {FLOOR_STATE_DICT: _fig(1.0), "sparse/save/cpp/packed": _fig(3.0)}
        return _results([_run(scale, "param", figures)], quick)

    def save_row(res: dict) -> dict:
        return next(r for r in verdicts.compute_targets(res) if r["target"] == verdicts.SAVE_COST_PARAM.name)

    assert save_row(results("61x256", False))["status"] == verdicts.MISS
    for scale, quick in (("61x256", True), ("8x64", False)):
        row = save_row(results(scale, quick))
        assert row["status"] == verdicts.INDICATIVE and row["verdict"] == verdicts.MISS
        assert report_markdown.indicative_banner(results(scale, quick))
    assert report_markdown.indicative_banner(results("61x256", False)) is None


def test_header_and_progress_lines(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """stdout starts with a header a person can read; a non-TTY stderr gets one line per figure, no \\r."""
    assert (
        main(
            [
                *small_bench_args("0.2"),
                "--out",
                str(tmp_path),
                "--methods",
                "floor/",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    head = out.splitlines()[:12]
    assert head[0] == bench_run.RULE and head[1].startswith("sparse_ckpt bench: QUICK mode") and "INDICATIVE" in head[1]
    text = "\n".join(head)
    for key in (
        "command   python -m bench --quick --scales 1x2",
        "machine ",
        "torch 2.",
        "backends  python available",
        "device    cpu",
        "scales    1x2 (13 params)",
        f"output    {tmp_path}",
    ):
        assert key in text, key
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 1 + len(plan_methods()), "one line per fixture and per figure"
    total = str(len(lines))
    assert lines[0].startswith(f"[{'1':>{len(total)}}/{total} ") and "1x2 param fixture" in lines[0]
    assert any("floor/state_dict: " in line and "µs" in line for line in lines)
    assert any("skipped: not selected by --methods" in line for line in lines)
    assert "*** INDICATIVE ONLY" in out and f"wrote {tmp_path}" in out


def test_progress_modes() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert bench_run.Progress(3, "auto", Tty()).mode == "bar"
    assert bench_run.Progress(3, "auto", io.StringIO()).mode == "lines"
    quiet = io.StringIO()
    bar = bench_run.Progress(2, "off", quiet)
    bar.done("a", "b")
    bar.close()
    assert quiet.getvalue() == ""


def test_checkout_entry_points(tmp_path) -> None:
    """In a checkout: ``python -m bench`` / ``python bench/run.py`` / ``bench.resume``; output under bench/out."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert bench_run.in_checkout() and bench_run.default_out() == os.path.join(root, "bench", "out")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cmd in (
        [sys.executable, "-m", "bench", "--help"],
        [sys.executable, "bench/run.py", "--help"],
        [sys.executable, "-m", "bench.resume", "--help"],
    ):
        proc = subprocess.run(cmd, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (cmd, proc.stderr)
        assert proc.stdout.startswith("usage: "), cmd


def test_targets_compute_ratios() -> None:
    """The targets table divides the right medians and judges the thresholds, each at its own scale."""
    cost = {
        "floor/state_dict": _fig(1.0),
        "floor/load_state_dict": _fig(10.0),
        "sparse/save/cpp/packed": _fig(1.5),
        "sparse/load/cpp/packed": _fig(2.0),
        "sparse/save/python/packed": _fig(6.0),
        "sparse/load/python/packed": _fig(4.0),
        "dsd/set": _fig(400.0),
    }
    layer = {**cost, "sparse/save/cpp/packed": _fig(3.0), "sparse/load/cpp/packed": _fig(5.0)}

    def dcp(stateful: float, naive: float, items: int) -> dict:
        return {
            "dcp/save/packed/stateful": _fig(stateful, items=items + 1, bytes=100),
            "dcp/load/packed/stateful": _fig(stateful),
            "dcp/save/naive/all": _fig(naive, items=5 * items, bytes=300),
            "dcp/load/naive/all": _fig(naive),
            "dcp/save/packed/all": _fig(stateful, items=items, bytes=100),
            "dcp/save/packed/groups": _fig(0.01, items=1, bytes=10),
        }

    runs = [
        _run("61x256", "param", cost),
        _run("61x256", "layer", layer),
        # 24x128: param passes both DCP targets; layer has one item per step still (14 329 > 9 552 + 1 + 1)
        _run("24x128", "param", dcp(1.0, 2.0, 9554), n_param_shaped_state=9552, n_leaves=1),
        _run("24x128", "layer", dcp(1.0, 1.2, 14329), n_param_shaped_state=9552, n_leaves=1),
    ]
    rows = {r["target"]: r for r in verdicts.compute_targets(_results(runs))}
    assert all(r["status"] == r["verdict"] for r in rows.values()), "a full run gets verdicts at its scales"

    def check(t: verdicts.Target, value: float | None, status: str) -> dict:
        row = rows[t.name]
        assert row["status"] == status, (t.name, row)
        if value is None:
            assert row["value"] is None and row["reason"]
        else:
            assert row["value"] == pytest.approx(value), t.name
        return row

    check(verdicts.SAVE_COST_PARAM, 1.5, "PASS")
    check(verdicts.SAVE_COST_LAYER, 3.0, "MISS")
    check(verdicts.LOAD_COST_PARAM, 2.0, "PASS")  # ÷ state_dict(), not load_state_dict()
    check(verdicts.LOAD_COST_LAYER, 5.0, "PASS")
    check(verdicts.BACKEND_SPEEDUP, 10.0 / 3.5, "MISS")
    assert "24x128, param" in check(verdicts.DCP_VS_NAIVE_PARAM, 0.5, "PASS")["where"]
    check(verdicts.DCP_VS_NAIVE_LAYER, 1.0 / 1.2, "MISS")
    items = check(verdicts.DCP_ITEMS_PARAM, 1.0, "PASS")
    assert "9,554 items; bound 9,554 = 9,552 param-shaped state tensors + 1 leaf + 1 table item" in items["detail"]
    check(verdicts.DCP_ITEMS_LAYER, 14329 / 9554, "MISS")
    growth = check(verdicts.GROWTH_SAVE_PARAM, None, "N/A")
    assert growth["reason"] == "200x1024 with one group per param not run"
    info = {(r["name"], r["where"]): r for r in information.compute_info(_results(runs))}
    assert info[(information.INFO_DSD_SET, "61x256, param")]["value"] == pytest.approx(200.0)
    assert info[(information.INFO_LOAD_VS_TORCH_LOAD, "61x256, param")]["value"] == pytest.approx(0.2)
    assert info[(information.INFO_DCP_NAIVE_BYTES, "24x128, param")]["value"] == pytest.approx(3.0)

    cost["sparse/save/cpp/packed"] = {"status": "unavailable", "reason": "not built"}
    rows = {r["target"]: r for r in verdicts.compute_targets(_results(runs, cpp="unavailable (not built)"))}
    row = rows[verdicts.SAVE_COST_PARAM.name]
    assert row["status"] == "N/A" and "cpp backend unavailable" in row["reason"]


def test_growth_targets() -> None:
    """Per-parameter growth 61x256 -> 200x1024 of sparse save/load, divided by torch's state_dict()'s."""
    p_small, p_big = Scale(61, 256).n_params, Scale(200, 1024).n_params
    k = p_big / p_small  # a linear cost grows by k
    small = {"floor/state_dict": _fig(1.0), "sparse/save/cpp/packed": _fig(1.0), "sparse/load/cpp/packed": _fig(2.0)}
    big = {
        "floor/state_dict": _fig(1.1 * k),
        "sparse/save/cpp/packed": _fig(1.2 * k),
        "sparse/load/cpp/packed": _fig(2 * 1.6 * k),
    }
    runs = [_run("61x256", "param", small), _run("200x1024", "param", big)]
    rows = {r["target"]: r for r in verdicts.compute_targets(_results(runs))}
    save, load = rows[verdicts.GROWTH_SAVE_PARAM.name], rows[verdicts.GROWTH_LOAD_PARAM.name]
    assert save["value"] == pytest.approx(1.2 / 1.1) and save["status"] == "PASS"
    assert load["value"] == pytest.approx(1.6 / 1.1) and load["status"] == "MISS"
    assert "torch 1.10×" in save["detail"]
    assert rows[verdicts.GROWTH_SAVE_LAYER.name]["status"] == "N/A"
    quick = {r["target"]: r for r in verdicts.compute_targets(_results(runs, quick=True))}
    assert quick[verdicts.GROWTH_SAVE_PARAM.name]["status"] == verdicts.INDICATIVE
    table = {(r["figure"], r["where"]): r for r in information.growth_rows(_results(runs))}
    row = table[("sparse/load/cpp/packed", "200x1024 / 61x256, param")]
    assert row["time_ratio"] == pytest.approx(1.6 * k) and row["per_param"] == pytest.approx(1.6)


def test_skipped_baseline_falls_back_to_largest_measured_scale() -> None:
    """A quadratic torch baseline skipped at the target scale is reported (as information) at the
    largest scale of each layout where it was measured, with the scale named."""
    skipped = {"status": "skipped", "reason": "47,275 groups > --dsd-set-max-groups 10,000"}
    runs = [
        _run("24x128", "param", {"dsd/set": _fig(30.0), "sparse/load/cpp/packed": _fig(0.2)}),
        _run("8x64", "param", {"dsd/set": _fig(1.0), "sparse/load/cpp/packed": _fig(0.1)}),
        _run("61x256", "layer", {"dsd/set": _fig(50.0), "sparse/load/cpp/packed": _fig(1.0)}),
        _run("61x256", "param", {"dsd/set": skipped, "sparse/load/cpp/packed": _fig(1.0)}),
    ]
    rows = [r for r in information.compute_info(_results(runs)) if r["name"] == information.INFO_DSD_SET]
    assert [(r["where"].split(" —")[0], r["value"]) for r in rows] == [
        ("24x128, param", pytest.approx(150.0)),
        ("61x256, layer", pytest.approx(50.0)),
    ]


def test_dsd_set_max_groups_skips_only_the_set(tmp_path: os.PathLike) -> None:
    out = str(tmp_path)
    assert (
        main(
            [
                *small_bench_args("0.5"),
                "--out",
                out,
                "--no-progress",
                "--methods",
                "dsd/",
                "--dsd-set-max-groups",
                "3",
            ]
        )
        == 0
    )
    figs = _load(out)["runs"][0]["figures"]
    assert figs["dsd/get"]["status"] == "ok"
    assert figs["dsd/set"]["status"] == "skipped" and "--dsd-set-max-groups 3" in figs["dsd/set"]["reason"]


def test_fast_constructor_matches_torch() -> None:
    """``build_adamw`` gives exactly the groups (keys, order, values) torch's constructor gives."""
    cache = FixtureCache()
    fx = cache.get(Scale(2, 3), "param")
    specs = group_specs(fx.model, "param")
    ref = torch.optim.AdamW(specs, **ADAMW_KWARGS)
    fast = build_adamw(specs, **ADAMW_KWARGS)
    assert len(ref.param_groups) == len(fast.param_groups) == Scale(2, 3).n_params
    for a, b in zip(ref.param_groups, fast.param_groups):
        assert list(a) == list(b)
        assert all(x is y for x, y in zip(a["params"], b["params"]))
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
    assert ref.state_dict() == fast.state_dict()


@pytest.mark.parametrize("layout", ["layer", "param"])
def test_filled_state_matches_a_real_step(layout: str) -> None:
    """``fill`` writes the same state structure (params, keys, dtypes, shapes) as one real step."""
    filled = FixtureCache(state_init="fill").get(Scale(2, 4), layout)
    stepped = FixtureCache(state_init="step").get(Scale(2, 4), layout)
    assert filled.info["n_stateful"] == stepped.info["n_stateful"] > 0
    fa, fb = filled.optimizer, stepped.optimizer
    params_a = [p for g in fa.param_groups for p in g["params"]]
    params_b = [p for g in fb.param_groups for p in g["params"]]
    for pa, pb in zip(params_a, params_b):
        assert (pa in fa.state) == (pb in fb.state)
        if pa in fa.state:
            sa, sb = fa.state[pa], fb.state[pb]
            assert list(sa) == list(sb)
            for key in sa:
                assert (sa[key].dtype, sa[key].shape, sa[key].device) == (sb[key].dtype, sb[key].shape, sb[key].device)
    assert all(p.grad is None for p in params_b), "step_state clears the grads it set"
    step_state(fb, [])  # no grads: AdamW creates no state
    assert len(fb.state) == stepped.info["n_stateful"]


def test_parse_scales_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_scales("8x64, 24x128,8x64") == [Scale(8, 64), Scale(24, 128)]
    for bad in ("8", "0x4", "axb", ""):
        with pytest.raises(ValueError):
            parse_scales(bad)
    with pytest.raises(SystemExit) as exc:
        main(["--layouts", "diagonal"])
    assert exc.value.code == 2


def test_missing_device_exits_2(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "cuda" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_targets_mode_header_before_any_run() -> None:
    """The header (printed before any figure) of a full run that includes the target scale and
    layout says the targets will be judged; once runs exist, only a measured target scale counts."""
    config = {"scales": ["8x64", verdicts.TARGET_SCALE], "layouts": ["layer", verdicts.TARGET_LAYOUT], "quick": False}
    assert verdicts.targets_mode({"config": config, "runs": []})[0] is True
    assert verdicts.targets_mode({"config": {**config, "scales": ["8x64"]}, "runs": []})[0] is False
    assert verdicts.targets_mode({"config": {**config, "layouts": ["layer"]}, "runs": []})[0] is False
    small = [{"scale": "8x64", "layout": verdicts.TARGET_LAYOUT}]
    assert verdicts.targets_mode({"config": config, "runs": small})[0] is False


# --------------------------------------------------------------------------- figure layout

PLOT_SCALES = ("8x64", "24x128", "61x256", "120x512", "200x1024")


def _synthetic_full_results() -> dict:
    """A full run's results over the default scales, with figures skipped at the larger scales the
    way the bench's limits skip them (DSD, torch's load, flat and naive DCP, all DCP): the legends
    then carry what was not measured, as a real run's do. Times, bytes and items are made up."""
    runs = []
    for i, scale in enumerate(PLOT_SCALES):
        for layout in ("layer", "param"):
            figures = {}
            for k, mid in enumerate(sorted(planned_ids())):
                skipped = (
                    (mid.startswith("dsd/") and i >= 2)
                    or (mid == "floor/load_state_dict" and i >= 2)
                    or (mid.startswith("dcp/") and "/flat/all" in mid and i >= 2)
                    or (mid.startswith(("dcp/", "export/")) and "/packed/groups" not in mid and i >= 3)
                    or ("/naive/" in mid and layout == "param" and i >= 2)
                )
                if skipped:
                    figures[mid] = {"status": "skipped", "reason": "over a --*-max-* limit"}
                    continue
                extra = {"items": 10 ** (i + 2) + k, "bytes": 10 ** (i + 5) + k} if "/save" in mid else {}
                figures[mid] = _fig(1e-4 * 4**i * (1 + k % 7), **extra)
            runs.append(_run(scale, layout, figures, n_param_shaped_state=100, n_leaves=1))
    res = _results(runs)
    res["config"]["layouts"] = ["layer", "param"]
    res["machine"].update(cpu_model="Some CPU", cores=2, python="3.11.7", torch="2.13.0+cpu", device="cpu")
    return res


def _render_figures(results: dict, out: str) -> dict:
    """``plots.write_plots``, keeping each figure it saves (by file name) to inspect its layout."""
    from matplotlib.figure import Figure

    figures = {}
    savefig = Figure.savefig

    def keep(fig: Figure, fname: object, *args: object, **kwargs: object) -> None:
        savefig(fig, fname, *args, **kwargs)
        figures[os.path.basename(str(fname))] = fig

    Figure.savefig = keep  # type: ignore[method-assign]
    try:
        paths, message = plots.write_plots(results, out)
    finally:
        Figure.savefig = savefig  # type: ignore[method-assign]
    assert message is None and [os.path.basename(p) for p in paths] == list(plots.FIGURE_NAMES)
    return figures


def layout_problems(fig: object) -> list[str]:
    """Legends outside the figure or overlapping each other or a plot they do not belong to; x tick
    labels of one axes overlapping each other. Extents in pixels, from the figure's own renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.legend import Legend

    canvas = FigureCanvasAgg(fig)  # a closed figure keeps no renderer; drawing runs its layout again
    canvas.draw()
    renderer = canvas.get_renderer()
    frame = fig.bbox  # type: ignore[attr-defined]

    def overlap(a: object, b: object) -> float:
        w = min(a.x1, b.x1) - max(a.x0, b.x0)  # type: ignore[attr-defined]
        h = min(a.y1, b.y1) - max(a.y0, b.y0)  # type: ignore[attr-defined]
        return w * h if w > 0.5 and h > 0.5 else 0.0

    problems = []
    legends = [lg for lg in fig.findobj(Legend) if lg.get_visible()]  # type: ignore[attr-defined]
    boxes = [lg.get_window_extent(renderer) for lg in legends]
    names = [f"legend {i} ({lg.texts[0].get_text()[:30]!r}...)" for i, lg in enumerate(legends)]
    for name, box in zip(names, boxes):
        if box.x0 < frame.x0 - 1 or box.y0 < frame.y0 - 1 or box.x1 > frame.x1 + 1 or box.y1 > frame.y1 + 1:
            problems.append(
                f"{name} outside the figure: {[round(v) for v in box.extents]} vs {[round(v) for v in frame.extents]}"
            )
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if overlap(boxes[i], boxes[j]):
                problems.append(f"{names[i]} overlaps {names[j]}")
    for ax in fig.axes:  # type: ignore[attr-defined]
        plot_area = ax.get_window_extent(renderer)
        for name, lg, box in zip(names, legends, boxes):
            if lg.axes is not ax and overlap(box, plot_area):
                problems.append(f"{name} overlaps the plot {ax.get_title()!r}")
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        for a, b in zip(ticks, ticks[1:]):
            if overlap(a, b):
                problems.append(f"x tick labels collide in {ax.get_title()!r}")
                break
    return problems


@pytest.mark.parametrize("source", ["full-scales", "quick-run"])
def test_figure_legends_fit_and_do_not_overlap(source: str, request: pytest.FixtureRequest, tmp_path) -> None:
    """Every legend of every figure lies inside the figure, overlaps no other legend and no plot it
    does not belong to, and no two x tick labels of a plot collide (a full run's scales and a quick run's)."""
    pytest.importorskip("matplotlib")
    results = _synthetic_full_results() if source == "full-scales" else _load(request.getfixturevalue("bench_out"))
    figures = _render_figures(results, str(tmp_path))
    assert sorted(figures) == sorted(plots.FIGURE_NAMES)
    problems = {name: layout_problems(fig) for name, fig in figures.items()}
    assert not any(problems.values()), "\n".join(f"{name}: {p}" for name, ps in problems.items() for p in ps)


def test_plot_coverage_and_coinciding_series() -> None:
    """Legend suffixes say how far a line goes; a bytes / items line is left out only where another
    one covers every scale it was measured at, within :data:`plots.COINCIDE_WITHIN`."""
    skipped = {"status": "skipped", "reason": "limit"}
    runs = [
        _run(
            s,
            "param",
            {
                "a": _fig(1.0, bytes=100),
                "b": _fig(1.0, bytes=103),
                "c": _fig(1.0, bytes=150) if s != "61x256" else skipped,
            },
        )
        for s in PLOT_SCALES[:3]
    ]
    runs[2]["figures"]["a"] = skipped
    a, b, c = (plots.Series(n, (n,), "k", field="bytes") for n in "abc")
    assert plots.coverage(b, runs) == ""
    assert plots.coverage(a, runs) == " (up to 24x128)"
    runs[0]["figures"]["a"] = skipped
    assert plots.coverage(a, runs) == " (only 24x128)"
    assert plots.coverage(plots.Series("d", ("d",), "k"), runs) == " (not measured)"
    assert plots.coinciding(a, b, runs) == pytest.approx(3 / 103)  # a measured only where b is
    assert plots.coinciding(b, a, runs) is None  # b goes further than a: leaving it out would lose points
    assert plots.coinciding(c, b, runs) == pytest.approx(47 / 103)


def test_export_vs_dcp_info_rows() -> None:
    """Export ÷ DCP of the whole optimizer (dir bytes, save time, load time): one information row per
    scale and layout where both figures were measured, none where either was skipped."""
    skipped = {"status": "skipped", "reason": "9,999 entries > --dcp-max-items 200"}

    def figs(
        export_s: float, export_bytes: int, load_s: float, dcp_s: float, dcp_bytes: int, dcp_load_s: float
    ) -> dict:
        return {
            "export/save": _fig(export_s, bytes=export_bytes),
            "export/load": _fig(load_s),
            "dcp/save/packed/stateful": _fig(dcp_s, items=10, bytes=dcp_bytes),
            "dcp/load/packed/stateful": _fig(dcp_load_s),
        }

    runs = [
        _run("8x64", "param", figs(0.5, 900, 0.2, 1.0, 1000, 0.8)),
        _run("24x128", "param", figs(3.0, 5000, 1.0, 2.0, 4000, 4.0)),
        _run("8x64", "layer", figs(0.25, 450, 0.1, 1.0, 500, 0.5)),
        _run("61x256", "param", {**figs(1.0, 1, 1.0, 1.0, 1, 1.0), "export/save": skipped, "export/load": skipped}),
    ]
    res = _results(runs)
    rows = information.export_info(res)
    assert rows == [r for r in information.compute_info(res) if r["name"].startswith(("export", "load_export"))]
    got = {(r["name"], r["where"]): r["value"] for r in rows}
    assert got == {
        (information.INFO_EXPORT_BYTES, "8x64, param"): pytest.approx(0.9),
        (information.INFO_EXPORT_BYTES, "24x128, param"): pytest.approx(1.25),
        (information.INFO_EXPORT_BYTES, "8x64, layer"): pytest.approx(0.9),
        (information.INFO_EXPORT_SAVE, "8x64, param"): pytest.approx(0.5),
        (information.INFO_EXPORT_SAVE, "24x128, param"): pytest.approx(1.5),
        (information.INFO_EXPORT_SAVE, "8x64, layer"): pytest.approx(0.25),
        (information.INFO_EXPORT_LOAD, "8x64, param"): pytest.approx(0.25),
        (information.INFO_EXPORT_LOAD, "24x128, param"): pytest.approx(0.25),
        (information.INFO_EXPORT_LOAD, "8x64, layer"): pytest.approx(0.2),
    }, "61x256: export skipped, no row"
    assert [r["where"] for r in rows[:3]] == ["8x64, param", "24x128, param", "8x64, layer"]
    detail = {(r["name"], r["where"]): r["detail"] for r in rows}
    assert detail[(information.INFO_EXPORT_BYTES, "24x128, param")] == "4.9 KiB vs 3.9 KiB"
    assert detail[(information.INFO_EXPORT_LOAD, "24x128, param")] == "1.00 s vs 4.00 s"
    md = "\n".join(report_markdown.info_markdown(rows))
    assert f"| {information.INFO_EXPORT_SAVE} | — | 1.50× | 24x128, param — 3.00 s vs 2.00 s |" in md

    none = information.export_info(_results([runs[3]]))
    assert [(r["name"], r["value"]) for r in none] == [(n, None) for n, *_ in information.EXPORT_INFO]
    assert all("export/" in r["reason"] and "not both measured" in r["reason"] for r in none)
