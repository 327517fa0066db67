"""The in-memory save and load do each piece of work once per call, leaf or table, never once per
parameter (counts of the core's functions and of the table digests, never times; the timings are
bench/'s). A throw-away table encode, a second digest of a table or a per-parameter core call on
the hot path fails here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import moe_with_leaves, train

import sparse_ckpt as sc
from sparse_ckpt import _backend
from sparse_ckpt._format import keys

LEAVES = ("dense", "experts", "idle")
STEPPED = ("dense", "experts")
"""``idle`` never steps: it has a group table and no state, so no scalar table."""


class _Counting:
    """The active core, counting the calls of each of its functions."""

    def __init__(self, core: Any, calls: Counter[str]) -> None:
        self._core = core
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._core, name)
        if not callable(fn):
            return fn

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls[name] += 1
            return fn(*args, **kwargs)

        return counted


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Calls of the core's functions and of the table digest, from the fixture's set-up on."""
    counter: Counter[str] = Counter()
    monkeypatch.setattr(_backend, "core", _Counting(_backend.core, counter))
    digest = keys._seal_digest

    def counted_digest(*parts: Any) -> bytes:  # one table, whole or in parts
        counter["seal_digest"] += 1
        return digest(*parts)

    monkeypatch.setattr(keys, "_seal_digest", counted_digest)
    yield counter


def _trained() -> tuple[Any, sc.MultiOptimizer]:
    model, opt = moe_with_leaves(0)
    train(model, opt, only_experts=range(3))
    return model, opt


def test_a_packed_save_encodes_and_seals_each_table_once(calls: Counter[str]) -> None:
    model, opt = _trained()
    calls.clear()
    sd = sc.sparse_state_dict(model, opt)
    tables = len(LEAVES) + len(STEPPED)  # a group table per leaf, a scalar table per leaf with state
    assert sum(1 for k in sd if k.startswith((keys.PACKED_PREFIX, keys.SCALARS_PREFIX))) == tables
    assert calls["map_parameters"] == 1  # the model's FQN map once per call, not per leaf
    assert calls["capture_fqns"] == len(LEAVES)
    assert calls["flatten_packed_state"] == len(LEAVES)
    assert calls["encode_table"] == tables  # no throw-away table
    assert calls["seal_digest"] == tables


def test_a_load_decodes_and_checks_each_table_once(calls: Counter[str]) -> None:
    model, opt = _trained()
    sd = sc.sparse_state_dict(model, opt)
    target_model, target = moe_with_leaves(1)
    calls.clear()
    sc.load_sparse_state_dict(target_model, target, sd)
    tables = len(LEAVES) + len(STEPPED)
    assert calls["map_parameters"] == 1
    assert calls["unflatten"] == 1
    assert calls["decode_table"] == tables
    assert calls["seal_digest"] == tables
    assert calls["merge_scalars"] == 1  # every leaf's scalars in one pass
    assert calls["unlisted_keys"] == 1  # the complete-or-refused check once per load
    for per_leaf in ("fqns_of_groups", "match_groups", "build_groups", "cast_states"):
        assert calls[per_leaf] == len(LEAVES), per_leaf
