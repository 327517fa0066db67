"""Reliability of load: ``load_sparse_state_dict`` is transactional.

For every error class a load can raise (:class:`CheckpointMismatchError`,
:class:`CheckpointFormatError`; and any exception from a user hook or a custom
``load_state_dict`` in a later leaf), the target optimizers are exactly as before -- same
``state``/``param_groups`` objects, equal values -- and training continues bit for bit as if the
load had never been attempted. ``UnsupportedStateDictError`` and ``ReentrantSerializationError``
belong to capture (save) and cannot arise on load: loading takes no serialization guard and
calls the target's own ``load_state_dict`` when the class overrides it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import IdentitySnapshot, deep_equal, find_table_key, table_bytes
from table_bytes import encode
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt.keys import PACKED_PREFIX
from sparse_ckpt.save import packed_table_key


class Net(nn.Module):
    """Two layers and a parameter that never gets a gradient (so it never has state)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _train(model: Net, opt: Any, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=gen)).pow(2).sum().backward()
        opt.step()


def _groups(model: Net, lr_b: float = 0.003) -> list[dict]:
    return [
        {"params": [model.a.weight, model.a.bias, model.unused]},
        {"params": [model.b.weight, model.b.bias], "lr": lr_b},
    ]


def source(fmt: str = "packed") -> dict[str, Any]:
    """A saved sparse state dict of a stepped Adam (``unused`` has no state)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(_groups(model), lr=0.01)
    _train(model, opt, 2, seed=1)
    return sc.sparse_state_dict(model, opt, format=fmt)


def target(lr_b: float = 0.02) -> tuple[Net, torch.optim.Adam]:
    """A different model/optimizer that has its own state (stepped once, other settings)."""
    torch.manual_seed(7)
    model = Net()
    opt = torch.optim.Adam(_groups(model, lr_b), lr=0.05, betas=(0.8, 0.9))
    _train(model, opt, 1, seed=3)
    return model, opt


def _retable(sd: dict[str, Any], table: bytes, leaf: str = "optim") -> dict[str, Any]:
    """Replace the table with ``table`` under a key whose digest matches it (a forged table)."""
    out = {k: v for k, v in sd.items() if not (isinstance(k, str) and k.startswith(PACKED_PREFIX))}
    out[packed_table_key(leaf, table)] = table
    return out


# --------------------------------------------------------------------------- deep compare


# "Unchanged" is exact: key order included, NaN never equal, dicts required to be dicts (so is
# IdentitySnapshot with nan_equal="none").
SAME = {"nan_equal": "none", "mapping": dict}


def test_snapshot_detects_changes() -> None:
    """The deep compare is not a tautology."""
    sd = source()
    for mutate in (
        lambda m, o: o.param_groups[1].__setitem__("lr", 1.0),
        lambda m, o: next(iter(o.state.values()))["exp_avg"].mul_(2),
        lambda m, o: sc.load_sparse_state_dict(m, o, sd),
    ):
        model, opt = target()
        snap = IdentitySnapshot(model, [opt], nan_equal="none")
        mutate(model, opt)
        with pytest.raises(AssertionError):
            snap.assert_unchanged(model)


# --------------------------------------------------------------------------- scenarios


@dataclass
class Case:
    """A failing load: the model, the optimizer argument, the leaves to watch, the bad dict."""

    model: Net
    optimizer: Any
    leaves: list[torch.optim.Optimizer]
    state_dict: dict[str, Any]
    strict: bool = True


def _single(sd: dict[str, Any], **kw: Any) -> Case:
    model, opt = target()
    return Case(model, opt, [opt], sd, **kw)


def sc_missing_fqn() -> Case:
    sd = {k: v for k, v in source("flat").items() if not k.startswith("param_groups.b.bias.")}
    return _single(sd)


def sc_extra_fqn() -> Case:
    sd = source("flat")
    sd["param_groups.ghost.w.lr"] = 0.1
    return _single(sd)


def sc_state_for_unknown_fqn() -> Case:
    sd = source()
    sd["state.ghost.w.exp_avg"] = torch.zeros(3, 4)
    return _single(sd)


def sc_group_settings_conflict() -> Case:
    model, _ = target()
    opt = torch.optim.Adam([{"params": list(model.parameters())}], lr=0.05)
    _train(model, opt, 1, seed=3)
    return Case(model, opt, [opt], source())


def sc_tables_conflict() -> Case:
    sd = source()
    other = encode("optim", [({"lr": 9.0}, ["a.weight"])])
    sd[packed_table_key("optim", other)] = other
    return _single(sd)


def sc_leaf_missing_in_target() -> Case:
    torch.manual_seed(0)
    src = Net()
    multi = sc.MultiOptimizer(
        src,
        {
            "experts": torch.optim.Adam([src.a.weight, src.a.bias, src.unused], lr=0.01),
            "dense": torch.optim.Adam([src.b.weight, src.b.bias], lr=0.02),
        },
    )
    _train(src, multi, 1, seed=1)
    sd = sc.sparse_state_dict(src, multi)
    model, _ = target()
    opt = torch.optim.Adam([model.a.weight, model.a.bias, model.unused], lr=0.05)
    _train(model, opt, 1, seed=3)
    return Case(model, {"experts": opt}, [opt], sd)


def sc_empty_group_of_missing_leaf() -> Case:
    sd = source()
    table = encode("ghostleaf", [({"lr": 0.1}, [])])
    sd[packed_table_key("ghostleaf", table)] = table
    return _single(sd)


def sc_state_wrong_shape() -> Case:
    sd = source()
    sd["state.a.weight.exp_avg"] = torch.zeros(2, 2)
    return _single(sd)


def sc_state_wrong_dtype() -> Case:
    sd = source()
    sd["state.a.weight.exp_avg"] = torch.zeros(3, 4, dtype=torch.complex64)
    return _single(sd)


def sc_digest_mismatch() -> Case:
    sd = source()
    key = find_table_key(sd)
    table = bytearray(sd[key])
    table[-1] ^= 0x01
    sd[key] = bytes(table)
    return _single(sd)


def sc_truncated_table() -> Case:
    sd = source()
    return _single(_retable(sd, table_bytes(sd, find_table_key(sd))[:-3]))


def sc_wrong_version() -> Case:
    sd = source()
    table = bytearray(table_bytes(sd, find_table_key(sd)))
    table[4:6] = (99).to_bytes(2, "little")
    return _single(_retable(sd, bytes(table)))


def sc_not_bytes_under_packed_key() -> Case:
    sd = source()
    key = find_table_key(sd)
    sd[key] = torch.frombuffer(bytearray(sd[key]), dtype=torch.uint8)
    return _single(sd)


def sc_non_string_key() -> Case:
    sd = source()
    sd[3] = torch.zeros(1)
    return _single(sd)


def sc_packed_key_without_digest() -> Case:
    sd = source()
    sd["param_groups.__packed__.optim"] = sd.pop(find_table_key(sd))
    return _single(sd)


def sc_duplicate_fqn_in_table() -> Case:
    """One FQN in two groups with different settings (torch allows a parameter in two groups)."""
    sd = source()
    table = encode("optim", [({"lr": 0.01}, ["a.weight", "a.bias"]), ({"lr": 0.003}, ["b.weight", "a.weight"])])
    return _single(_retable(sd, table))


def sc_nested_state_collision() -> Case:
    sd = source()
    sd["state.a.weight.exp_avg.inner"] = torch.zeros(1)
    return _single(sd)


def sc_flat_value_unsupported() -> Case:
    sd = source("flat")
    sd["param_groups.a.weight.lr"] = object()
    return _single(sd)


def sc_format_error_not_strict() -> Case:
    case = sc_truncated_table()
    case.strict = False
    return case


class HookError(RuntimeError):
    """Raised on purpose by a user hook in these tests."""


def sc_pre_hook_breaks_group_count() -> Case:
    case = _single(source())
    case.leaves[0].register_load_state_dict_pre_hook(lambda o, sd: {**sd, "param_groups": sd["param_groups"][:1]})
    return case


def _multi_target() -> tuple[Net, sc.MultiOptimizer, torch.optim.Optimizer, torch.optim.Optimizer]:
    model, _ = target()
    experts = torch.optim.Adam([model.a.weight, model.a.bias, model.unused], lr=0.05)
    dense = torch.optim.SGD([model.b.weight, model.b.bias], lr=0.5, momentum=0.9)
    multi = sc.MultiOptimizer(model, {"experts": experts, "dense": dense})
    _train(model, multi, 1, seed=3)
    return model, multi, experts, dense


def _multi_source() -> dict[str, Any]:
    torch.manual_seed(0)
    src = Net()
    multi = sc.MultiOptimizer(
        src,
        {
            "experts": torch.optim.Adam([src.a.weight, src.a.bias, src.unused], lr=0.01),
            "dense": torch.optim.SGD([src.b.weight, src.b.bias], lr=0.1, momentum=0.5),
        },
    )
    _train(src, multi, 2, seed=1)
    return sc.sparse_state_dict(src, multi)


def sc_second_leaf_post_hook_raises() -> Case:
    model, multi, experts, dense = _multi_target()
    applied: list[str] = []
    experts.register_load_state_dict_post_hook(lambda o: applied.append("experts"))

    def boom(_o: Any) -> None:
        raise HookError("dense post-hook")

    dense.register_load_state_dict_post_hook(boom)
    return Case(model, multi, [experts, dense], _multi_source())


def sc_second_leaf_pre_hook_raises() -> Case:
    model, multi, experts, dense = _multi_target()

    def boom(_o: Any, _sd: dict) -> None:
        raise HookError("dense pre-hook")

    dense.register_load_state_dict_pre_hook(boom)
    return Case(model, multi, [experts, dense], _multi_source())


class StubbornSGD(torch.optim.SGD):
    """An optimizer whose own ``load_state_dict`` fails (sparse_ckpt calls it instead of its own path)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Fail like a broken override would."""
        raise HookError("custom load_state_dict")


def sc_second_leaf_custom_load_raises() -> Case:
    model, _ = target()
    experts = torch.optim.Adam([model.a.weight, model.a.bias, model.unused], lr=0.05)
    dense = StubbornSGD([model.b.weight, model.b.bias], lr=0.5, momentum=0.9)
    multi = sc.MultiOptimizer(model, {"experts": experts, "dense": dense})
    _train(model, multi, 1, seed=3)
    return Case(model, multi, [experts, dense], _multi_source())


SCENARIOS: list[tuple[Callable[[], Case], type[BaseException], list[str]]] = [
    (sc_missing_fqn, sc.CheckpointMismatchError, ["b.bias"]),
    (sc_extra_fqn, sc.CheckpointMismatchError, ["ghost.w"]),
    (sc_state_for_unknown_fqn, sc.CheckpointMismatchError, ["state.ghost.w.exp_avg"]),
    (sc_group_settings_conflict, sc.CheckpointMismatchError, ["group 0", "'lr'", "b.weight"]),
    (sc_tables_conflict, sc.CheckpointMismatchError, ["a.weight"]),
    (sc_leaf_missing_in_target, sc.CheckpointMismatchError, ["dense", "b.weight"]),
    (sc_empty_group_of_missing_leaf, sc.CheckpointMismatchError, ["ghostleaf"]),
    (sc_state_wrong_shape, sc.CheckpointMismatchError, ["a.weight", "exp_avg", "(2, 2)"]),
    (sc_state_wrong_dtype, sc.CheckpointMismatchError, ["a.weight", "exp_avg", "complex64"]),
    (sc_digest_mismatch, sc.CheckpointFormatError, ["'optim'", "digest"]),
    (sc_truncated_table, sc.CheckpointFormatError, ["'optim'", "truncated"]),
    (sc_wrong_version, sc.CheckpointFormatError, ["'optim'", "version 99"]),
    (sc_not_bytes_under_packed_key, sc.CheckpointFormatError, ["param_groups.__packed__.optim.", "Tensor"]),
    (sc_non_string_key, sc.CheckpointFormatError, ["3"]),
    (sc_packed_key_without_digest, sc.CheckpointFormatError, ["param_groups.__packed__.optim"]),
    (sc_duplicate_fqn_in_table, sc.CheckpointMismatchError, ["'optim'", "a.weight", "group 1"]),
    (sc_nested_state_collision, sc.CheckpointFormatError, ["a.weight", "exp_avg"]),
    (sc_flat_value_unsupported, sc.CheckpointFormatError, ["a.weight", "'lr'", "object"]),
    (sc_format_error_not_strict, sc.CheckpointFormatError, ["'optim'"]),
    (sc_pre_hook_breaks_group_count, sc.CheckpointMismatchError, ["'optim'", "groups"]),
    (sc_second_leaf_post_hook_raises, HookError, ["dense post-hook"]),
    (sc_second_leaf_pre_hook_raises, HookError, ["dense pre-hook"]),
    (sc_second_leaf_custom_load_raises, HookError, ["custom load_state_dict"]),
]


@pytest.mark.parametrize(("scenario", "error", "names"), SCENARIOS, ids=[s[0].__name__[3:] for s in SCENARIOS])
def test_failed_load_changes_nothing(scenario: Callable[[], Case], error: type[BaseException], names: list[str]) -> None:
    """The load raises ``error`` naming what is wrong; the target is as before and trains identically."""
    case = scenario()
    twin_model, twin_leaves = copy.deepcopy((case.model, case.leaves))
    snap = IdentitySnapshot(case.model, case.leaves, nan_equal="none")
    with pytest.raises(error) as info:
        sc.load_sparse_state_dict(case.model, case.optimizer, case.state_dict, strict=case.strict)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    snap.assert_unchanged(case.model)  # parameters, grads, state, groups: values and objects
    # the live job is not corrupted: the next step equals that of an untouched twin, bit for bit
    for model, leaves in ((case.model, case.leaves), (twin_model, twin_leaves)):
        for opt in leaves:
            opt.zero_grad()
        model(torch.ones(2, 4)).pow(2).sum().backward()
        for opt in leaves:
            opt.step()
    for p, q in zip(case.model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    for opt, twin in zip(case.leaves, twin_leaves):
        assert deep_equal(opt.state_dict(), twin.state_dict(), **SAME)


def test_valid_load_after_failed_load() -> None:
    """After a rejected checkpoint the same target still loads a good one exactly."""
    model, opt = target()
    with pytest.raises(sc.CheckpointFormatError):
        sc.load_sparse_state_dict(model, opt, sc_truncated_table().state_dict)
    sd = source()
    sc.load_sparse_state_dict(model, opt, sd)
    assert deep_equal(sc.sparse_state_dict(model, opt), sd, **SAME)
