"""The few private torch attributes sparse_ckpt must touch, isolated in one place.

torch exposes ``register_*_hook`` but no public way to enumerate an optimizer's registered
state-dict hooks; reproducing ``Optimizer.state_dict``/``load_state_dict`` faithfully needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _backend


def state_dict_pre_hooks(opt: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The optimizer's ``state_dict`` pre-hooks, in call order."""
    return list(getattr(opt, "_optimizer_state_dict_pre_hooks", {}).values())


def state_dict_post_hooks(opt: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The optimizer's ``state_dict`` post-hooks, in call order."""
    return list(getattr(opt, "_optimizer_state_dict_post_hooks", {}).values())


def load_state_dict_pre_hooks(opt: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The optimizer's ``load_state_dict`` pre-hooks, in call order."""
    return list(getattr(opt, "_optimizer_load_state_dict_pre_hooks", {}).values())


def load_state_dict_post_hooks(opt: torch.optim.Optimizer) -> list[Callable[..., Any]]:
    """The optimizer's ``load_state_dict`` post-hooks, in call order."""
    return list(getattr(opt, "_optimizer_load_state_dict_post_hooks", {}).values())


def tensor_version(value: Any) -> int | None:
    """A tensor's version counter (bumped by every in-place change), ``None`` for other values."""
    return value._version if isinstance(value, torch.Tensor) else None


_BASE_NAMED_MODULES = torch.nn.Module.named_modules
_BASE_NAMED_PARAMETERS = torch.nn.Module.named_parameters


def map_parameters(
    model: torch.nn.Module, stripped: frozenset[str], module_wrapper: type | None, cached: tuple | None
) -> tuple[tuple | None, dict[int, str], dict[str, str], dict[str, torch.Tensor]] | None:
    """The core's ``map_parameters``: the FQN map from one iterative walk over
    ``Module._modules``/``Module._parameters`` (or a replay of ``cached``), in
    ``model.named_parameters(remove_duplicate=False)`` order. ``named_modules`` is a recursive
    generator whose cost per module grows with depth, which at 100 000+ modules dominated
    ``sparse_state_dict``. Returns ``None`` when the model or a submodule overrides
    ``named_parameters``/``named_modules``; the caller then uses the public API.
    """
    return _backend.core.map_parameters(
        model, stripped, module_wrapper, _BASE_NAMED_MODULES, _BASE_NAMED_PARAMETERS, cached
    )


def _dcp_code(module: str, name: str) -> Any:
    """The code object of ``torch.distributed.checkpoint.{module}.{name}`` (unwrapped), or ``None``."""
    try:
        import importlib
        import inspect

        mod = importlib.import_module(f"torch.distributed.checkpoint.{module}")
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    fn = getattr(mod, name, None)
    return getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None


_DCP_LOAD_CODE = _dcp_code("state_dict_loader", "load")


def called_by_dcp_load(frame: Any) -> bool:
    """``True`` when ``frame`` is ``torch.distributed.checkpoint.load`` itself: a ``Stateful``'s
    ``state_dict()`` called from there builds a *load target* (which DCP then plans and fills),
    not a dict to save. ``False`` whenever that cannot be told (another torch layout): the caller
    then does what it does for a save, which is always correct, only slower."""
    return _DCP_LOAD_CODE is not None and frame is not None and frame.f_code is _DCP_LOAD_CODE


_DCP_SAVE_CODES = frozenset(
    code for code in (_dcp_code("state_dict_saver", name) for name in ("save", "async_save")) if code is not None
)
"""The code objects of ``torch.distributed.checkpoint.save`` and ``async_save`` (unwrapped)."""
_SAVE_FRAMES = 12
"""How far up the stack a ``Stateful.state_dict()`` looks for the ``dcp.save`` that called it
(through DCP's ``_stateful_to_state_dict``, its loggers, and ``MultiOptimizer.state_dict``)."""


def saved_by_dcp_with_all_ranks(frame: Any) -> bool:
    """``True`` when ``frame`` (or one of its callers, a few frames up) is
    ``torch.distributed.checkpoint.save``/``async_save`` running with collectives over the default
    process group: every rank of it is then inside the same ``Stateful.state_dict()`` call, so a
    collective there is safe. ``False`` whenever that cannot be told (another torch layout, a
    save over another process group, ``no_dist``, ``use_collectives=False``): the caller then
    does not coordinate, which is always correct (keys by content digest), only not cacheable."""
    import torch.distributed as dist

    f = frame
    for _ in range(_SAVE_FRAMES):
        if f is None:
            return False
        if f.f_code in _DCP_SAVE_CODES:
            local = f.f_locals
            group = local.get("process_group")
            return (
                not local.get("no_dist", False)
                and local.get("use_collectives", True) is True
                and dist.is_available()
                and dist.is_initialized()
                and (group is None or group is dist.group.WORLD)
            )
        f = f.f_back
    return False


_DCP_LOAD_STATE_DICT_CODE = _dcp_code("state_dict_loader", "_load_state_dict")
"""The code object of DCP's ``_load_state_dict`` (what ``dcp.load`` runs its planner in)."""
_LOAD_FRAMES = 8


def dcp_storage_reader(frame: Any) -> Any:
    """The ``StorageReader`` of the DCP load whose planner is being set up (``frame``: the caller
    of ``set_up_planner``), found a few frames up in DCP's ``_load_state_dict``; ``None`` when it
    cannot be found (another torch layout, or a planner used outside ``dcp.load``). DCP exposes no
    public way to reach it; sparse_ckpt uses it to read, during the same load, the buffer items
    it could not plan before the layout tables were read (``state_layout="buffers"``)."""
    f = frame
    for _ in range(_LOAD_FRAMES):
        if f is None or _DCP_LOAD_STATE_DICT_CODE is None:
            return None
        if f.f_code is _DCP_LOAD_STATE_DICT_CODE:
            reader = f.f_locals.get("storage_reader")
            return reader if callable(getattr(reader, "read_data", None)) else None
        f = f.f_back
    return None


# --------------------------------------------------------------------------- torch DSD (integrations.dsd)

DSD_CHECKED = "2.13.0"
"""The torch version whose DSD (``torch.distributed.checkpoint.state_dict``) and DCP load planner
:mod:`sparse_ckpt.integrations.dsd` was written and tested against; ``install()`` checks the
signatures below rather than the version, so a later torch with the same DSD keeps working."""

DSD_SIGNATURES: dict[str, tuple[str, ...]] = {
    "get_optimizer_state_dict": ("model", "optimizers", "submodules", "options"),
    "set_optimizer_state_dict": ("model", "optimizers", "optim_state_dict", "options"),
    "get_state_dict": ("model", "optimizers", "submodules", "options"),
    "set_state_dict": ("model", "optimizers", "model_state_dict", "optim_state_dict", "options"),
}
"""Parameter names of the torch DSD functions that ``integrations.dsd`` replaces (as in torch 2.13.0)."""

DSD_OPTIONS = (
    "full_state_dict",
    "cpu_offload",
    "ignore_frozen_params",
    "keep_submodule_prefixes",
    "strict",
    "broadcast_from_rank0",
    "flatten_optimizer_state_dict",
)
"""The ``StateDictOptions`` fields ``integrations.dsd`` reads (``dsd_fqn_modifiers`` is read when present)."""


def gather_full_state_dict(state_dict: dict[str, Any], *, cpu_offload: bool, ranks_only: tuple[int, ...]) -> dict[str, Any]:
    """torch DSD's ``full_state_dict`` gathering: every DTensor as its full tensor (a collective per
    tensor, in the dict's order), on CPU with ``cpu_offload``, kept only on ``ranks_only`` (others get
    ``{}``) when given. torch's private ``_gather_state_dict`` (checked on torch 2.13.0), the same
    function DSD calls, so the result is DSD's."""
    from torch.distributed._state_dict_utils import _gather_state_dict

    return _gather_state_dict(state_dict, cpu_offload=cpu_offload, ranks_only=ranks_only)


def offload_state_dict_to_cpu(state_dict: dict[str, Any]) -> dict[str, Any]:
    """torch DSD's ``cpu_offload`` (without ``full_state_dict``): every tensor copied to CPU, DTensors
    keeping their placements. torch's private ``_offload_state_dict_to_cpu`` (checked on torch 2.13.0)."""
    from torch.distributed._state_dict_utils import _offload_state_dict_to_cpu

    return _offload_state_dict_to_cpu(state_dict)
