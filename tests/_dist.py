"""Run a function on N Gloo ranks in real processes (multi-rank tests).

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size`` Gloo
ranks through the drill's launcher (``bench/drills/ranks.py``: ranks forked from a fork server that never
touched a device, or spawned; never forked from the test process, which crashes on GPU machines)
and always destroys the process group. ``fn`` must be a module-level function. A worker's exception
fails the parent test with the worker's traceback; the other ranks are terminated. The workers use
the parent test's core backend.

Every rank runs with :func:`forbid_default_mesh`: ``fully_shard`` without ``mesh=`` (or torch's
default mesh, which it builds on the machine's accelerator, CUDA on a GPU machine) raises, so a
multi-rank test passes here only if it would also run on a GPU machine. :func:`cpu_mesh` is the
explicit mesh to pass instead.

The FSDP2 model the multi-rank tests share: :class:`FsdpNet` and :func:`build_fsdp` (the net,
``fully_shard``-ed or plain, with a ``MultiOptimizer`` of leaves ``body`` and ``head``),
:func:`train_body` (steps ``body`` only, so ``head`` never gets state) and :func:`trained_fsdp`
(two such steps, ``head``'s lr moved to :data:`HEAD_LR`), and :func:`assert_state_placed_like_params`.

Full values across ranks: :func:`full_copy` (a DTensor's full value, a collective),
:func:`full_snapshot` (parameters, optimizer state by FQN and param groups, all full copies) and
:func:`assert_snapshots_equal` (exact, with or without the optimizer layout).
"""

from __future__ import annotations

import functools
import inspect
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_deep_equal, clone_value, fqn_view
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import sparse_ckpt as sc
from bench.drills import ranks
from bench.drills.ranks import free_port
from sparse_ckpt._leaves import named_leaves

MULTI_RANK = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.usefixtures("forbid_fork"),  # ranks start from a fork server or by spawn (tests/conftest.py)
]
"""``pytestmark`` of a module that starts ranks."""


class DefaultMeshForbidden(RuntimeError):
    """Raised in a rank when torch is about to build ``fully_shard``'s default mesh."""


class ForkForbidden(RuntimeError):
    """``os.fork`` was called in the test process under ``forbid_fork``."""


_DEFAULT_MESH_BUILDERS = ("_init_default_mesh", "_init_default_fully_shard_mesh")
"""The names under which torch's ``fully_shard`` calls its default-mesh builder (torch 2.13; 2.6-2.10)."""


def forbid_default_mesh() -> None:
    """In this process, make ``fully_shard(module)`` without ``mesh=`` raise :class:`DefaultMeshForbidden`.

    torch builds that default mesh on ``torch._C._get_accelerator()``: CUDA on a GPU machine, even
    when the run is Gloo on CPU, so code that relies on it crashes there. The builder is a private
    torch function, replaced in the namespace ``fully_shard`` is defined in; if none of the known
    names is found, the torch version is not supported here and this raises ``RuntimeError`` (update
    :data:`_DEFAULT_MESH_BUILDERS`), rather than guarding nothing.
    """
    namespace = inspect.unwrap(fully_shard).__globals__  # (the public function is a decorated wrapper)
    names = [n for n in _DEFAULT_MESH_BUILDERS if n in namespace]
    if not names:
        where = namespace.get("__name__")
        raise RuntimeError(f"torch {torch.__version__}: {where} has none of {_DEFAULT_MESH_BUILDERS}")

    def refuse(*_args: Any, **_kwargs: Any) -> DeviceMesh:
        raise DefaultMeshForbidden(
            "fully_shard was called without mesh=: torch would build its default mesh on the machine's "
            "accelerator (CUDA on a GPU machine, even for a Gloo/CPU run); pass mesh=cpu_mesh()"
        )

    for name in names:
        namespace[name] = refuse


def cpu_mesh() -> DeviceMesh:
    """A 1-D CPU device mesh over the whole process group (what ``fully_shard`` gets in the tests)."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _run_guarded(fn: Callable[..., Any], rank: int, world_size: int, *args: Any) -> None:
    forbid_default_mesh()
    fn(rank, world_size, *args)


def guarded(fn: Callable[..., Any]) -> Callable[..., None]:
    """``fn`` (a rank function) run under :func:`forbid_default_mesh`; picklable when ``fn`` is."""
    return functools.partial(_run_guarded, fn)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; re-raise a worker's failure."""
    err_dir = tempfile.mkdtemp(prefix="ranks-")
    try:
        ranks.run_ranks(guarded(fn), world_size, *args, err_dir=err_dir, timeout=timeout)
    finally:
        shutil.rmtree(err_dir, ignore_errors=True)


# --------------------------------------------------------------------------- the FSDP2 model

DIM = 8
HEAD_LR = 0.0025
"""The lr :func:`trained_fsdp` gives leaf ``head`` (which never steps): a scheduler-moved value."""


class FsdpNet(nn.Module):
    """Two ``Linear(DIM, DIM)`` layers (tanh) and a 5-row head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, 5)  # 5 rows: uneven shards on 2 ranks, an empty one on 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def build_fsdp(seed: int, sharded: bool) -> tuple[FsdpNet, sc.MultiOptimizer]:
    """:class:`FsdpNet` (each layer and the root ``fully_shard``-ed when ``sharded``; needs a process
    group) and a MultiOptimizer with leaves ``body`` (the layers) and ``head``, AdamW lr 0.01."""
    torch.manual_seed(seed)
    model = FsdpNet()
    if sharded:
        mesh = cpu_mesh()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = sc.MultiOptimizer(
        model,
        {
            "body": torch.optim.AdamW(model.layers.parameters(), lr=0.01),
            "head": torch.optim.AdamW(model.head.parameters(), lr=0.01),
        },
    )
    return model, opt


def train_body(model: FsdpNet, opt: sc.MultiOptimizer, steps: int, seed: int) -> None:
    """``steps`` deterministic steps of leaf ``body`` only (``head`` gets grads, never state)."""
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(seed + i))
        model(x).pow(2).mean().backward()
        opt["body"].step()


def trained_fsdp(sharded: bool) -> tuple[FsdpNet, sc.MultiOptimizer]:
    """``build_fsdp(0, sharded)`` after two :func:`train_body` steps, ``head``'s lr set to :data:`HEAD_LR`."""
    model, opt = build_fsdp(0, sharded)
    train_body(model, opt, 2, seed=0)
    for group in opt["head"].param_groups:
        group["lr"] = HEAD_LR
    return model, opt


def assert_state_placed_like_params(model: nn.Module, opt: sc.MultiOptimizer) -> None:
    """Each state tensor sits like its parameter: a DTensor with the parameter's mesh, placements
    and local shape for a DTensor parameter (``step`` excepted: a plain tensor), else a plain
    tensor on the parameter's device."""
    for _leaf, o in opt.leaves():
        for p, st in o.state.items():
            for k, v in st.items():
                if k == "step":
                    assert not isinstance(v, DTensor)
                elif isinstance(p, DTensor):
                    assert isinstance(v, DTensor) and v.placements == p.placements and v.device_mesh == p.device_mesh
                    assert v.to_local().shape == p.to_local().shape
                else:
                    assert not isinstance(v, DTensor) and v.device == p.device


# --------------------------------------------------------------------------- full values, snapshots


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_copy(value: Any) -> Any:
    """A detached full copy of ``value`` (:func:`helpers.clone_value`): a DTensor's full value
    (``full_tensor``, a collective: every rank must copy the same DTensors in the same order), a
    tensor's clone, dicts, lists and tuples copied item by item, anything else deep-copied."""
    return clone_value(value, _full_tensor)


def full_snapshot(model: nn.Module, opt: Any) -> dict[str, Any]:
    """Full copies of a model and its optimizer (any optimizer argument: a MultiOptimizer, one
    optimizer, a mapping), comparable across models, layouts and world sizes (``torch.save``-able):

    * ``params``: ``fqn -> full value``, in ``named_parameters`` order;
    * ``state``: ``leaf -> {fqn -> {key: full value}}``, FQNs sorted (the same copy order on every rank);
    * ``groups``: ``leaf -> [(settings, [fqn, ...]), ...]`` (:func:`helpers.fqn_view` with ``groups=True``).

    Every rank must call it at the same point (DTensors are copied by collectives).
    """
    snap: dict[str, Any] = {
        "params": {n: full_copy(p) for n, p in model.named_parameters()},
        "state": {},
        "groups": {},
    }
    for leaf, o in named_leaves(opt):
        state, groups = fqn_view(model, [o], groups=True)
        snap["state"][leaf] = {fqn: full_copy(state[fqn]) for fqn in sorted(state)}
        snap["groups"][leaf] = clone_value(groups)
    return snap


def _state_by_fqn(snap: dict[str, Any]) -> dict[str, Any]:
    merged = {fqn: st for leaf_state in snap["state"].values() for fqn, st in leaf_state.items()}
    return {fqn: merged[fqn] for fqn in sorted(merged)}


def _settings_by_fqn(snap: dict[str, Any]) -> dict[str, Any]:
    merged = {fqn: settings for groups in snap["groups"].values() for settings, fqns in groups for fqn in fqns}
    return {fqn: merged[fqn] for fqn in sorted(merged)}


def assert_snapshots_equal(
    a: dict[str, Any],
    b: dict[str, Any],
    where: str = "snapshot",
    *,
    layout: bool = True,
    params: bool = True,
    state_key_order: bool = True,
) -> None:
    """Assert two :func:`full_snapshot` results are exactly equal (``helpers.assert_deep_equal``:
    types, dtypes, shapes, devices, ``torch.equal`` values; NaN equals NaN only in a state's
    Python floats).

    ``layout=True``: the same leaves, each with the same groups (settings, FQNs, in order) and the
    same state by FQN. ``layout=False`` (a checkpoint loaded into another layout): per FQN only --
    the same state and the same group settings, whichever leaf and group hold the parameter.
    ``params``: the same full parameter values too. ``state_key_order=False``: the keys within
    one parameter's state may come in another order (after a multi-rank DCP save they follow
    DCP's metadata, as a DCP load does).
    """
    if params:
        assert_deep_equal(a["params"], b["params"], f"{where}: params", nan_equal="none")
    if layout:
        assert_deep_equal(a["groups"], b["groups"], f"{where}: groups", nan_equal="none")
        assert list(a["state"]) == list(b["state"]), f"{where}: leaves {list(a['state'])} vs {list(b['state'])}"
        pairs = [(f"{where}: state of leaf {leaf!r}", a["state"][leaf], b["state"][leaf]) for leaf in a["state"]]
    else:
        assert_deep_equal(_settings_by_fqn(a), _settings_by_fqn(b), f"{where}: settings", nan_equal="none")
        pairs = [(f"{where}: state", _state_by_fqn(a), _state_by_fqn(b))]
    for place, sa, sb in pairs:
        assert list(sa) == list(sb), f"{place}: FQNs {list(sa)} vs {list(sb)}"
        assert_deep_equal(sa, sb, place, check_order=state_key_order, nan_equal="floats")


__all__ = [
    "DIM",
    "HEAD_LR",
    "DefaultMeshForbidden",
    "FsdpNet",
    "assert_snapshots_equal",
    "assert_state_placed_like_params",
    "build_fsdp",
    "cpu_mesh",
    "forbid_default_mesh",
    "free_port",
    "full_copy",
    "full_snapshot",
    "guarded",
    "run_ranks",
    "train_body",
    "trained_fsdp",
]
