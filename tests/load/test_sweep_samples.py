"""What the default run's lost-item and damaged-file sweeps (and save/test_packed_v2.py's optimizer
sweep) run (`_sampling.sample`): the same cases every run, the first and the last, every kind at
least once and a `_sampling.SAMPLE_RATE` share of the rest; every case under
``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1``."""

from __future__ import annotations

import _backends
import _sampling
import pytest
from _sampling import SAMPLE_RATE, params, sample
from lost_item_sweep import item_kind
from test_damaged_files import _pick

core_backend = _backends.run_once

CASES = [f"{kind}{i}" for kind in ("a", "b", "c") for i in range(40)] + ["lone"]


def _kind(case: str) -> str:
    return case.rstrip("0123456789")


def test_the_sample_is_seeded_and_keeps_the_ends_and_every_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sampling, "EXHAUSTIVE", False)
    picked = sample(CASES, "x", _kind)
    assert picked == sample(CASES, "x", _kind) and picked != sample(CASES, "y", _kind)
    assert picked == [c for c in CASES if c in picked]  # in their order, each once
    assert picked[0] == CASES[0] and picked[-1] == CASES[-1]
    assert {_kind(c) for c in picked} == {"a", "b", "lone", "c"}  # "lone", the only one of its kind, too
    kept = {CASES[0], CASES[-1]} | {next(c for c in CASES if _kind(c) == k) for k in "abc"}
    assert len(picked) == len(kept) + round((len(CASES) - len(kept)) * SAMPLE_RATE)
    assert sample(CASES[:2], "x", _kind) == CASES[:2]


def test_the_exhaustive_run_keeps_every_case(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sampling, "EXHAUSTIVE", True)
    assert sample(CASES, "x", _kind) == CASES


@pytest.mark.parametrize(
    ("item", "kind"),
    [
        ("optim.state.a.weight.exp_avg", ("state", "exp_avg")),
        (("state", "a.weight", "step"), ("state", "step")),
        ("state.b.weight.exp_avg_sq", ("state", "exp_avg_sq")),
        ("optim.param_groups.a.weight.lr", "param_groups"),
        (("param_groups", 1, "initial_lr"), "param_groups"),
        ("optim.__sparse_ckpt__.keys.d89f", "__sparse_ckpt__.keys.d89f"),
    ],
)
def test_a_lost_items_kind_is_its_state_name_or_settings_or_itself(
    item: str | tuple[object, ...], kind: object
) -> None:
    assert item_kind(item) == kind


def test_the_damage_sample_keeps_every_kind_of_damage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sampling, "EXHAUSTIVE", False)
    cases = [("delete f", None)] + [(f"{d} f@{i}", None) for i in range(30) for d in ("zero", "truncate")]
    cases += [(f"record k{i}", None) for i in range(5)]
    picked = _pick(cases, "s")
    assert {what.split(" ")[0] for what, _ in picked} == {"delete", "zero", "truncate", "record"}
    assert len(picked) < len(cases) / 3


@pytest.mark.parametrize("exhaustive", [False, True])
def test_params_collect_every_case_and_skip_what_the_sample_leaves_out(
    monkeypatch: pytest.MonkeyPatch, exhaustive: bool
) -> None:
    """`_sampling.params` (the optimizer sweep of save/test_packed_v2.py): the same cases collected in
    every run, those `sample` leaves out skipped, none under the variable."""
    monkeypatch.setattr(_sampling, "EXHAUSTIVE", exhaustive)
    cases = [(c, _kind(c)) for c in CASES]
    values = params(cases, "x", lambda case: case[1])
    run = [v for v in values if type(v) is tuple]  # a skipped one is a ParameterSet (a named tuple)
    skipped = [v for v in values if type(v) is not tuple]
    assert run == sample(cases, "x", lambda case: case[1]) and len(values) == len(cases)
    assert all(v.marks[0].name == "skip" and v.values in cases for v in skipped)
    assert not skipped if exhaustive else len(skipped) == len(cases) - len(run) > 0
