"""``bench.save_phases`` runs on a tiny fixture, times every phase once per call (never checks
times) and leaves the library as it found it."""

from __future__ import annotations

import pytest

from bench.studies import save_phases
from sparse_ckpt import _backend, _fqn
from sparse_ckpt._layouts import bucketed


def test_save_phases_times_each_phase_and_restores(capsys: pytest.CaptureFixture[str]) -> None:
    before = (_fqn.map_parameters, bucketed.collect, bucketed.fill, _backend.core)
    assert save_phases.main(["--fixture", "2x4:h8", "--runs", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"2x4:h8, {_backend.backend()} core, 3 runs")
    phases = {line.split()[0]: line for line in lines[1:]}
    assert set(phases) == {"total", "map_parameters", "flatten_packed_state", "encode_layout", "collect", "fill"}
    assert all(line.endswith("(3 calls)") for line in phases.values())
    assert (_fqn.map_parameters, bucketed.collect, bucketed.fill, _backend.core) == before
