"""What the default run's lost-item and damaged-file sweeps run (`_sampling.sample`): the same cases
every run, the first and the last, every kind at least once and a `_sampling.SAMPLE_RATE` share of
the rest; every case under ``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1``."""

from __future__ import annotations

import _backends
import _sampling
import pytest
from _sampling import SAMPLE_RATE, sample
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
