"""What each method of the bench runs, on which inputs.

:class:`FixtureContext` prepares, once per fixture and untimed, the inputs the methods
(:mod:`.methods`) need (the floor's packed dict, the sparse dicts, DSD's input, the core functions'
arguments, DCP directories); :func:`runner_for` turns a method into the ``(call, setup)`` pair that
:func:`.timing.time_method` times (e.g. a new, stateless load target as untimed set-up).

DCP is measured for five dicts: the sparse dict in both formats, whole (``all``) and its param
groups alone (``groups``); the whole optimizer through :class:`sparse_ckpt.SparseOptimizerState`
and :class:`sparse_ckpt.SparseLoadPlanner` (``packed/stateful``: what a user of the library runs);
and the *naive layout* (``naive/all``): ``dcp.save({"optim": fqn-keyed optimizer.state_dict()})``,
what a user writes without sparse_ckpt (see :func:`naive_state_dict`).
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from types import ModuleType
from typing import Any

import torch

import sparse_ckpt as sc
from sparse_ckpt import _backend, _core_py, export
from sparse_ckpt._format.tensor_parts import parts_to_tensor, tensor_to_parts
from sparse_ckpt._fqn import build_fqn_map
from sparse_ckpt._load.decode import decode_checkpoint

from .fixtures import ADAMW_KWARGS, Fixture, build_adamw, fill_state
from .methods import FIRST_CALL, NAIVE, STATEFUL, Method
from .timing import Runner

LEAF = "optim"
"""The key the bench's optimizer is saved under (DCP dicts, the core functions' leaf, the export)."""
EXPORT_SOURCE = f"packed_{STATEFUL}"
"""The DCP checkpoint an export is made from: the ``dcp/save/packed/stateful`` one."""

# --------------------------------------------------------------------------- backends


def backend_modules() -> dict[str, ModuleType | str]:
    """``{"python": module, "cpp": module or the reason it is unavailable}``."""
    out: dict[str, ModuleType | str] = {"python": _core_py}
    try:
        out["cpp"] = importlib.import_module("sparse_ckpt._C")
    except ImportError as exc:
        out["cpp"] = f"sparse_ckpt._C is not importable: {exc}"
    return out


@contextmanager
def use_backend(name: str, module: ModuleType) -> Iterator[None]:
    """Swap sparse_ckpt's core for the duration (in-process, as the test suite does)."""
    saved = (_backend.core, _backend.NAME)
    _backend.core, _backend.NAME = module, name
    try:
        yield
    finally:
        _backend.core, _backend.NAME = saved


# --------------------------------------------------------------------------- DSD (isolated imports)


def dsd_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(get, set)`` wrappers of torch DSD with ``flatten_optimizer_state_dict=True``.

    All DSD imports live here so that the rest of the bench does not depend on them.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def get(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return get_optimizer_state_dict(model, optimizer, options=options)

    def set_(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(model, optimizer, state_dict, options=options)

    return get, set_


def dsd_sparse_roundtrip_probe(fx: Fixture) -> str:
    """Can DSD set load DSD get's dict of a *sparse* optimizer into a fresh one? ``"ok"`` or the error."""
    get, set_ = dsd_functions()
    try:
        sd = get(fx.model, fx.optimizer)
        set_(fx.model, fx.new_optimizer(), sd)
    except Exception as exc:  # noqa: BLE001 - reported, not handled
        return f"fails: {type(exc).__name__}: {exc}"
    return "ok"


# --------------------------------------------------------------------------- DCP


def dcp_save(state_dict: dict[str, Any], path: str) -> None:
    """``dcp.save`` to ``path`` without a process group."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path))


def dcp_load(state_dict: dict[str, Any], path: str, planner: Any = None) -> None:
    """``dcp.load`` from ``path`` into ``state_dict`` without a process group."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), planner=planner)


def naive_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The naive layout: ``optimizer.state_dict()`` with parameter ids replaced by FQNs.

    ``{"state": {fqn: {"step": ..., "exp_avg": ..., ...}}, "param_groups": [{..., "params": [fqn, ...]}]}``
    is what a user writes without sparse_ckpt (``dcp.save({"optim": naive_state_dict(...)})``). DCP
    flattens it to one item per state value, ``optim.state.{fqn}.{key}`` (``step`` included), and one
    item per group key, ``optim.param_groups.{i}.{key}`` (``params``, the FQN list, is one item).
    """
    fqn_of = {id(p): name for name, p in model.named_parameters()}
    order = [fqn_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.state_dict()  # torch numbers the parameters in param_groups order
    return {
        "state": {order[i]: dict(s) for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def naive_items(optimizer: torch.optim.Optimizer) -> int:
    """DCP items of :func:`naive_state_dict` (one per state value, one per group key), without building it."""
    return sum(len(s) for s in optimizer.state.values()) + sum(len(g) for g in optimizer.param_groups)


def nested_load_target(value: Any) -> Any:
    """A DCP load target shaped like ``value``: fresh tensors; other leaves kept as placeholders."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: nested_load_target(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nested_load_target(v) for v in value]
    return value


def dcp_stats(path: str) -> dict[str, int]:
    """Number of DCP items (entries of the metadata) and bytes on disk of a checkpoint."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata()
    return {"items": len(meta.state_dict_metadata), "bytes": dir_bytes(path)}


def silence_known_warnings() -> None:
    """DCP warns that it runs without a process group; that is intended here."""
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


# --------------------------------------------------------------------------- per-fixture inputs


class _SparseDicts(dict):
    """``{format: sparse_state_dict(model, optimizer, format=format)}``, each made when first asked for."""

    def __init__(self, fx: Fixture) -> None:
        super().__init__()
        self.fx = fx

    def __missing__(self, fmt: str) -> dict[str, Any]:
        sd = self[fmt] = sc.sparse_state_dict(self.fx.model, self.fx.optimizer, format=fmt)  # type: ignore[arg-type]
        return sd


@dataclass
class FixtureContext:
    """Untimed inputs for every method of one fixture (computed lazily, once)."""

    fx: Fixture
    tmp_root: str
    device: str = "cpu"
    _dirs: dict[str, str] = field(default_factory=dict)

    @cached_property
    def floor_packed(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` of the source optimizer."""
        return self.fx.optimizer.state_dict()

    @cached_property
    def sparse(self) -> _SparseDicts:
        """``sparse[fmt]``: the sparse dict of the source optimizer in format ``fmt``, made on first use by
        the active core (both cores give the same dict)."""
        return _SparseDicts(self.fx)

    @cached_property
    def naive(self) -> dict[str, Any]:
        """What the naive layout saves: ``{"optim": naive_state_dict(model, optimizer)}``."""
        return {LEAF: naive_state_dict(self.fx.model, self.fx.optimizer)}

    def dcp_input(self, fmt: str, part: str) -> dict[str, Any]:
        """The dict DCP saves: the whole sparse dict or its param-group entries alone, or the naive dict.

        (``packed/stateful`` saves a ``SparseOptimizerState``, whose ``state_dict()`` DCP calls; its
        entries are those of the packed sparse dict.)
        """
        if fmt == NAIVE:
            return self.naive
        sd = self.sparse[fmt]
        if part == "groups":
            return {k: v for k, v in sd.items() if not k.startswith("state.")}
        return sd

    def dcp_entries(self, fmt: str, part: str) -> int:
        """How many entries (DCP items, about) the DCP figure ``fmt/part`` writes, for ``--dcp-max-items``."""
        if fmt == NAIVE:
            return naive_items(self.fx.optimizer)
        return len(self.dcp_input(fmt, part))

    @cached_property
    def dense_twin_dsd(self) -> dict[str, Any]:
        """DSD get of a twin optimizer with state on *every* parameter (DSD set's input).

        DSD set cannot load what DSD get wrote for a sparse optimizer (see
        :func:`dsd_sparse_roundtrip_probe`), so its timing uses a dense checkpoint.
        """
        get, _ = dsd_functions()
        twin = build_adamw(self.fx.specs, **ADAMW_KWARGS)
        fill_state(twin, [p for g in twin.param_groups for p in g["params"]])
        return get(self.fx.model, twin)

    @cached_property
    def core_inputs(self) -> dict[str, Any]:
        """Arguments of the core functions, computed with the python core."""
        opt = self.fx.optimizer
        fmap = build_fqn_map(self.fx.model)
        c = _core_py
        groups, state, ids = c.pack_optimizer(LEAF, opt.param_groups, opt.state, torch.Tensor)
        groups_fqn, state_fqn = c.remap_to_fqns(LEAF, groups, state, ids, fmap.fqn_of)
        table = c.encode_table(LEAF, groups_fqn, torch.Tensor, tensor_to_parts)
        with use_backend("python", _core_py):
            ckpt = decode_checkpoint(self.sparse["packed"], fmap)
        target = [[fmap.fqn_of[id(p)] for p in g["params"]] for g in opt.param_groups]
        return {
            "opt": opt,
            "fmap": fmap,
            "groups": groups,
            "state": state,
            "ids": ids,
            "groups_fqn": groups_fqn,
            "state_fqn": state_fqn,
            "table": table,
            "target": target,
            "settings_of": ckpt.settings_of,
            "state_of": ckpt.state_of,
        }

    def new_dir(self, key: str) -> str:
        """A fresh empty directory for one DCP save of ``key``; the previous one is removed."""
        old = self._dirs.get(key)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        path = tempfile.mkdtemp(prefix=f"{key.replace('/', '_')}_", dir=self.tmp_root)
        self._dirs[key] = path
        return path

    def saved_dir(self, key: str) -> str | None:
        """The directory of the last DCP save of ``key``."""
        return self._dirs.get(key)

    def close(self) -> None:
        """Remove every DCP directory."""
        for path in self._dirs.values():
            shutil.rmtree(path, ignore_errors=True)
        self._dirs.clear()

    def load_target(self, sd: dict[str, Any]) -> dict[str, Any]:
        """A DCP load target shaped like ``sd``: fresh tensors, non-tensor values as placeholders."""
        return nested_load_target(sd)


def runner_for(m: Method, ctx: FixtureContext, core: ModuleType | None) -> Runner:
    """The timed call (and its untimed per-sample set-up) for method ``m`` on ``ctx``."""
    fx = ctx.fx
    if m.family == "floor":
        if m.op == "state_dict":
            return (lambda _: fx.optimizer.state_dict()), None
        packed = ctx.floor_packed
        return (lambda target: target.load_state_dict(packed)), fx.new_optimizer
    if m.family == "sparse":
        fmt = m.fmt or "packed"
        first = m.part == FIRST_CALL  # no kept FQN map: cleared (untimed) before each sample
        if m.op == "save":
            return (lambda _: sc.sparse_state_dict(fx.model, fx.optimizer, format=fmt)), (  # type: ignore[arg-type]
                sc.clear_fqn_cache if first else None
            )
        sd = ctx.sparse[fmt]

        def fresh_target() -> Any:
            if first:
                sc.clear_fqn_cache()
            return fx.new_optimizer()

        return (lambda target: sc.load_sparse_state_dict(fx.model, target, sd)), fresh_target
    if m.family == "dsd":
        get, set_ = dsd_functions()
        if m.op == "get":
            return (lambda _: get(fx.model, fx.optimizer)), None
        dense = ctx.dense_twin_dsd
        return (lambda target: set_(fx.model, target, dense)), fx.new_optimizer
    if m.family == "dcp":
        key = f"{m.fmt}_{m.part}"
        if m.part == STATEFUL:
            return _stateful_runner(m, ctx, key)
        sd = ctx.dcp_input(m.fmt or "packed", m.part or "all")
        if m.op == "save":
            return (lambda path: dcp_save(sd, path)), (lambda: ctx.new_dir(key))

        def load_setup() -> tuple[dict[str, Any], str]:
            path = ctx.saved_dir(key)
            if path is None:
                path = ctx.new_dir(key)
                dcp_save(sd, path)
            return ctx.load_target(sd), path

        return (lambda arg: dcp_load(*arg)), load_setup
    if m.family == "export":
        return _export_runner(m, ctx)
    if m.family == "core":
        assert core is not None
        return _core_runner(m, ctx, core), None
    raise ValueError(f"unknown method {m.id}")


def _stateful_runner(m: Method, ctx: FixtureContext, key: str) -> Runner:
    """The whole optimizer through the library's DCP API (default core backend), as a user runs it.

    Save: ``dcp.save({"optim": SparseOptimizerState(model, optimizer)})`` (DCP calls its
    ``state_dict()``, i.e. ``sparse_state_dict``, inside the timed call). Load:
    ``dcp.load({"optim": SparseOptimizerState(model, fresh)}, planner=SparseLoadPlanner())``: the
    planner builds the target from the checkpoint's metadata, DCP reads, and ``load_state_dict``
    restores the fresh optimizer (built untimed), all timed.
    """
    fx = ctx.fx

    def save(path: str) -> None:
        dcp_save({LEAF: sc.SparseOptimizerState(fx.model, fx.optimizer)}, path)

    if m.op == "save":
        return save, (lambda: ctx.new_dir(key))

    def load_setup() -> tuple[dict[str, Any], str]:
        path = ctx.saved_dir(key)
        if path is None:
            path = ctx.new_dir(key)
            save(path)
        return {LEAF: sc.SparseOptimizerState(fx.model, fx.new_optimizer())}, path

    return (lambda arg: dcp_load(*arg, planner=sc.SparseLoadPlanner())), load_setup


def _export_runner(m: Method, ctx: FixtureContext) -> Runner:
    """The pickle-free export: ``export_checkpoint`` of the whole-optimizer DCP checkpoint
    (``dcp/save/packed/stateful``'s, saved untimed when that figure did not run) into a new
    directory; ``load_export`` of it into a fresh optimizer (built untimed)."""
    fx = ctx.fx

    def source() -> str:
        path = ctx.saved_dir(EXPORT_SOURCE)
        if path is None:
            path = ctx.new_dir(EXPORT_SOURCE)
            dcp_save({LEAF: sc.SparseOptimizerState(fx.model, fx.optimizer)}, path)
        return path

    if m.op == "save":
        return (lambda arg: export.export_checkpoint(*arg, key=LEAF)), (lambda: (source(), ctx.new_dir("export")))

    def load_setup() -> tuple[Any, str]:
        path = ctx.saved_dir("export")
        if path is None:
            path = ctx.new_dir("export")
            export.export_checkpoint(source(), path, key=LEAF)
        return fx.new_optimizer(), path

    return (lambda arg: export.load_export(fx.model, *arg)), load_setup


def dir_bytes(path: str) -> int:
    """Bytes of every file under ``path``."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _dirs, files in os.walk(path) for f in files)


def _core_runner(m: Method, ctx: FixtureContext, core: ModuleType) -> Callable[[Any], Any]:
    a = ctx.core_inputs
    op = m.op
    if op == "pack_optimizer":
        return lambda _: core.pack_optimizer(LEAF, a["opt"].param_groups, a["opt"].state, torch.Tensor)
    if op == "remap_to_fqns":
        return lambda _: core.remap_to_fqns(LEAF, a["groups"], a["state"], a["ids"], a["fmap"].fqn_of)
    if op == "flatten_state":
        return lambda _: core.flatten_state(LEAF, a["state_fqn"], a["fmap"].param_of, True)
    if op == "flatten_groups":
        return lambda _: core.flatten_groups(LEAF, a["groups_fqn"])
    if op == "encode_table":
        return lambda _: core.encode_table(LEAF, a["groups_fqn"], torch.Tensor, tensor_to_parts)
    if op == "decode_table":
        return lambda _: core.decode_table(LEAF, a["table"], parts_to_tensor)
    if op == "unflatten":
        sd = ctx.sparse[m.fmt or "packed"]
        return lambda _: core.unflatten(sd, a["fmap"].canonical)
    if op == "match_groups":
        return lambda _: core.match_groups(LEAF, a["target"], a["settings_of"])
    if op == "assign_state_ids":
        return lambda _: core.assign_state_ids(a["target"], a["state_of"])
    raise ValueError(f"unknown core function {op}")
