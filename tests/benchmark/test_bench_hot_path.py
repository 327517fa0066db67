"""``bench.hot_path`` runs on a tiny fixture: the alternated rounds give a sample per method and round
and per-round ratios, and ``--checks`` times every phase it names (each name still exists in the
library) and leaves the library as it found it (never checks times)."""

from __future__ import annotations

import argparse
import importlib

import _backends
import pytest

from bench.studies import hot_path
from sparse_ckpt import _backend

core_backend = _backends.run_once
"""The bench is not a backend test: running it once is enough."""


def test_alternated_rounds_sample_every_method(capsys: pytest.CaptureFixture[str]) -> None:
    hot_path.main(["--scale", "2x4", "--rounds", "3"])
    out = capsys.readouterr().out
    for kind in ("wall", "cpu"):
        for method in hot_path.METHODS:
            assert f"{kind:4} {method:5}: median" in out and "n=3)" in out
        assert f"median per-round ratio ({kind}): save " in out


def test_deepseek_names_fixture_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``--names deepseek --state-init step``: the same calls on DeepSeek-V3's deeper module names."""
    hot_path.main(["--scale", "2x4", "--rounds", "2", "--names", "deepseek", "--state-init", "step"])
    assert "median per-round ratio (cpu): save " in capsys.readouterr().out
    fx = hot_path._fixture(argparse.Namespace(scale="2x4", layout="param", seed=0, names="deepseek", state_init="step"))
    names = [n for n, _p in fx.model.named_parameters()]
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
    assert (
        "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.post_attention_layernorm.weight" in names
    )
    bench = hot_path._fixture(argparse.Namespace(scale="2x4", layout="param", seed=0))
    assert [p.shape for p in fx.model.parameters()] == [p.shape for p in bench.model.parameters()]
    assert fx.info["n_stateful"] == bench.info["n_stateful"] and fx.info["n_groups"] == bench.info["n_groups"]
    assert all(a.count(".") == b.count(".") + 1 for a, (b, _p) in zip(names, bench.model.named_parameters()))


def test_checks_time_every_named_phase_and_restore() -> None:
    """Every ``module:function`` of ``PHASES`` exists (a renamed check fails here) and runs at least once
    per save or load; the patched functions and the core are put back."""
    names = [n for phase in hot_path.PHASES.values() for n in phase if not n.startswith("core:")]
    before = {n: getattr(importlib.import_module(n.split(":")[0]), n.split(":")[1]) for n in names}
    core = _backend.core
    fx = hot_path._fixture(argparse.Namespace(scale="2x4", layout="param", seed=0))
    res = hot_path.checks(fx, 2)
    for method, phases in hot_path.PHASES.items():
        assert len(res[method][method]) == 2
        ran = [n for n in phases if res[method][n]]
        # the ~lens record and the list check run only for list-valued state; the rest on every call
        assert set(phases) - set(ran) <= {"sparse_ckpt._load.decode_state:check_lists"}
    assert _backend.core is core
    assert {n: getattr(importlib.import_module(n.split(":")[0]), n.split(":")[1]) for n in names} == before
