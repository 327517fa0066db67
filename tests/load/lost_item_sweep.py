"""The single-lost-item sweep shared by tests/load/test_every_format_complete.py and
bench/drills/lost_items.py: for one optimizer class and one format, save a tiny DCP checkpoint, then for
each optimizer item of its ``.metadata`` remove that item alone and load into a target optimizer
that has state of its own; each outcome is ``refused`` (a `sparse_ckpt.SparseCheckpointError`, the
target exactly as before), ``exact`` (the target equals the source) or ``silent`` (loaded, not
equal: the property fails), or ``raw`` (another exception: a failure too).

The model has a parameter that never gets a gradient (no state), two param groups and a
scheduler-moved ``lr`` (``initial_lr`` in every group)."""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, snapshot_optimizer
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions

import sparse_ckpt as sc
from sparse_ckpt.integrations import dsd

Pick = Callable[[list[Any]], list[Any]]
"""Which of a sweep's items to remove (`_sampling.sample` in the tests; the bench removes all)."""

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=0.5),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.5, history_size=2, max_iter=2),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
}

FORMATS = ("packed", "flat", "flat-multi", "dsd-flat", "dsd-nested", "dsd-nested-multi")
"""``packed``/``flat``: `sparse_ckpt.SparseOptimizerState` of one optimizer; ``flat-multi``: of a
`sparse_ckpt.MultiOptimizer` of two (``format="flat"``); ``dsd-*``: ``integrations.dsd``'s
get/set functions (DSD's flat or nested layout, of one optimizer or two merged), the dict saved and
loaded by ``dcp`` with the library's planner."""


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(2, 2, bias=False), "idle": nn.Linear(2, 1, bias=False)})


def _groups(model: nn.Module, name: str) -> list[dict[str, Any]]:
    if name == "LBFGS":  # one group only
        return [{"params": list(model.parameters())}]
    return [
        {"params": list(model["a"].parameters())},
        {"params": [model["b"].weight, model["idle"].weight], "lr": 0.02, "weight_decay": 0.1},
    ]


def optimizers(model: nn.Module, name: str, fmt: str) -> list[torch.optim.Optimizer]:
    """One optimizer of two groups, or (``*-multi``) one optimizer per group."""
    groups = _groups(model, name)
    if fmt.endswith("multi") and len(groups) > 1:
        return [OPTIMIZERS[name]([g]) for g in groups]
    return [OPTIMIZERS[name](groups)]


def train(model: nn.Module, opts: list[torch.optim.Optimizer], steps: int, seed: int) -> None:
    """``steps`` steps (``idle`` never gets a gradient, except under LBFGS, which has no per-parameter
    state), each followed by a scheduler step that moves ``lr``."""
    gen = torch.Generator().manual_seed(seed)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    x = torch.randn(4, 3, generator=gen)
    for _ in range(steps):
        for o in opts:
            if isinstance(o, torch.optim.LBFGS):

                def closure(o: torch.optim.Optimizer = o) -> torch.Tensor:
                    o.zero_grad()
                    loss = model["b"](model["a"](x)).pow(2).sum()
                    loss.backward()
                    return loss

                o.step(closure)
            else:
                for p in (model["a"].weight, model["a"].bias, model["b"].weight):
                    p.grad = torch.randn(p.shape, generator=gen)
                o.step()
        for s in scheds:
            s.step()
    for o in opts:
        o.zero_grad(set_to_none=True)


def _leaves(opts: list[torch.optim.Optimizer], fmt: str, model: nn.Module) -> Any:
    if fmt == "flat-multi":
        return sc.MultiOptimizer(model, {f"leaf{i}": o for i, o in enumerate(opts)})
    return opts[0] if len(opts) == 1 else {f"leaf{i}": o for i, o in enumerate(opts)}


def save(path: Path, model: nn.Module, opts: list[torch.optim.Optimizer], fmt: str) -> None:
    if fmt.startswith("dsd-"):
        options = StateDictOptions(flatten_optimizer_state_dict=fmt.startswith("dsd-flat"))
        dcp.save({"optim": dsd.get_optimizer_state_dict(model, opts, options=options)}, checkpoint_id=path)
        return
    layout = "auto" if fmt == "packed" else "per_tensor"
    state = sc.SparseOptimizerState(
        model, _leaves(opts, fmt, model), format="packed" if fmt == "packed" else "flat", state_layout=layout
    )
    dcp.save({"optim": state}, checkpoint_id=path)


def load(path: Path, model: nn.Module, opts: list[torch.optim.Optimizer], fmt: str) -> None:
    if fmt.startswith("dsd-"):
        options = StateDictOptions(flatten_optimizer_state_dict=fmt.startswith("dsd-flat"))
        osd = dsd.get_optimizer_state_dict(model, opts, options=options)
        dcp.load({"optim": osd}, checkpoint_id=path, planner=sc.SparseLoadPlanner())
        dsd.set_optimizer_state_dict(model, opts, osd, options=options)
        return
    state = sc.SparseOptimizerState(model, _leaves(opts, fmt, model), format="packed" if fmt == "packed" else "flat")
    dcp.load({"optim": state}, checkpoint_id=path, planner=sc.SparseLoadPlanner())


def item_kind(item: str | tuple[Any, ...]) -> Hashable:
    """A lost item's kind (`_sampling.sample`): the state items of one state name (``("state", name)``),
    the setting items (``"param_groups"``), or the item itself (key records, guards, packed tables); a
    DCP key or an in-memory path (`in_memory_outcomes`), with or without the ``optim.`` prefix."""
    parts = [p for part in ((item,) if isinstance(item, str) else item) for p in str(part).split(".")]
    if parts[0] == "optim":
        parts = parts[1:]
    if parts[0] == "state":
        return ("state", parts[-1])
    return "param_groups" if parts[0] == "param_groups" else ".".join(parts)


def outcomes(name: str, fmt: str, path: Path, pick: Pick = list) -> dict[str, str]:
    """``DCP key -> outcome`` (see the module doc) of removing each optimizer item alone (the items
    ``pick`` keeps: all by default)."""
    model = make_model(0)
    opts = optimizers(model, name, fmt)
    train(model, opts, 2, seed=1)
    path.mkdir(parents=True, exist_ok=True)
    save(path, model, opts, fmt)
    original = (path / ".metadata").read_bytes()
    md = pickle.loads(original)
    keys = pick([k for k in md.state_dict_metadata if k.startswith("optim.")])
    target_model = make_model(0)
    target_model.load_state_dict(model.state_dict())
    result: dict[str, str] = {}
    try:
        for key in keys:
            damaged = pickle.loads(original)
            del damaged.state_dict_metadata[key]
            for index in [i for i in damaged.storage_data if i.fqn == key]:
                del damaged.storage_data[index]
            (path / ".metadata").write_bytes(pickle.dumps(damaged))
            target = optimizers(target_model, name, fmt)
            train(target_model, target, 1, seed=7)  # state of its own: a refusal must keep it
            target_model.load_state_dict(model.state_dict())
            result[key] = verdict(functools.partial(load, path, target_model, target, fmt), target, opts)
    finally:
        (path / ".metadata").write_bytes(original)
    return result


def verdict(
    load_damaged: Callable[[], None], target: list[torch.optim.Optimizer], saved: list[torch.optim.Optimizer]
) -> str:
    """What one load of a damaged checkpoint did to ``target``: ``"refused"`` (a sparse_ckpt error, and
    ``target`` as it was before), ``"exact"`` (``target`` equals the ``saved`` optimizers), ``"silent"``
    (it loaded something else) or ``"raw: ..."`` (another error)."""
    before = [snapshot_optimizer(o) for o in target]
    try:
        load_damaged()
    except (sc.SparseCheckpointError, CheckpointException) as exc:
        if isinstance(exc, CheckpointException) and not _sparse_cause(exc):
            return f"raw: {exc!r}"[:300]
        for o, b in zip(target, before, strict=True):
            assert_optimizer_equal(o, b, grads=False)
        return "refused"
    except Exception as exc:  # noqa: BLE001 - reported as the property's failure
        return f"raw: {type(exc).__name__}: {exc}"[:300]
    try:
        for o, src in zip(target, saved, strict=True):
            assert_optimizer_equal(o, src, grads=False)
    except AssertionError:
        return "silent"
    return "exact"


def _sparse_cause(exc: CheckpointException) -> bool:
    """Whether every rank's failure inside DCP's ``CheckpointException`` is a sparse_ckpt error."""
    failures = getattr(exc, "failures", {}) or {}
    causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return bool(causes) and all(isinstance(c, sc.SparseCheckpointError) for c in causes)


def _items(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The paths of the items DCP writes for ``node``: dict values, and the elements of a list that
    holds tensors or dicts, recursively (DCP's traversal); other values are one item each."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _items(v, (*path, k))]
    if isinstance(node, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in node):
        return [p for i, v in enumerate(node) for p in _items(v, (*path, i))]
    return [path]


def _without(node: Any, path: tuple[Any, ...]) -> Any:
    """A copy of ``node`` (containers only) without the item at ``path``."""
    if not path:
        return node
    if isinstance(node, dict):
        return {
            k: (_without(v, path[1:]) if k == path[0] else v)
            for k, v in node.items()
            if not (k == path[0] and len(path) == 1)
        }
    return [
        (_without(v, path[1:]) if i == path[0] else v)
        for i, v in enumerate(node)
        if not (i == path[0] and len(path) == 1)
    ]


def _perturbed(opts: list[torch.optim.Optimizer]) -> None:
    """Every float setting of the target moved (so a setting a load misses shows)."""
    for o in opts:
        for g in o.param_groups:
            for k, v in g.items():
                if type(v) is float:
                    g[k] = v * 3 + 0.125
                elif type(v) is tuple and all(type(x) is float for x in v):
                    g[k] = tuple(x / 2 for x in v)


def _load_dict(
    model: nn.Module, opts: list[torch.optim.Optimizer], fmt: str, sd: Any, options: StateDictOptions
) -> None:
    """Load the in-memory dict ``sd`` of format ``fmt`` into ``opts``."""
    if fmt.startswith("dsd-"):
        dsd.set_optimizer_state_dict(model, opts, sd, options=options)
    else:
        sc.load_sparse_state_dict(model, _leaves(opts, fmt, model), sd)


def in_memory_outcomes(name: str, fmt: str, pick: Pick = list) -> dict[tuple[Any, ...], str]:
    """``outcomes`` without DCP: each item (as DCP would write them) removed from the dict itself,
    the dict loaded by the library's function for the format (``load_sparse_state_dict`` or
    ``integrations.dsd.set_optimizer_state_dict``)."""
    import copy

    model = make_model(0)
    opts = optimizers(model, name, fmt)
    train(model, opts, 2, seed=1)
    options = StateDictOptions(flatten_optimizer_state_dict=fmt.startswith("dsd-flat"))
    if fmt.startswith("dsd-"):
        saved = dsd.get_optimizer_state_dict(model, opts, options=options)
    else:
        saved = sc.sparse_state_dict(model, _leaves(opts, fmt, model), format="packed" if fmt == "packed" else "flat")
    saved = dict(saved)
    target_model = make_model(0)
    target_model.load_state_dict(model.state_dict())
    target = optimizers(target_model, name, fmt)
    train(target_model, target, 1, seed=7)
    _perturbed(target)
    target_model.load_state_dict(model.state_dict())
    initial = [copy.deepcopy(o.state_dict()) for o in target]
    result: dict[tuple[Any, ...], str] = {}
    for path in pick(_items(saved)):
        damaged = _without(saved, path)
        for o, sd in zip(target, initial, strict=True):
            o.load_state_dict(copy.deepcopy(sd))
        result[path] = verdict(functools.partial(_load_dict, target_model, target, fmt, damaged, options), target, opts)
    return result
