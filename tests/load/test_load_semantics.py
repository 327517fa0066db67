"""Load semantics of ``load_sparse_state_dict``: what is restored, what is not,
how tensors are cast, how load hooks run, and that applying is O(P) (structurally, by counting).

Every test runs once per core backend (``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_deep_equal, fqn_view
from torch import nn

import sparse_ckpt as sc

FORMATS = ("packed", "flat")
KINDS = ("single", "multi", "mapping")


# --------------------------------------------------------------------------- builders


class _Net(nn.Module):
    """``n`` tiny linear layers; FQNs ``layers.{i}.weight`` / ``layers.{i}.bias``; deterministic init."""

    def __init__(self, n: int = 4, dim: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, dtype=dtype) for _ in range(n))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(dtype))


def _layer(model: _Net, i: int) -> list[nn.Parameter]:
    return list(model.layers[i].parameters())


def _set_grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)


def _build(kind: str, model: _Net, lr: float = 0.01) -> Any:
    """Layer 0 and 2 step; layer 1 never steps (its lr is moved to 0.0025); layer 3 never gets a grad.

    ``single``: one AdamW with groups [L0], [L1], [L2, L3]. ``multi``/``mapping``: leaves
    ``experts`` (AdamW: [L0], [L2, L3]) and ``idle`` (AdamW: [L1]), a MultiOptimizer or a dict.
    """
    if kind == "single":
        return torch.optim.AdamW(
            [
                {"params": _layer(model, 0)},
                {"params": _layer(model, 1)},
                {"params": _layer(model, 2) + _layer(model, 3)},
            ],
            lr=lr,
        )
    leaves = {
        "experts": torch.optim.AdamW(
            [{"params": _layer(model, 0)}, {"params": _layer(model, 2) + _layer(model, 3), "weight_decay": 0.5}], lr=lr
        ),
        "idle": torch.optim.AdamW(_layer(model, 1), lr=lr),
    }
    return sc.MultiOptimizer(model, leaves) if kind == "multi" else leaves


def _leaves(opt: Any) -> list[torch.optim.Optimizer]:
    if isinstance(opt, torch.optim.Optimizer):
        return [opt]
    if isinstance(opt, sc.MultiOptimizer):
        return [o for _, o in opt.leaves()]
    return list(opt.values())


def _idle_group(kind: str, opt: Any) -> dict:
    return opt.param_groups[1] if kind == "single" else opt["idle"].param_groups[0]


def _train(model: _Net, opt: Any, kind: str, steps: int = 2) -> None:
    for s in range(steps):
        for p in model.parameters():
            p.grad = None
        _set_grads(_layer(model, 0) + _layer(model, 2), seed=100 + s)
        for leaf in _leaves(opt):
            leaf.step()
    _idle_group(kind, opt)["lr"] = 0.0025  # what a scheduler did to the leaf that never stepped


# --------------------------------------------------------------------------- deep compare


# Exact comparison (dicts: keys and key order; sequences; tensors: dtype/device/shape/values), with
# NaN never equal and dicts required to be dicts.
SAME = {"nan_equal": "none", "mapping": dict}


def _assert_leaf_equal(ma: nn.Module, a: torch.optim.Optimizer, mb: nn.Module, b: torch.optim.Optimizer) -> None:
    sa, ga = fqn_view(ma, [a], groups=True)
    sb, gb = fqn_view(mb, [b], groups=True)
    assert sorted(sa) == sorted(sb)
    for fqn in sa:
        assert_deep_equal(sa[fqn], sb[fqn], f"state[{fqn!r}]", **SAME)
    assert_deep_equal(ga, gb, "param_groups", **SAME)


# --------------------------------------------------------------------------- what is restored


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_restores_saved_state_and_settings_only(kind: str, fmt: str) -> None:
    src_model = _Net()
    src = _build(kind, src_model)
    _train(src_model, src, kind)
    sd = sc.sparse_state_dict(src_model, src, format=fmt)

    dst_model = _Net(seed=1)
    dst = _build(kind, dst_model, lr=0.5)
    grad = torch.full_like(dst_model.layers[3].weight, 7.0)
    dst_model.layers[3].weight.grad = grad
    sc.load_sparse_state_dict(dst_model, dst, sd)

    # torch's own load of the same leaves, for reference
    ref_model = _Net(seed=1)
    ref = _build(kind, ref_model, lr=0.5)
    for s_leaf, r_leaf in zip(_leaves(src), _leaves(ref)):
        r_leaf.load_state_dict(s_leaf.state_dict())

    for s_leaf, d_leaf, r_leaf in zip(_leaves(src), _leaves(dst), _leaves(ref)):
        _assert_leaf_equal(src_model, s_leaf, dst_model, d_leaf)
        _assert_leaf_equal(ref_model, r_leaf, dst_model, d_leaf)

    # the motivating case: the leaf/group that never stepped keeps its moved lr and gets no state
    assert _idle_group(kind, dst)["lr"] == 0.0025
    stateless = _layer(dst_model, 1) + _layer(dst_model, 3)
    for leaf in _leaves(dst):
        for p in stateless:
            assert p not in leaf.state  # no {} entry, no synthetic step
    for p in _layer(dst_model, 0) + _layer(dst_model, 2):
        assert any(p in leaf.state for leaf in _leaves(dst))
    # .grad untouched: same object, same values; None stays None
    assert dst_model.layers[3].weight.grad is grad and torch.equal(grad, torch.full_like(grad, 7.0))
    assert all(p.grad is None for p in _layer(dst_model, 0) + _layer(dst_model, 1) + _layer(dst_model, 2))
    # parameters are not touched by an optimizer load
    assert torch.equal(dst_model.layers[0].weight, _Net(seed=1).layers[0].weight)


@pytest.mark.parametrize("fmt", FORMATS)
def test_existing_state_without_saved_state_is_dropped(fmt: str) -> None:
    """As torch: load replaces ``state`` wholesale, so a param with state but none saved ends with none."""
    src_model, dst_model = _Net(), _Net()
    src, dst = _build("single", src_model), _build("single", dst_model)
    _train(src_model, src, "single")
    _set_grads(list(dst_model.parameters()), seed=5)
    dst.step()  # every dst param has state now, with different values
    before = {p: dict(s) for p, s in dst.state.items()}
    sc.load_sparse_state_dict(dst_model, dst, sc.sparse_state_dict(src_model, src, format=fmt))
    for p in _layer(dst_model, 1) + _layer(dst_model, 3):
        assert p not in dst.state
    _assert_leaf_equal(src_model, src, dst_model, dst)
    for p in _layer(dst_model, 0):  # new tensors, not the old state updated in place
        assert not torch.equal(dst.state[p]["exp_avg"], before[p]["exp_avg"])


def test_multioptimizer_load_state_dict_method_and_strict_flag() -> None:
    src_model, dst_model = _Net(), _Net()
    src, dst = _build("multi", src_model), _build("multi", dst_model)
    _train(src_model, src, "multi")
    dst.load_state_dict(src.state_dict())
    for a, b in zip(_leaves(src), _leaves(dst)):
        _assert_leaf_equal(src_model, a, dst_model, b)
    sd = src.state_dict()
    sd["state.layers.9.weight.exp_avg"] = torch.zeros(1)
    with pytest.raises(sc.CheckpointMismatchError):
        dst.load_state_dict(sd)
    dst.load_state_dict(sd, strict=False)


def test_leaf_that_never_stepped_restores_settings_only() -> None:
    src_model, dst_model = _Net(), _Net()
    src = {"a": torch.optim.SGD(_layer(src_model, 0), lr=0.01, momentum=0.9)}
    src["a"].param_groups[0]["lr"] = 0.0025
    sd = sc.sparse_state_dict(src_model, src)
    assert not any(k.startswith("state.") for k in sd)
    dst = {"a": torch.optim.SGD(_layer(dst_model, 0), lr=0.01, momentum=0.5)}
    sc.load_sparse_state_dict(dst_model, dst, sd, strict=False)
    assert dst["a"].param_groups[0]["lr"] == 0.0025 and dst["a"].param_groups[0]["momentum"] == 0.9
    assert len(dst["a"].state) == 0


# --------------------------------------------------------------------------- cast policy


def _adamw_pair(dtype_dst: torch.dtype, **dst_kw: Any) -> tuple[_Net, torch.optim.Optimizer, _Net, Callable[..., Any]]:
    src_model = _Net(n=2)
    src = torch.optim.AdamW([{"params": _layer(src_model, 0)}, {"params": _layer(src_model, 1)}], lr=0.01)
    _set_grads(list(src_model.parameters()), seed=3)
    src.step()

    def make_dst(model: _Net) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": _layer(model, 0), **dst_kw}, {"params": _layer(model, 1)}], lr=0.01)

    return src_model, src, _Net(n=2, dtype=dtype_dst), make_dst


@pytest.mark.parametrize("fmt", FORMATS)
def test_floating_state_follows_param_dtype_step_does_not(fmt: str) -> None:
    src_model, src, dst_model, make_dst = _adamw_pair(torch.float64)
    for s in src.state.values():
        s["step"] = s["step"].to(torch.float64)  # so a cast of `step` would show
    dst = make_dst(dst_model)
    sc.load_sparse_state_dict(dst_model, dst, sc.sparse_state_dict(src_model, src, format=fmt))
    ref_model = _Net(n=2, dtype=torch.float64)
    ref = make_dst(ref_model)
    ref.load_state_dict(src.state_dict())
    _assert_leaf_equal(ref_model, ref, dst_model, dst)
    for p in dst_model.parameters():
        assert dst.state[p]["exp_avg"].dtype == torch.float64
        assert dst.state[p]["exp_avg_sq"].dtype == torch.float64
        assert dst.state[p]["step"].dtype == torch.float64  # untouched: not fused, not capturable


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_step_becomes_float32_in_fused_or_capturable_groups(fmt: str, flag: str) -> None:
    src_model, src, dst_model, make_dst = _adamw_pair(torch.float32, **{flag: True})
    for s in src.state.values():
        s["step"] = s["step"].to(torch.float64)
    dst = make_dst(dst_model)
    sd = sc.sparse_state_dict(src_model, src, format=fmt)
    # the saved settings say fused/capturable False; make the checkpoint agree with the target
    # group 0 (the cast looks at the *loaded* group's flags, as in torch)
    dst.register_load_state_dict_pre_hook(lambda opt, d: d["param_groups"][0].__setitem__(flag, True))
    sc.load_sparse_state_dict(dst_model, dst, sd)
    ref_model = _Net(n=2)
    ref = make_dst(ref_model)
    ref.register_load_state_dict_pre_hook(lambda opt, d: d["param_groups"][0].__setitem__(flag, True))
    ref.load_state_dict(src.state_dict())
    _assert_leaf_equal(ref_model, ref, dst_model, dst)
    for p in _layer(dst_model, 0):
        assert dst.state[p]["step"].dtype == torch.float32
    for p in _layer(dst_model, 1):
        assert dst.state[p]["step"].dtype == torch.float64


class _NestedStateSGD(torch.optim.SGD):
    """SGD that also keeps nested state, a python int and a string, to exercise nested casting."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Plain SGD step plus some nested bookkeeping state."""
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                inner = st.setdefault(
                    "extra", {"ema": torch.zeros_like(p), "step": torch.zeros((), dtype=torch.float64)}
                )
                inner["ema"].add_(p.grad)
                inner["step"] += 1
                st["count"] = st.get("count", 0) + 1
                st["tag"] = "ok"
        return loss


@pytest.mark.parametrize("fmt", FORMATS)
def test_nested_state_round_trips_and_casts_like_torch(fmt: str) -> None:
    src_model = _Net(n=2)
    src = _NestedStateSGD(src_model.parameters(), lr=0.1, momentum=0.9)
    _set_grads(_layer(src_model, 0), seed=1)
    src.step()
    sd = sc.sparse_state_dict(src_model, src, format=fmt)
    assert "state.layers.0.weight.extra.ema" in sd
    dst_model = _Net(n=2, dtype=torch.float64)
    dst = _NestedStateSGD(dst_model.parameters(), lr=0.1, momentum=0.9)
    sc.load_sparse_state_dict(dst_model, dst, sd)
    for p in _layer(dst_model, 0):
        st = dst.state[p]
        assert st["extra"]["ema"].dtype == torch.float64  # floating, nested: follows the param
        assert st["extra"]["step"].dtype == torch.float64  # nested "step": left alone
        assert st["momentum_buffer"].dtype == torch.float64
        assert st["count"] == 1 and st["tag"] == "ok"  # torch would turn "ok" into a generator repr
    for p in _layer(dst_model, 1):
        assert p not in dst.state


# --------------------------------------------------------------------------- hooks


def _stepped_pair(make: Callable[[nn.Module], torch.optim.Optimizer]) -> tuple[_Net, torch.optim.Optimizer]:
    model = _Net()
    opt = make(model)
    _set_grads(_layer(model, 2) + _layer(model, 0), seed=9)  # layer 2 first: state order != id order
    opt.step()
    return model, opt


def _groups4(model: nn.Module, lr: float = 0.01) -> torch.optim.Optimizer:
    m: Any = model
    return torch.optim.AdamW(
        [{"params": _layer(m, 0) + _layer(m, 1)}, {"params": _layer(m, 2), "lr": 0.2}, {"params": _layer(m, 3)}], lr=lr
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_pre_hook_sees_torch_format_packed_dict(fmt: str) -> None:
    src_model, src = _stepped_pair(_groups4)
    sd = sc.sparse_state_dict(src_model, src, format=fmt)
    seen: list[dict] = []
    ref_seen: list[dict] = []

    def record(into: list[dict]) -> Callable[..., None]:
        def hook(opt: torch.optim.Optimizer, d: dict) -> None:
            into.append(
                {"keys": list(d), "state": dict(d["state"]), "param_groups": [dict(g) for g in d["param_groups"]]}
            )

        return hook

    dst_model = _Net()
    dst = _groups4(dst_model, lr=0.7)
    dst.register_load_state_dict_pre_hook(record(seen))
    sc.load_sparse_state_dict(dst_model, dst, sd)
    ref = _groups4(_Net(), lr=0.7)
    ref.register_load_state_dict_pre_hook(record(ref_seen))
    ref.load_state_dict(src.state_dict())

    assert len(seen) == 1 and len(ref_seen) == 1
    got, want = seen[0], ref_seen[0]
    assert sorted(got["keys"]) == ["param_groups", "state"]
    assert all(type(k) is int for k in got["state"])
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1, 4, 5]
    for k in want["state"]:
        assert_deep_equal(got["state"][k], want["state"][k], f"state[{k}]", **SAME)
    assert_deep_equal(got["param_groups"], want["param_groups"], "param_groups", **SAME)
    assert [g["params"] for g in got["param_groups"]] == [[0, 1, 2, 3], [4, 5], [6, 7]]


def test_pre_hook_result_replaces_the_dict() -> None:
    src_model, src = _stepped_pair(_groups4)
    sd = sc.sparse_state_dict(src_model, src)

    def hook(opt: torch.optim.Optimizer, d: dict) -> dict:
        new = {
            "state": {k: v for k, v in d["state"].items() if k != 0},
            "param_groups": [dict(g) for g in d["param_groups"]],
        }
        new["param_groups"][2]["lr"] = 0.123
        return new

    dst_model = _Net()
    dst = _groups4(dst_model)
    dst.register_load_state_dict_pre_hook(hook)
    sc.load_sparse_state_dict(dst_model, dst, sd)
    assert dst.param_groups[2]["lr"] == 0.123
    assert dst_model.layers[0].weight not in dst.state  # id 0 dropped by the hook
    assert dst_model.layers[0].bias in dst.state


def test_pre_hook_mutating_in_place_takes_effect() -> None:
    src_model, src = _stepped_pair(_groups4)
    dst_model = _Net()
    dst = _groups4(dst_model)
    dst.register_load_state_dict_pre_hook(lambda opt, d: d["param_groups"][1].__setitem__("lr", 0.5))
    sc.load_sparse_state_dict(dst_model, dst, sc.sparse_state_dict(src_model, src))
    assert dst.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_post_hooks_run_once_after_the_state_is_in_place(kind: str) -> None:
    src_model = _Net()
    src = _build(kind, src_model)
    _train(src_model, src, kind)
    dst_model = _Net()
    dst = _build(kind, dst_model)
    events: list[tuple[str, int, Any]] = []
    for i, leaf in enumerate(_leaves(dst)):
        leaf.register_load_state_dict_pre_hook(lambda opt, d, i=i: events.append(("pre", i, len(opt.state))))
        leaf.register_load_state_dict_post_hook(
            lambda opt, i=i: events.append(("post", i, (len(opt.state), [g["lr"] for g in opt.param_groups])))
        )
    sc.load_sparse_state_dict(dst_model, dst, sc.sparse_state_dict(src_model, src))
    n = len(_leaves(dst))
    assert sorted(e[:2] for e in events) == sorted([("pre", i) for i in range(n)] + [("post", i) for i in range(n)])
    for i, leaf in enumerate(_leaves(dst)):
        pre = next(e for e in events if e[:2] == ("pre", i))
        post = next(e for e in events if e[:2] == ("post", i))
        assert events.index(pre) < events.index(post)
        assert pre[2] == 0  # pre-hooks run before anything is applied
        assert post[2] == (len(leaf.state), [g["lr"] for g in leaf.param_groups])
    # every pre-hook runs before any post-hook: a failing later leaf cannot follow a post-hook
    assert max(i for i, e in enumerate(events) if e[0] == "pre") < min(
        i for i, e in enumerate(events) if e[0] == "post"
    )


class _OwnLoad(torch.optim.AdamW):
    """Overrides ``load_state_dict``: sparse_ckpt must call it with the packed dict."""

    calls: list[dict]

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        """Record the dict, then load it the torch way."""
        self.calls.append(state_dict)
        super().load_state_dict(state_dict)


@pytest.mark.parametrize("fmt", FORMATS)
def test_class_overriding_load_state_dict_gets_called(fmt: str) -> None:
    src_model, src = _stepped_pair(_groups4)
    dst_model = _Net()
    dst = _OwnLoad(_groups4(dst_model).param_groups, lr=0.3)
    dst.calls = []
    post: list[int] = []
    dst.register_load_state_dict_post_hook(lambda opt: post.append(1))
    sc.load_sparse_state_dict(dst_model, {"own": dst}, sc.sparse_state_dict(src_model, {"own": src}, format=fmt))
    assert len(dst.calls) == 1 and post == [1]
    packed = dst.calls[0]
    assert sorted(packed) == ["param_groups", "state"] and sorted(packed["state"]) == [0, 1, 4, 5]
    _assert_leaf_equal(src_model, src, dst_model, dst)


def test_instance_patched_load_state_dict_gets_called() -> None:
    src_model, src = _stepped_pair(_groups4)
    dst_model = _Net()
    dst = _groups4(dst_model)
    calls: list[dict] = []
    original = dst.load_state_dict

    def patched(state_dict: dict) -> None:
        calls.append(state_dict)
        original(state_dict)

    dst.load_state_dict = patched  # type: ignore[method-assign]
    sc.load_sparse_state_dict(dst_model, dst, sc.sparse_state_dict(src_model, src))
    assert len(calls) == 1
    _assert_leaf_equal(src_model, src, dst_model, dst)


# --------------------------------------------------------------------------- O(P), structurally


class _CountingList(list):
    """A ``params`` list that counts membership tests and iterations."""

    contains = 0
    iters = 0

    def __contains__(self, item: object) -> bool:
        _CountingList.contains += 1
        return super().__contains__(item)

    def __iter__(self) -> Any:
        _CountingList.iters += 1
        return super().__iter__()


def _one_group_per_param(model: nn.ParameterList, stepped: bool = True) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW([{"params": [p]} for p in model], lr=0.01, fused=True)
    if stepped:
        for p in model:
            p.grad = torch.ones_like(p)
        opt.step()
        for p in model:
            p.grad = None
    return opt


def _count_apply(load: Callable[[], None], opt: torch.optim.Optimizer) -> tuple[int, int]:
    def to_counting(o: torch.optim.Optimizer, d: dict) -> dict:
        d = dict(d)
        d["param_groups"] = [{**g, "params": _CountingList(g["params"])} for g in d["param_groups"]]
        return d

    handle = opt.register_load_state_dict_pre_hook(to_counting)
    _CountingList.contains = _CountingList.iters = 0
    try:
        load()
    finally:
        handle.remove()
    return _CountingList.contains, _CountingList.iters


def test_apply_is_linear_in_parameters_not_params_times_groups() -> None:
    """No per-parameter scan over groups: membership tests on ``params`` lists never happen and
    each group's list is iterated a constant number of times. torch's own load (checked here as a
    control, so the probe can fail) tests membership O(P x groups) times."""
    n = 300
    model = nn.ParameterList(nn.Parameter(torch.full((2,), float(i))) for i in range(n))
    src = _one_group_per_param(model)
    sd = sc.sparse_state_dict(model, src)
    dst = _one_group_per_param(model, stepped=False)
    contains, iters = _count_apply(lambda: sc.load_sparse_state_dict(model, dst, sd), dst)
    assert contains == 0
    assert iters <= 4 * n
    assert len(dst.state) == n
    ref = _one_group_per_param(model, stepped=False)
    torch_contains, _ = _count_apply(lambda: ref.load_state_dict(src.state_dict()), ref)
    assert torch_contains >= n * (n - 1) // 2  # the control: torch's scan is quadratic here


def test_apply_never_uses_torchs_per_param_group_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("O(P x groups) torch helper called")

    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(forbidden))
    model = nn.ParameterList(nn.Parameter(torch.full((2,), float(i))) for i in range(20))
    src = _one_group_per_param(model)
    dst = _one_group_per_param(model, stepped=False)
    for s in src.state.values():
        s["step"] = s["step"].double()
    sc.load_sparse_state_dict(model, dst, sc.sparse_state_dict(model, src))
    assert all(s["step"].dtype == torch.float32 for s in dst.state.values())
    with pytest.raises(AssertionError, match="O\\(P x groups\\)"):  # the patch is live
        dst.load_state_dict(src.state_dict())


# --------------------------------------------------------------------------- groups without parameters


def test_packed_empty_group_is_matched_by_leaf_and_index() -> None:
    src_model = _Net(n=2)
    src = torch.optim.SGD(
        [{"params": _layer(src_model, 0)}, {"params": [], "lr": 0.3}, {"params": _layer(src_model, 1)}], lr=0.1
    )
    sd = sc.sparse_state_dict(src_model, src)
    model = _Net(n=2)
    opt = torch.optim.SGD([{"params": _layer(model, 0)}, {"params": []}, {"params": _layer(model, 1)}], lr=0.9)
    sc.load_sparse_state_dict(model, opt, sd)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3, 0.1]
    ref = torch.optim.SGD([{"params": _layer(model, 0)}, {"params": []}, {"params": _layer(model, 1)}], lr=0.9)
    ref.load_state_dict(src.state_dict())
    assert_deep_equal(
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        [{k: v for k, v in g.items() if k != "params"} for g in ref.param_groups],
        **SAME,
    )

    # an empty target group at an index where the checkpoint has none: strict error, else kept
    other = torch.optim.SGD(
        [{"params": _layer(model, 0)}, {"params": _layer(model, 1)}, {"params": [], "lr": 0.7}], lr=0.9
    )
    with pytest.raises(sc.CheckpointMismatchError, match="leaf 'optim' group 2: the target group has no parameters"):
        sc.load_sparse_state_dict(model, other, sd)
    sc.load_sparse_state_dict(model, other, sd, strict=False)
    assert [g["lr"] for g in other.param_groups] == [0.1, 0.1, 0.7]


def test_flat_format_keeps_an_empty_groups_current_settings() -> None:
    """Flat format cannot express groups without parameters (documented); they keep their settings."""
    src_model = _Net(n=1)
    src = torch.optim.SGD([{"params": _layer(src_model, 0)}, {"params": [], "lr": 0.3}], lr=0.1)
    sd = sc.sparse_state_dict(src_model, src, format="flat")
    opt = torch.optim.SGD([{"params": _layer(src_model, 0)}, {"params": [], "lr": 0.8}], lr=0.9)
    sc.load_sparse_state_dict(src_model, opt, sd)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.8]
