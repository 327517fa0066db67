"""Synthetic MoE models and AdamW optimizers for the bench (a DeepSeek-V3-shaped MoE; see "How the
fixtures are built" in ``bench/README.md``).

A model of ``L`` layers, each with ``E`` experts (``gate_proj``, ``up_proj``, ``down_proj``) and
dense parameters (attention ``q/k/v/o_proj``, ``router``, two norms), named like DeepSeek-V3 in
Hugging Face: ``layers.{l}.mlp.experts.{e}.gate_proj.weight``. Two group layouts:

* ``layer``: one AdamW param group per layer (all of its parameters);
* ``param``: one group per parameter (norms without weight decay, so two distinct settings).

A fraction of the experts (default 0.5, chosen per layer with a seeded RNG) never gets a gradient
and therefore has no optimizer state. Tensors are tiny by default (shape ``(2,)``): the cost under
test is metadata. ``hidden=N`` gives ``(N, N)`` weights (``(N,)`` norms, ``(E, N)`` router).
``embed=(V, D)`` adds the mixed-size fixture's large tensors: an input embedding ``embed_tokens.weight``
and an output head ``lm_head.weight``, both ``(V, D)`` and always with state (many small expert
weights next to two embeddings of several MiB; see :class:`FixtureSpec`).

:func:`uniform_fixture` is the threshold sweep's fixture: ``n`` parameters of one shape in one group.

Building AdamW with tens of thousands of groups through its constructor is O(groups^2) (torch's
``add_param_group`` rebuilds the set of every earlier group's parameters for each new group), so
:func:`build_adamw` constructs it with one group and installs the other groups exactly as
``add_param_group`` would have written them (``test_bench_quick`` checks the equality). State is
populated either by filling ``optimizer.state`` in the exact shape one real AdamW step creates
(``fill``, default) or by one real ``step()`` with gradients on the stateful parameters (``step``).

A fixture is built with Python's cyclic garbage collector paused (:func:`gc_paused`): the model,
the optimizer and its state are millions of objects at ``200x1024``, and the collector's full
passes over them, not the construction itself, would dominate the build (measured here at
``200x1024``: well over half the build time, and 18 s instead of 2 s for one fresh optimizer).
"""

from __future__ import annotations

import gc
import random
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

LAYOUTS = ("layer", "param")
STATE_INITS = ("fill", "step")
DENSE_NAMES = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.router", "input_norm", "post_attn_norm")
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
NORM_NAMES = ("input_norm", "post_attn_norm")


@dataclass(frozen=True)
class NameStyle:
    """The module names of a fixture's model: what a layer calls its attention, router and norms, and
    the module the ``layers`` list sits in (``root``, empty: the model itself)."""

    attn: str
    router: str
    input_norm: str
    post_attn_norm: str
    root: str = ""

    @property
    def dense(self) -> tuple[str, ...]:
        """Each layer's dense parameters' module paths, in registration order (``DENSE_NAMES``' order)."""
        attn = tuple(f"{self.attn}.{p}" for p in ATTENTION_PROJECTIONS)
        return (*attn, f"mlp.{self.router}", self.input_norm, self.post_attn_norm)

    @property
    def norms(self) -> tuple[str, str]:
        """The two norms' module names (no weight decay in the ``param`` layout)."""
        return (self.input_norm, self.post_attn_norm)


NAME_STYLES: dict[str, NameStyle] = {
    "bench": NameStyle("attn", "router", "input_norm", "post_attn_norm"),
    "deepseek": NameStyle("self_attn", "gate", "input_layernorm", "post_attention_layernorm", root="model"),
}
"""``bench``: the bench's short names (``layers.0.attn.q_proj.weight``); ``deepseek``: DeepSeek-V3's in
Hugging Face, one module deeper and longer (``model.layers.0.self_attn.q_proj.weight``,
``model.layers.0.mlp.gate.weight``, ``model.layers.0.post_attention_layernorm.weight``); the same
parameters, shapes and order either way."""
ADAMW_KWARGS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "foreach": False}
"""AdamW settings of every group (``foreach=False``: the single-tensor path, fine for tiny tensors)."""
NORM_OVERRIDES: dict[str, Any] = {"weight_decay": 0.0}
"""Per-group override for norm weights in the ``param`` layout."""
N_LEAVES = 1
"""Optimizer leaves of a fixture: one ``torch.optim.AdamW`` (sparse_ckpt names it ``optim``)."""


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored on exit); reference counting still frees memory."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class Scale:
    """``layers x experts`` of a synthetic MoE model."""

    layers: int
    experts: int

    @property
    def label(self) -> str:
        """``"{layers}x{experts}"``."""
        return f"{self.layers}x{self.experts}"

    @property
    def n_params(self) -> int:
        """Number of parameters (tensors) of the model."""
        return self.layers * (self.experts * len(EXPERT_NAMES) + len(DENSE_NAMES))


T = TypeVar("T")


def _parse_list(text: str, parse_one: Callable[[str], T], what: str) -> list[T]:
    """``parse_one`` of each item of the comma-separated ``text`` (stripped, lower case; empty items
    skipped), in order, duplicates dropped; none at all is a ``ValueError`` (``no {what} given``)."""
    out: list[T] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            value = parse_one(item)
            if value not in out:
                out.append(value)
    if not out:
        raise ValueError(f"no {what} given")
    return out


def _parse_scale(item: str) -> Scale:
    m = re.fullmatch(r"(\d+)x(\d+)", item)
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"scale {item!r} is not LAYERSxEXPERTS with both >= 1 (e.g. 8x64)")
    return Scale(int(m.group(1)), int(m.group(2)))


def parse_scales(text: str) -> list[Scale]:
    """Parse ``"8x64,24x128"`` into scales (order kept, duplicates dropped)."""
    return _parse_list(text, _parse_scale, "scale")


class Weight(nn.Module):
    """A module holding one ``weight`` parameter (cheaper to build than ``nn.Linear``)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, 0.02, device=device))


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""One routed expert's weights."""
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""An attention block's weights."""


class Projections(nn.Module):
    """One ``Weight`` of ``shape`` per name, registered in order (an expert, the attention)."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...], device: torch.device) -> None:
        super().__init__()
        for name in names:
            self.add_module(name, Weight(shape, device))


class MoEMlp(nn.Module):
    """``router`` plus ``experts``."""

    def __init__(
        self,
        experts: int,
        shape: tuple[int, ...],
        router_shape: tuple[int, ...],
        device: torch.device,
        router: str = "router",
    ) -> None:
        super().__init__()
        self.add_module(router, Weight(router_shape, device))
        self.experts = nn.ModuleList(Projections(EXPERT_PROJECTIONS, shape, device) for _ in range(experts))


class Layer(nn.Module):
    """One decoder layer: norms, attention and the MoE MLP (module names from ``style``)."""

    def __init__(
        self, experts: int, hidden: int, device: torch.device, style: NameStyle = NAME_STYLES["bench"]
    ) -> None:
        super().__init__()
        weight = (hidden, hidden) if hidden else (2,)
        norm = (hidden,) if hidden else (2,)
        router = (experts, hidden) if hidden else (2,)
        self.style = style
        self.add_module(style.input_norm, Weight(norm, device))
        self.add_module(style.attn, Projections(ATTENTION_PROJECTIONS, weight, device))
        self.add_module(style.post_attn_norm, Weight(norm, device))
        self.mlp = MoEMlp(experts, weight, router, device, style.router)


class MoEModel(nn.Module):
    """``layers.{l}`` decoder layers (parameters only; there is no forward), with ``embed=(V, D)`` also
    ``embed_tokens`` before and ``lm_head`` after them, ``(V, D)`` weights. A ``style`` with a ``root``
    puts the embedding and the layers one module down (``model.layers.{l}``, as Hugging Face does);
    :meth:`decoder_layers` is the layer list either way."""

    def __init__(
        self,
        scale: Scale,
        hidden: int,
        device: torch.device,
        embed: tuple[int, int] | None = None,
        style: NameStyle = NAME_STYLES["bench"],
    ) -> None:
        super().__init__()
        self.root = style.root
        body: nn.Module = self
        if style.root:
            body = nn.Module()
            self.add_module(style.root, body)
        if embed is not None:
            body.add_module("embed_tokens", Weight(embed, device))
        body.add_module(
            "layers", nn.ModuleList(Layer(scale.experts, hidden, device, style) for _ in range(scale.layers))
        )
        if embed is not None:
            self.lm_head = Weight(embed, device)

    def body(self) -> nn.Module:
        """The module holding ``layers`` and ``embed_tokens``: the model, or its ``root`` module."""
        return self.get_submodule(self.root)

    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers (``layers``, under ``style.root`` where there is one)."""
        return self.body().get_submodule("layers")


EMBED_NAMES = ("embed_tokens", "lm_head")
"""The mixed-size fixture's large weights (``MoEModel(embed=...)``)."""


def embed_params(model: MoEModel) -> list[nn.Parameter]:
    """``embed_tokens.weight`` and ``lm_head.weight`` where the model has them (else none)."""
    mods = (getattr(model.body(), "embed_tokens", None), getattr(model, "lm_head", None))
    return [m.weight for m in mods if m is not None]


@dataclass(frozen=True)
class FixtureSpec:
    """One fixture of ``bench.scale``: ``LxE:hH[:eVxD]``, e.g. ``24x128:h64`` (``(64, 64)`` weights) or the
    mixed-size ``8x64:h64:e32768x64`` (the same plus two ``(32768, 64)`` embeddings, 8 MiB each: 1 648 state
    tensors of at most 16 KiB next to four of 8 MiB)."""

    scale: Scale
    hidden: int = 0
    embed: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """The spec as parsed (``"8x64:h64:e32768x64"``)."""
        tail = f":e{self.embed[0]}x{self.embed[1]}" if self.embed else ""
        return f"{self.scale.label}:h{self.hidden}{tail}"


def _parse_fixture_spec(item: str) -> FixtureSpec:
    m = re.fullmatch(r"(\d+x\d+)(?::h(\d+))?(?::e(\d+)x(\d+))?", item)
    if m is None or (m.group(3) is not None and (int(m.group(3)) < 1 or int(m.group(4)) < 1)):
        raise ValueError(f"fixture {item!r} is not LxE[:hHIDDEN][:eVOCABxDIM] (e.g. 8x64:h64:e32768x64)")
    (scale,) = parse_scales(m.group(1))
    embed = (int(m.group(3)), int(m.group(4))) if m.group(3) is not None else None
    return FixtureSpec(scale, int(m.group(2) or 0), embed)


def parse_fixture_specs(text: str) -> list[FixtureSpec]:
    """Parse ``"24x128:h0,4x16:h512,8x64:h64:e32768x64"`` (order kept, duplicates dropped)."""
    return _parse_list(text, _parse_fixture_spec, "fixture")


def layer_params(layer: Layer) -> Iterator[tuple[str, nn.Parameter, bool]]:
    """``(local name, param, is_expert)`` of one layer, dense first, in a fixed order."""
    for name in layer.style.dense:
        mod: Any = layer
        for part in name.split("."):
            mod = getattr(mod, part)
        yield name, mod.weight, False
    for e, expert in enumerate(layer.mlp.experts):
        for name in EXPERT_NAMES:
            yield f"mlp.experts.{e}.{name}", getattr(expert, name).weight, True


def torch_group(spec: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The group dict ``Optimizer.add_param_group(spec)`` stores: spec's keys, then missing defaults."""
    group = dict(spec)
    group["params"] = list(group["params"])
    for key, value in defaults.items():
        group.setdefault(key, value)
    return group


def build_adamw(specs: list[dict[str, Any]], **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(specs, **kwargs)`` in O(groups) instead of torch's O(groups^2).

    The optimizer is constructed with the first group only; the remaining groups are appended
    exactly as ``add_param_group`` would have stored them (minus its disjointness check, which
    the fixture guarantees by construction).
    """
    opt = torch.optim.AdamW([specs[0]], **kwargs)
    opt.param_groups.extend(torch_group(spec, opt.defaults) for spec in specs[1:])
    return opt


@dataclass
class Fixture:
    """A model, a source optimizer with sparse state, and a factory for fresh load targets."""

    scale: Scale
    layout: str
    model: MoEModel
    specs: list[dict[str, Any]]
    optimizer: torch.optim.AdamW
    stateful: list[nn.Parameter]
    build_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def new_optimizer(self) -> torch.optim.AdamW:
        """A fresh AdamW with the same groups and no state (a load target)."""
        return build_adamw(self.specs, **ADAMW_KWARGS)

    @property
    def n_params(self) -> int:
        """Number of parameters in the optimizer."""
        return sum(len(g["params"]) for g in self.optimizer.param_groups)


def group_specs(model: MoEModel, layout: str) -> list[dict[str, Any]]:
    """Param-group specs (what a user passes to the constructor) for ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    specs: list[dict[str, Any]] = [{"params": [p]} for p in embed_params(model)]  # one group each
    for layer in model.decoder_layers():
        if layout == "layer":
            specs.append({"params": [p for _n, p, _e in layer_params(layer)]})
        else:
            for name, p, _e in layer_params(layer):
                spec: dict[str, Any] = {"params": [p]}
                if name in layer.style.norms:
                    spec.update(NORM_OVERRIDES)
                specs.append(spec)
    return specs


def stateful_params(model: MoEModel, no_state_fraction: float, seed: int) -> list[nn.Parameter]:
    """Dense params plus, per layer, the experts that get a gradient (seeded choice)."""
    if not 0.0 <= no_state_fraction <= 1.0:
        raise ValueError(f"no_state_fraction must be in [0, 1], got {no_state_fraction}")
    rng = random.Random(seed)
    out: list[nn.Parameter] = embed_params(model)
    for layer in model.decoder_layers():
        n = len(layer.mlp.experts)
        idle = set(rng.sample(range(n), round(n * no_state_fraction)))
        for name, p, is_expert in layer_params(layer):
            if not is_expert or int(name.split(".")[2]) not in idle:
                out.append(p)
    return out


_TEMPLATE_CACHE: dict[tuple[Any, ...], dict[str, Any]] = {}


def state_template(param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
    """The state one real AdamW step creates for a parameter like ``param`` in ``group``."""
    settings = {k: v for k, v in group.items() if k != "params"}
    try:
        key: tuple[Any, ...] = (tuple(param.shape), param.dtype, param.device, tuple(settings.items()))
        cached = _TEMPLATE_CACHE.get(key)
    except TypeError:  # an unhashable setting (e.g. a tensor lr)
        key = (tuple(param.shape), param.dtype, param.device, repr(sorted(settings.items())))
        cached = _TEMPLATE_CACHE.get(key)
    if cached is None:
        p = nn.Parameter(torch.zeros_like(param))
        opt = torch.optim.AdamW([{"params": [p], **settings}])
        p.grad = torch.full_like(p, 0.01)
        opt.step()
        cached = _TEMPLATE_CACHE[key] = opt.state[p]
    return cached


def fill_state(opt: torch.optim.Optimizer, stateful: list[nn.Parameter]) -> None:
    """Write AdamW state for ``stateful`` without stepping: same keys, order, dtypes, shapes."""
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for p in stateful:
        template = state_template(p, group_of[id(p)])
        opt.state[p] = {
            k: v.clone() if v.shape != p.shape or k == "step" else torch.full_like(p, 0.001)
            for k, v in template.items()
        }


def step_state(opt: torch.optim.Optimizer, stateful: list[nn.Parameter]) -> None:
    """One real ``step()`` with gradients on ``stateful`` only; grads are cleared afterwards."""
    for p in stateful:
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    for p in stateful:
        p.grad = None


class FixtureCache:
    """Build each ``(scale, layout)`` fixture once per run (one model per scale); ``names``: the
    model's module names (:data:`NAME_STYLES`)."""

    def __init__(
        self,
        *,
        hidden: int = 0,
        device: str = "cpu",
        no_state_fraction: float = 0.5,
        state_init: str = "fill",
        seed: int = 0,
        embed: tuple[int, int] | None = None,
        names: str = "bench",
    ) -> None:
        if state_init not in STATE_INITS:
            raise ValueError(f"state_init must be one of {STATE_INITS}, got {state_init!r}")
        if names not in NAME_STYLES:
            raise ValueError(f"names must be one of {tuple(NAME_STYLES)}, got {names!r}")
        self.names = names
        self.hidden = hidden
        self.device = torch.device(device)
        self.no_state_fraction = no_state_fraction
        self.state_init = state_init
        self.seed = seed
        self.embed = embed
        self._models: dict[Scale, tuple[MoEModel, list[nn.Parameter]]] = {}
        self._fixtures: dict[tuple[Scale, str], Fixture] = {}

    def get(self, scale: Scale, layout: str) -> Fixture:
        """The cached fixture for ``(scale, layout)``, built on first use."""
        key = (scale, layout)
        fx = self._fixtures.get(key)
        if fx is None:
            fx = self._fixtures[key] = self._build(scale, layout)
        return fx

    def drop(self, scale: Scale, layout: str) -> None:
        """Forget the ``(scale, layout)`` fixture (its optimizer and state); the model stays cached."""
        self._fixtures.pop((scale, layout), None)

    def drop_scale(self, scale: Scale) -> None:
        """Forget every fixture of ``scale`` (frees memory once a scale is done)."""
        self._models.pop(scale, None)
        for key in [k for k in self._fixtures if k[0] == scale]:
            del self._fixtures[key]

    def _build(self, scale: Scale, layout: str) -> Fixture:
        t0 = time.perf_counter()
        with gc_paused():
            if scale not in self._models:
                model = MoEModel(scale, self.hidden, self.device, self.embed, NAME_STYLES[self.names])
                self._models[scale] = (model, stateful_params(model, self.no_state_fraction, self.seed))
            model, stateful = self._models[scale]
            specs = group_specs(model, layout)
            opt = build_adamw(specs, **ADAMW_KWARGS)
            populate: Callable[[torch.optim.Optimizer, list[nn.Parameter]], None]
            populate = fill_state if self.state_init == "fill" else step_state
            populate(opt, stateful)
            fx = Fixture(scale, layout, model, specs, opt, stateful)
            fx.info = {
                "n_params": fx.n_params,
                "n_stateful": len(opt.state),
                "n_groups": len(opt.param_groups),
                "n_state_tensors": sum(len(s) for s in opt.state.values()),
                "n_param_shaped_state": param_shaped_state_tensors(opt),
                "n_leaves": N_LEAVES,
            }
        fx.build_s = fx.info["fixture_build_s"] = time.perf_counter() - t0
        return fx


def param_shaped_state_tensors(opt: torch.optim.Optimizer) -> int:
    """State tensors shaped like their parameter (AdamW: ``exp_avg``, ``exp_avg_sq``; not the 0-dim ``step``)."""
    return sum(
        1 for p, s in opt.state.items() for v in s.values() if isinstance(v, torch.Tensor) and v.shape == p.shape
    )


def uniform_fixture(n: int, shape: tuple[int, ...], device: str = "cpu") -> Fixture:
    """``n`` parameters ``params.{i}.weight`` of ``shape`` (float32) in one AdamW group, every one with
    state (two state tensors of ``shape`` and a 0-dim ``step`` each): the threshold sweep's fixture."""
    t0 = time.perf_counter()
    with gc_paused():
        model: Any = nn.Module()
        model.params = nn.ModuleList(Weight(shape, torch.device(device)) for _ in range(n))
        params = [m.weight for m in model.params]
        specs = [{"params": params}]
        opt = build_adamw(specs, **ADAMW_KWARGS)
        fill_state(opt, params)
        fx = Fixture(Scale(1, n), "layer", model, specs, opt, params)
        fx.info = {
            "n_params": n,
            "shape": list(shape),
            "n_stateful": n,
            "n_groups": 1,
            "n_state_tensors": sum(len(s) for s in opt.state.values()),
            "n_param_shaped_state": param_shaped_state_tensors(opt),
            "n_leaves": N_LEAVES,
        }
    fx.build_s = fx.info["fixture_build_s"] = time.perf_counter() - t0
    return fx
