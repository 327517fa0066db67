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

import pytest
import torch

from bench import report
from bench import run as bench_run
from bench.fixtures import ADAMW_KWARGS, FixtureCache, Scale, build_adamw, group_specs, parse_scales, step_state
from bench.measure import plan_methods, planned_ids
from bench.run import main

STATUSES = {"ok", "skipped", "unavailable"}


@pytest.fixture(autouse=True)
def _once(core_backend: str) -> None:
    if core_backend == "cpp":
        pytest.skip("the bench measures both backends itself; running it once is enough")


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("bench"))
    code = main(["--quick", "--scales", "1x2,2x4", "--repeats", "1", "--budget", "0.5", "--out", out,
                 "--no-progress", "--dsd-max-params", "20", "--dcp-max-items", "200"])
    assert code == 0
    return out


def _load(out: str) -> dict:
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        return json.load(f)


def test_results_json_schema(bench_out: str) -> None:
    res = _load(bench_out)
    assert res["schema"] == "sparse_ckpt-bench/1"
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
            elif fig["family"] == "dcp" and fig["status"] == "skipped":
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
    assert rows and all(r["status"] in {report.INDICATIVE, report.NA} for r in rows)
    assert all(r["verdict"] in {report.PASS, report.MISS, report.NA} for r in rows)
    assert all((r["status"] == report.NA) == (r["verdict"] == report.NA) for r in rows)
    names = {r["target"] for r in rows}
    assert report.SAVE_COST.name in names and report.DCP_BYTES.name in names
    with open(os.path.join(bench_out, "results.md"), encoding="utf-8") as f:
        md = f.read()
    assert "## Targets" in md and "### 2x4, one group per param" in md
    assert "INDICATIVE ONLY (quick mode" in md and "| PASS |" not in md and "| MISS |" not in md
    assert "indicative: within" in md or "indicative: outside" in md
    assert md.count("| method | backend | format | median (min–max) | n | note |") == 4
    pngs = [os.path.join(bench_out, name) for name in report.FIGURE_NAMES]
    if importlib.util.find_spec("matplotlib") is not None:
        for png in pngs:
            with open(png, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    else:
        assert not any(os.path.exists(png) for png in pngs)


def test_method_ids_are_named_constants() -> None:
    """Every id the targets and plots divide is one the bench plans: renaming a method fails loudly."""
    ids = planned_ids()
    assert set(report.target_method_ids()) <= ids
    assert set(report.plot_method_ids()) <= ids
    report.check_method_ids()
    with pytest.raises(RuntimeError, match="core/encode/cpp"):
        report.check_method_ids(["core/encode/cpp"])
    assert set(report.CORE_TARGET_FUNCTIONS) <= set(report.CORE_FUNCTIONS)


def test_full_run_at_target_scale_gets_verdicts() -> None:
    """Only a non-quick run with 61x256 / param gets PASS/MISS; anything else is INDICATIVE."""

    def fig(t: float) -> dict:
        return {"status": "ok", "median_s": t, "min_s": t, "max_s": t, "n": 1}

    def results(scale: str, quick: bool) -> dict:
        figures = {report.FLOOR_STATE_DICT: fig(1.0), "sparse/save/cpp/packed": fig(3.0)}
        return {"machine": {"backends": {"cpp": "available", "python": "available"}},
                "config": {"layouts": ["param"], "scales": [scale], "quick": quick},
                "runs": [{"scale": scale, "layout": "param", "n_params": 10, "figures": figures}]}

    def save_row(res: dict) -> dict:
        return next(r for r in report.compute_targets(res) if r["target"] == report.SAVE_COST.name
                    and r["backend"] == "cpp")

    assert save_row(results("61x256", False))["status"] == report.MISS
    for scale, quick in (("61x256", True), ("8x64", False)):
        row = save_row(results(scale, quick))
        assert row["status"] == report.INDICATIVE and row["verdict"] == report.MISS
        assert report.indicative_banner(results(scale, quick))
    assert report.indicative_banner(results("61x256", False)) is None


def test_header_and_progress_lines(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """stdout starts with a header a person can read; a non-TTY stderr gets one line per figure, no \\r."""
    assert main(["--quick", "--scales", "1x2", "--layouts", "param", "--repeats", "1", "--budget", "0.2",
                 "--out", str(tmp_path), "--methods", "floor/"]) == 0
    out, err = capsys.readouterr()
    head = out.splitlines()[:12]
    assert head[0] == bench_run.RULE and head[1].startswith("sparse_ckpt bench: QUICK mode") and "INDICATIVE" in head[1]
    text = "\n".join(head)
    for key in ("command   python -m bench --quick --scales 1x2", "machine ", "torch 2.", "backends  python available",
                "device    cpu", "scales    1x2 (13 params)", f"output    {tmp_path}"):
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert bench_run.in_checkout() and bench_run.default_out() == os.path.join(root, "bench", "out")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cmd in ([sys.executable, "-m", "bench", "--help"], [sys.executable, "bench/run.py", "--help"],
                [sys.executable, "-m", "bench.resume", "--help"]):
        proc = subprocess.run(cmd, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (cmd, proc.stderr)
        assert proc.stdout.startswith("usage: "), cmd


def test_targets_compute_ratios() -> None:
    """The targets table divides the right medians and judges the thresholds."""

    def fig(t: float, **extra: object) -> dict:
        return {"status": "ok", "median_s": t, "min_s": t, "max_s": t, "n": 1, **extra}

    figures = {
        "floor/state_dict": fig(1.0),
        "floor/load_state_dict": fig(10.0),
        "sparse/save/cpp/packed": fig(1.5),
        "sparse/load/cpp/packed": fig(2.0),
        "sparse/save/python/packed": fig(3.0),
        "sparse/load/python/packed": fig(40.0),
        "dsd/set": fig(400.0),
        "core/pack_optimizer/python": fig(3.0),
        "core/pack_optimizer/cpp": fig(1.0),
        "dcp/save/packed/groups": fig(0.01, bytes=1000),
        "dcp/load/packed/groups": fig(0.01, bytes=0),
        "dcp/save/flat/groups": fig(0.5, bytes=10_000),
        "dcp/load/flat/groups": fig(0.4),
    }
    results = {
        "machine": {"backends": {"cpp": "available", "python": "available"}},
        "config": {"layouts": ["param"]},
        "runs": [{"scale": "61x256", "layout": "param", "n_params": 47275, "figures": figures}],
    }
    rows = {(r["target"], r["backend"]): r for r in report.compute_targets(results)}
    assert all(r["status"] == r["verdict"] for r in rows.values()), "a full run at 61x256 gets verdicts"
    save = rows[("sparse_state_dict / floor state_dict()", "cpp")]
    assert save["value"] == pytest.approx(1.5) and save["status"] == "PASS"
    assert rows[("sparse_state_dict / floor state_dict()", "python")]["status"] == "MISS"
    dsd = rows[("DSD set_optimizer_state_dict / load_sparse_state_dict", "cpp")]
    assert dsd["value"] == pytest.approx(200.0) and dsd["status"] == "PASS"
    assert rows[("DSD set_optimizer_state_dict / load_sparse_state_dict", "python")]["status"] == "MISS"
    assert rows[("load_sparse_state_dict / floor load_state_dict()", "python")]["status"] == "MISS"
    assert rows[("core.pack_optimizer: python / cpp", "cpp")]["status"] == "PASS"
    assert rows[("core.remap_to_fqns: python / cpp", "cpp")]["status"] == "N/A"
    dcp_t = rows[("DCP save+load of param groups: flat time / packed time", "—")]
    assert dcp_t["value"] == pytest.approx(45.0) and dcp_t["status"] == "MISS"
    dcp_b = rows[("DCP param groups: flat bytes / packed bytes", "—")]
    assert dcp_b["value"] == pytest.approx(10.0) and dcp_b["status"] == "MISS"
    results["machine"]["backends"]["cpp"] = "unavailable (not built)"
    figures["sparse/save/cpp/packed"] = {"status": "unavailable", "reason": "not built"}
    rows = {(r["target"], r["backend"]): r for r in report.compute_targets(results)}
    row = rows[("sparse_state_dict / floor state_dict()", "cpp")]
    assert row["status"] == "N/A" and "unavailable" in row["reason"]


def test_skipped_baseline_falls_back_to_largest_measured_scale() -> None:
    """A quadratic torch baseline skipped at the target scale is reported at the largest scale of
    each layout where it was measured, with the scale named; the target row itself stays N/A."""

    def fig(t: float) -> dict:
        return {"status": "ok", "median_s": t, "min_s": t, "max_s": t, "n": 1}

    skipped = {"status": "skipped", "reason": "47,275 groups > --dsd-set-max-groups 10,000"}
    results = {
        "machine": {"backends": {"cpp": "available", "python": "available"}},
        "config": {"layouts": ["param", "layer"]},
        "runs": [
            {"scale": "24x128", "layout": "param", "n_params": 9384,
             "figures": {"dsd/set": fig(30.0), "sparse/load/cpp/packed": fig(0.2)}},
            {"scale": "8x64", "layout": "param", "n_params": 1592,
             "figures": {"dsd/set": fig(1.0), "sparse/load/cpp/packed": fig(0.1)}},
            {"scale": "61x256", "layout": "layer", "n_params": 47275,
             "figures": {"dsd/set": fig(50.0), "sparse/load/cpp/packed": fig(1.0)}},
            {"scale": "61x256", "layout": "param", "n_params": 47275,
             "figures": {"dsd/set": skipped, "sparse/load/cpp/packed": fig(1.0)}},
        ],
    }
    rows = [r for r in report.compute_targets(results)
            if r["target"] == "DSD set_optimizer_state_dict / load_sparse_state_dict" and r["backend"] == "cpp"]
    assert [r["status"] for r in rows] == ["N/A", "PASS", "MISS"]
    assert "skipped" in rows[0]["reason"]
    assert rows[1]["value"] == pytest.approx(150.0) and rows[1]["where"].startswith("24x128, param (largest")
    assert rows[2]["value"] == pytest.approx(50.0) and rows[2]["where"].startswith("61x256, layer")


def test_dsd_set_max_groups_skips_only_the_set(tmp_path: os.PathLike) -> None:
    out = str(tmp_path)
    assert main(["--quick", "--scales", "1x2", "--layouts", "param", "--repeats", "1", "--budget", "0.5",
                 "--out", out, "--no-progress", "--methods", "dsd/", "--dsd-set-max-groups", "3"]) == 0
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
