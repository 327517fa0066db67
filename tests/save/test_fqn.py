"""Canonical FQNs: wrapper prefixes, tied parameters, one FQN map per call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import free_port
from helpers import assert_deep_equal, clone_value, count_calls, decoded_settings, flat_settings, make_moe
from scalar_tables import v1_state_keys
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import sparse_ckpt as sc
import sparse_ckpt._save.save
from sparse_ckpt import _backend
from sparse_ckpt._format.keys_record import without_key_record
from sparse_ckpt._fqn import build_fqn_map, canonical_name

PLAIN = ["0.weight", "0.bias", "1.weight", "1.bias"]


def _seq() -> nn.Sequential:
    gen = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _adam_with_state(wrapped: nn.Module) -> torch.optim.Adam:
    opt = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    for p in wrapped.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _dsd_flat(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return dict(get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)))


# ----------------------------------------------------------------------------- canonical_name


@pytest.mark.parametrize(
    ("raw", "ddp", "expected"),
    [
        ("module.0.weight", {""}, "0.weight"),
        ("module.0.weight", set(), "module.0.weight"),  # a user submodule named "module" is kept
        ("module.module.weight", {""}, "module.weight"),  # DDP around a model with a child "module"
        ("enc.module.w", {"enc"}, "enc.w"),  # DDP nested under "enc"
        ("enc.module.w", {"dec"}, "enc.module.w"),
        ("_orig_mod.0.weight", set(), "0.weight"),
        ("_orig_mod.module.0.w", {"_orig_mod"}, "0.w"),  # torch.compile(DDP(model))
        ("module._orig_mod.0.w", {""}, "0.w"),  # DDP(torch.compile(model))
        ("a._checkpoint_wrapped_module.b", set(), "a.b"),
        ("layers.3._checkpoint_wrapped_module.mlp._orig_mod.w", set(), "layers.3.mlp.w"),
        ("x_orig_mod.w", set(), "x_orig_mod.w"),  # only whole components are wrappers
        ("w", set(), "w"),
    ],
)
def test_canonical_name(raw: str, ddp: set[str], expected: str) -> None:
    assert canonical_name(raw, ddp) == expected


def test_child_named_module_is_not_stripped_without_ddp() -> None:
    model = nn.Module()
    model.module = nn.Linear(2, 2)
    opt = _adam_with_state(model)
    sd = sc.sparse_state_dict(model, opt, format="flat")
    assert set(flat_settings(sd)) == {"module.weight", "module.bias"}


# ----------------------------------------------------------------------------- DDP (1-process gloo)


@pytest.fixture(scope="module")
def gloo_group() -> Iterator[None]:
    """A single-process gloo group, destroyed at the end of the module (if this module made it)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():  # someone else's group: use it, leave it alone
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_prefix_stripped(gloo_group: None) -> None:
    model = _seq()
    ddp = nn.parallel.DistributedDataParallel(model)
    assert [n for n, _ in ddp.named_parameters()] == [f"module.{n}" for n in PLAIN]
    opt = _adam_with_state(ddp)
    sd = sc.sparse_state_dict(ddp, opt, format="flat")
    assert list(flat_settings(sd)) == PLAIN
    assert_deep_equal(without_key_record(sd), _dsd_flat(ddp, opt), "DDP flat vs DSD", check_order=False)
    # The unwrapped model names its parameters identically, so a checkpoint moves between the two.
    assert_deep_equal(sd, sc.sparse_state_dict(model, opt, format="flat"), "DDP vs plain")


def test_ddp_around_child_named_module(gloo_group: None) -> None:
    inner = nn.Module()
    inner.module = nn.Linear(2, 2)
    ddp = nn.parallel.DistributedDataParallel(inner)
    fmap = build_fqn_map(ddp)
    assert sorted(fmap.fqn_of.values()) == ["module.bias", "module.weight"]
    assert fmap.resolve("module.module.weight") == "module.weight"


# ----------------------------------------------------------------------------- compile / checkpoint wrapper


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_torch_compile_prefix_stripped(fmt: str) -> None:
    model = _seq()
    compiled = torch.compile(model, backend="eager")  # built, never run
    assert [n for n, _ in compiled.named_parameters()] == [f"_orig_mod.{n}" for n in PLAIN]
    opt = _adam_with_state(compiled)
    sd = sc.sparse_state_dict(compiled, opt, format=fmt)
    settings = decoded_settings(compiled, sd) if fmt == "packed" else flat_settings(sd)
    assert list(settings) == PLAIN
    assert {k.rsplit(".", 1)[0] for k in v1_state_keys(sd)} == {f"state.{n}" for n in PLAIN}
    if fmt == "flat":
        assert_deep_equal(without_key_record(sd), _dsd_flat(compiled, opt), "compile flat vs DSD", check_order=False)
    assert_deep_equal(sd, sc.sparse_state_dict(model, opt, format=fmt), "compiled vs plain")


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_activation_checkpoint_wrapper_prefix_stripped(fmt: str) -> None:
    model = _seq()
    wrapped = nn.Sequential(checkpoint_wrapper(model[0]), model[1])
    assert [n for n, _ in wrapped.named_parameters()][:2] == [
        "0._checkpoint_wrapped_module.weight",
        "0._checkpoint_wrapped_module.bias",
    ]
    opt = _adam_with_state(wrapped)
    sd = sc.sparse_state_dict(wrapped, opt, format=fmt)
    settings = decoded_settings(wrapped, sd) if fmt == "packed" else flat_settings(sd)
    assert list(settings) == PLAIN
    if fmt == "flat":
        assert_deep_equal(
            without_key_record(sd), _dsd_flat(wrapped, opt), "checkpoint_wrapper flat vs DSD", check_order=False
        )
    # A checkpoint written from the wrapped model loads into the plain one and vice versa.
    opt_plain = torch.optim.Adam(model.parameters(), lr=0.5)
    sc.load_sparse_state_dict(model, opt_plain, clone_value(sd))
    assert opt_plain.param_groups[0]["lr"] == 0.01
    assert torch.equal(opt_plain.state[model[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])


# ----------------------------------------------------------------------------- tied parameters


class Tied(nn.Module):
    """An embedding and an output head sharing one weight; ``head_first`` flips declaration order."""

    def __init__(self, head_first: bool) -> None:
        super().__init__()
        if head_first:
            self.head = nn.Linear(3, 5, bias=False)
            self.emb = nn.Embedding(5, 3)
            self.emb.weight = self.head.weight
        else:
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
        self.norm = nn.LayerNorm(3)


@pytest.mark.parametrize("head_first", [False, True])
@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_tied_parameter_saved_under_first_fqn(head_first: bool, fmt: str) -> None:
    model = Tied(head_first)
    first, alias = ("head.weight", "emb.weight") if head_first else ("emb.weight", "head.weight")
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)][:2] == [first, alias]
    fmap = build_fqn_map(model)
    assert fmap.resolve(alias) == first
    assert fmap.resolve(first) == first
    assert fmap.fqn_of[id(model.emb.weight)] == first
    assert fmap.param_of[first] is model.emb.weight

    opt = _adam_with_state(model)
    sd = sc.sparse_state_dict(model, opt, format=fmt)
    settings = decoded_settings(model, sd) if fmt == "packed" else flat_settings(sd)
    assert list(settings) == [first, "norm.weight", "norm.bias"]
    assert not [k for k in sd if alias in k]
    assert f"state.{first}.exp_avg" in sd


def test_tied_parameter_loads_from_any_alias() -> None:
    model = Tied(head_first=False)
    opt = _adam_with_state(model)
    sd = sc.sparse_state_dict(model, opt, format="flat")
    renamed = {
        k.replace("emb.weight", "head.weight"): v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()
    }
    assert any("head.weight" in k for k in renamed) and not any("emb.weight" in k for k in renamed)
    opt2 = torch.optim.Adam(model.parameters(), lr=0.7)
    sc.load_sparse_state_dict(model, opt2, renamed)
    assert opt2.param_groups[0]["lr"] == 0.01
    assert torch.equal(opt2.state[model.emb.weight]["exp_avg"], opt.state[model.emb.weight]["exp_avg"])


# ----------------------------------------------------------------------------- one map per call


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_fqn_map_built_once_per_call(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    model = make_moe(0, n_experts=4, dim=4)
    leaves = {f"expert{i}": torch.optim.SGD(e.parameters(), lr=0.1) for i, e in enumerate(model.experts)}
    leaves["dense"] = torch.optim.SGD(model.dense_params(), lr=0.1)
    mo = sc.MultiOptimizer(model, leaves)
    wrapper, counter = count_calls(sparse_ckpt._save.save.build_fqn_map)
    monkeypatch.setattr(sparse_ckpt._save.save, "build_fqn_map", wrapper)
    sd = sc.sparse_state_dict(model, mo, format=fmt)
    assert counter[0] == 1
    mo.state_dict()
    assert counter[0] == 2
    settings = decoded_settings(model, sd) if fmt == "packed" else flat_settings(sd)
    assert len(settings) == len(list(model.parameters()))


# ----------------------------------------------------------------------------- fast module walk ≡ public API


def _public_canonical(model: nn.Module) -> tuple[dict, dict, list[tuple[str, int]]]:
    """The FQN map from the public API: ``(fqn_of, canonical, [(fqn, id(param))])``."""
    ddp = {
        n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, nn.parallel.DistributedDataParallel)
    }
    named = [(raw, canonical_name(raw, ddp), p) for raw, p in model.named_parameters(remove_duplicate=False)]
    fqn_of, canonical, param_of = _backend.core.fqn_tables(named)
    return fqn_of, canonical, [(fqn, id(p)) for fqn, p in param_of.items()]


def _fast_canonical(model: nn.Module) -> tuple[dict, dict, list[tuple[str, int]]] | None:
    """The same from the core's one-walk ``map_parameters``."""
    from sparse_ckpt._format.keys import STRIPPED_PARTS
    from sparse_ckpt._torch_internals import map_parameters

    out = map_parameters(model, STRIPPED_PARTS, nn.parallel.DistributedDataParallel, None)
    return None if out is None else (out[1], out[2], [(fqn, id(p)) for fqn, p in out[3].items()])


def _odd_models() -> dict[str, nn.Module]:
    shared = nn.Linear(2, 2)
    with_none = nn.Linear(2, 2, bias=False)  # registers bias=None
    holder = nn.Module()
    holder._orig_mod = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 1)))
    holder.module = nn.Linear(1, 1)  # not under DDP: kept
    holder.register_parameter("_orig_mod_like", nn.Parameter(torch.zeros(1)))
    holder.skip = None  # a None submodule
    deep = nn.Sequential()
    cur = deep
    for i in range(50):
        nxt = nn.Sequential(nn.Linear(1, 1))
        cur.add_module(f"d{i}", nxt)
        cur = nxt
    return {
        "moe": make_moe(),
        "shared_module_twice": nn.Sequential(shared, nn.ReLU(), shared, with_none),
        "wrappers": holder,
        "compiled": torch.compile(_seq(), backend="eager"),
        "tied": Tied(head_first=True),
        "deep": deep,
    }


@pytest.mark.parametrize("name", list(_odd_models()))
def test_fast_walk_matches_named_parameters(name: str) -> None:
    model = _odd_models()[name]
    assert _fast_canonical(model) == _public_canonical(model)


def test_fast_walk_matches_under_ddp(gloo_group: None) -> None:
    inner = nn.Module()
    inner.module = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.Linear(2, 2)))
    ddp = nn.parallel.DistributedDataParallel(inner)
    assert _fast_canonical(ddp) == _public_canonical(ddp)
    assert [fqn for fqn, _p in _fast_canonical(ddp)[2]][:2] == ["module.0.weight", "module.0.bias"]


class _RenamingModel(nn.Module):
    """Overrides ``named_parameters`` (like FSDP1 does to clean names): its own names are used."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for n, p in super().named_parameters(*args, **kwargs):
            yield n.replace("inner.", "renamed."), p


def test_overridden_named_parameters_is_honoured() -> None:
    model = _RenamingModel()
    assert _fast_canonical(model) is None
    assert sorted(build_fqn_map(model).fqn_of.values()) == ["renamed.bias", "renamed.weight"]


# ----------------------------------------------------------------------------- the kept map


def test_kept_map_reused_while_the_model_is_unchanged() -> None:
    model = make_moe(0, n_experts=4, dim=4)
    first = build_fqn_map(model)
    again = build_fqn_map(model)
    assert again.fqn_of is first.fqn_of and again.canonical is first.canonical
    assert again.param_of == first.param_of and again.param_of is not first.param_of


def _tie_experts(model: nn.Module) -> None:
    model.experts[1].up.weight = model.experts[0].up.weight


def _compile_child(model: nn.Module) -> None:
    model.experts[0] = torch.compile(model.experts[0], backend="eager")


_CHANGES = {
    "replace_param": lambda m: setattr(
        m.experts[0].up, "weight", nn.Parameter(torch.zeros_like(m.experts[0].up.weight))
    ),
    "add_expert": lambda m: m.experts.append(type(m.experts[0])(4)),
    "delete_expert": lambda m: m.experts.__delitem__(1),
    "direct_dict_write": lambda m: m.experts[0].up._parameters.__setitem__("extra", nn.Parameter(torch.zeros(1))),
    "tie": _tie_experts,
    "compile_child": _compile_child,
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_kept_map_follows_every_change(change: str) -> None:
    model = make_moe(0, n_experts=4, dim=4)
    build_fqn_map(model)
    _CHANGES[change](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = build_fqn_map(model)
    sparse_ckpt._fqn.clear_fqn_cache()
    fresh = build_fqn_map(model)
    assert kept.fqn_of == fresh.fqn_of and kept.canonical == fresh.canonical
    assert list(kept.param_of.items()) == list(fresh.param_of.items())
    assert list(kept.param_of.values()) == list(dict.fromkeys(model.parameters()))
    sd = sc.sparse_state_dict(model, opt)  # saves under the new names
    assert set(decoded_settings(model, sd)) == set(fresh.param_of)


def test_kept_map_keeps_nothing_alive() -> None:
    import gc
    import weakref

    model = make_moe(0, n_experts=4, dim=4)
    build_fqn_map(model)
    dropped = weakref.ref(model.experts[3])
    del model.experts[3]
    gc.collect()
    assert dropped() is None  # the kept map holds no module or parameter
    kept = len(sparse_ckpt._fqn._MEMOS)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and len(sparse_ckpt._fqn._MEMOS) <= kept - 1  # its map went with it
