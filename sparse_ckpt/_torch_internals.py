"""The one door to torch internals: every private attribute, caller frame and private function
sparse_ckpt touches is read here, and only here.

Each access is listed in :data:`ACCESSES` with the torch versions it was checked on;
tests/core/test_torch_internals.py checks every one against the installed torch and fails loudly,
naming the access, when a torch release moves one. Where a public path exists the library takes
it instead (the checkpoint tools hand their storage reader to the item reader explicitly; only a
load planner inside ``dcp.load`` has to find it on the stack).

Why each is needed:

* an optimizer's registered ``state_dict``/``load_state_dict`` hooks: torch has ``register_*_hook``
  but no public way to enumerate them, and reproducing ``Optimizer.state_dict`` faithfully needs them;
* a tensor's ``_version`` counter: the only way to see that an adapter changed a state tensor in place;
* ``Module._modules``/``Module._parameters`` (read by the core's ``map_parameters``, handed the base
  ``named_modules``/``named_parameters`` from here): the FQN walk without a recursive generator;
* caller frames of DCP's ``load``, ``save``/``async_save`` and ``_load_state_dict``: whether a
  ``Stateful.state_dict()`` builds a load target or a dict to save, whether every rank of the
  default group saves together, and the ``StorageReader`` of the load a planner runs in;
* caller frames of Accelerate's ``save_custom_state`` (a rank-0-only pickle, refused);
* live frames of every thread: a capture of an optimizer already being captured (reentrancy);
* ``torch.Tensor._make_subclass`` and DCP's tensor protocol (``__create_chunk_list__``,
  ``__get_tensor_shard__``): the planner guard, and a DTensor's local chunk;
* the code objects of torch DSD's four optimizer-facing functions (``integrations.dsd.install()``
  swaps each one's ``__code__`` for a trampoline, so every binding of torch's function object is
  routed): they must stay plain Python functions without a closure (`DSD_SIGNATURES`);
* torch DSD's private ``_gather_state_dict``/``_offload_state_dict_to_cpu`` (``integrations.dsd``:
  ``full_state_dict`` and ``cpu_offload`` exactly as DSD does them);
* where a ``FileSystemReader`` keeps an item's bytes (its ``path`` and the metadata's private
  ``_StorageInfo`` records): a whole one-chunk tensor item read straight into its own tensor,
  without the copy into a second tensor that ``read_data`` makes (buffers-layout loads);
* the private names DCP's ``.metadata`` pickle refers to (``_MEM_FORMAT_ENCODING``, ``_StorageInfo``,
  ``torch.serialization._get_layout``): the restricted unpickler of `sparse_ckpt._dcp.safe_reader`
  resolves only those and the public metadata classes (`dcp_metadata_globals`);
* DCP's module flag ``_version._derived_version``: ``DefaultLoadPlanner.create_local_plan`` sets it to
  ``"2_3"`` (flatten as torch <= 2.3 did) around a probe for an old checkpoint and resets it without a
  ``finally``, so a ``KeyboardInterrupt`` in that window leaves every later flatten of every DCP
  load and save in the old layout; a load planner of the library clears a flag left so and
  restores it after the probe whatever happens (`dcp_flatten_as_saved`);
* the default process group's store (``distributed_c10d._get_default_store``): the bounded agreement
  of ``integrations.dsd``'s loads (`sparse_ckpt._dist.agree_on_refusal`) waits on the other ranks with
  a timeout of its own, which no collective of a Gloo or NCCL group offers without breaking the group.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from . import _backend
from ._process_group import initialised, is_default_group


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


def _dcp_load_frame(frame: Any) -> Any:
    """The frame of ``torch.distributed.checkpoint.load`` at ``frame`` or a few frames above it
    (:data:`_SAVE_FRAMES`: a ``Stateful.load_state_dict`` may be called through a container's);
    ``None`` when there is none."""
    f = frame
    for _ in range(_SAVE_FRAMES):
        if f is None or _DCP_LOAD_CODE is None:
            return None
        if f.f_code is _DCP_LOAD_CODE:
            return f
        f = f.f_back
    return None


def loaded_by_dcp_with_all_ranks(frame: Any) -> bool:
    """``True`` when ``frame`` (or one of its callers, a few frames up) is
    ``torch.distributed.checkpoint.load`` over the default process group (not ``no_dist``): every
    rank of it then calls the same ``Stateful.load_state_dict`` in the same order, so one
    collective there is safe. ``False`` whenever that cannot be told (the caller then does not
    coordinate: a refusal stays the refusing rank's own)."""
    f = _dcp_load_frame(frame)
    if f is None:
        return False
    local = f.f_locals
    return not local.get("no_dist", False) and initialised() and is_default_group(local.get("process_group"))


_DCP_SAVE_CODES = frozenset(
    code for code in (_dcp_code("state_dict_saver", name) for name in ("save", "async_save")) if code is not None
)
"""The code objects of ``torch.distributed.checkpoint.save`` and ``async_save`` (unwrapped)."""
_SAVE_FRAMES = 12
"""How far up the stack a ``Stateful.state_dict()`` looks for the ``dcp.save`` that called it
(through DCP's ``_stateful_to_state_dict``, its loggers, and ``MultiOptimizer.state_dict``)."""


def _dcp_save_frame(frame: Any) -> Any:
    """The frame of ``torch.distributed.checkpoint.save``/``async_save`` at ``frame`` or a few
    frames above it (:data:`_SAVE_FRAMES`); ``None`` when there is none."""
    f = frame
    for _ in range(_SAVE_FRAMES):
        if f is None:
            return None
        if f.f_code in _DCP_SAVE_CODES:
            return f
        f = f.f_back
    return None


def saved_by_dcp_with_all_ranks(frame: Any) -> bool:
    """``True`` when ``frame`` (or one of its callers, a few frames up) is
    ``torch.distributed.checkpoint.save``/``async_save`` running with collectives over the default
    process group: every rank of it is then inside the same ``Stateful.state_dict()`` call, so a
    collective there is safe. ``False`` whenever that cannot be told (another torch layout, a
    save over another process group, ``no_dist``, ``use_collectives=False``): the caller then
    does not coordinate, which is always correct (keys by content digest), only not cacheable."""
    f = _dcp_save_frame(frame)
    if f is None:
        return False
    local = f.f_locals
    return (
        not local.get("no_dist", False)
        and local.get("use_collectives", True) is True
        and initialised()
        and is_default_group(local.get("process_group"))
    )


_DCP_ASYNC_SAVE_CODE = _dcp_code("state_dict_saver", "async_save")


def saved_by_dcp_async(frame: Any) -> bool:
    """``True`` when ``frame`` (or one of its callers, a few frames up) is
    ``torch.distributed.checkpoint.async_save``, which stages (copies) the whole state dict before
    it returns: a ``state_layout="auto"`` save there buffers fewer tensors (a copy into a bucket
    would be a second copy). ``False`` for ``dcp.save`` and whenever it cannot be told (the
    blocking save's choice: always correct, only a different layout)."""
    f = _dcp_save_frame(frame)
    return f is not None and _DCP_ASYNC_SAVE_CODE is not None and f.f_code is _DCP_ASYNC_SAVE_CODE


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


def caller_frame(depth: int = 1) -> FrameType | None:
    """The frame ``depth`` calls above the caller of this function (``1``: the caller's caller)."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:  # pragma: no cover - the stack is not that deep
        return None


_ACCELERATE_CUSTOM_SAVE = ("accelerate.checkpointing", "save_custom_state")
"""The function of Accelerate (``save_state`` -> registered objects) that pickles ``obj.state_dict()``
of the main process only."""
_ACCELERATE_FRAMES = 4
"""How many callers of ``state_dict()`` are looked at (``MultiOptimizer.state_dict`` adds one)."""


def called_by_accelerate_custom_save(depth: int = 1) -> bool:
    """Whether one of the few callers above ``depth`` (``1``: the caller's caller) is Accelerate's
    ``save_custom_state`` (what ``register_for_checkpointing`` objects are saved by)."""
    frame = caller_frame(depth + 1)
    for _ in range(_ACCELERATE_FRAMES):
        if frame is None:
            return False
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == _ACCELERATE_CUSTOM_SAVE:
            return True
        frame = frame.f_back
    return False


_CAPTURES: list[object] = []
"""One token per capture in progress, in any thread. Only a hint for :func:`captured_elsewhere`
(while it holds one token, other threads' stacks need no scan): an interrupt that leaves a token
behind costs wider scans, never a wrong answer."""


class tracking_capture:  # a context manager, named like the functions that use it
    """``with tracking_capture():`` around a capture: counts it in :data:`_CAPTURES`."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = object()
        _CAPTURES.append(self._token)

    def __exit__(self, *exc: object) -> None:
        _CAPTURES.remove(self._token)


def captured_elsewhere(frame: FrameType, name: str, value: object) -> bool:
    """Whether a live frame other than ``frame`` runs ``frame``'s code with local ``name`` bound to
    ``value``: a hook that calls back into the same capture (this thread's stack), or another
    thread capturing it (other threads' stacks, scanned only while another capture is in progress,
    see :data:`_CAPTURES`). There is no "in progress" mark to take or release, so no interrupt, at
    any point, can leave one behind. Of two threads that overlap, the later one to start sees the
    earlier; both may."""
    code = frame.f_code
    frames = sys._current_frames().values() if len(_CAPTURES) > 1 else (sys._getframe(1),)
    f: FrameType | None = None
    try:
        for f in frames:
            while f is not None:
                if f.f_code is code and f is not frame and f.f_locals.get(name) is value:
                    return True
                f = f.f_back
        return False
    finally:
        # A local that refers to this call's own stack is a reference cycle (frame -> locals ->
        # frame): drop them, or every save leaves its whole call stack to the cyclic collector.
        del frames, f


def make_subclass(cls: type, data: torch.Tensor) -> torch.Tensor:
    """``torch.Tensor._make_subclass(cls, data)``: ``data`` as an instance of tensor subclass ``cls``."""
    return torch.Tensor._make_subclass(cls, data)


def local_chunk(dtensor: Any) -> Any:
    """The one ``ChunkStorageMetadata`` (offsets, sizes) of a DTensor's local shard, as DCP plans it
    (DCP's ``__create_chunk_list__`` protocol)."""
    (chunk,) = dtensor.__create_chunk_list__()
    return chunk


def file_item_location(
    storage_reader: Any, storage_info: Any, *, subclasses: bool = False
) -> tuple[str, int, int] | None:
    """``(file, offset, length)`` of the bytes of a DCP item (``storage_info``: its entry in the
    metadata's ``storage_data``) that ``storage_reader`` would read, when it is torch's own
    ``FileSystemReader`` or `sparse_ckpt.SafeFileSystemReader` (not another subclass, unless ``subclasses``:
    where a failed read is diagnosed)
    and the item was written without stream transforms; ``None`` otherwise (the caller then reads
    through ``read_data``)."""
    from torch.distributed.checkpoint import FileSystemReader

    kind = type(storage_reader)
    # SafeFileSystemReader (torch's reader, its files confined) says so itself: no import of it here
    own = (
        isinstance(storage_reader, FileSystemReader)
        if subclasses
        else kind is FileSystemReader or vars(kind).get("files_like_torchs_reader", False)
    )
    if not own or getattr(storage_info, "transform_descriptors", None):
        return None
    root = getattr(storage_reader, "path", None)
    rel = getattr(storage_info, "relative_path", None)
    offset, length = getattr(storage_info, "offset", None), getattr(storage_info, "length", None)
    if (
        not isinstance(root, (str, os.PathLike))
        or type(rel) is not str
        or type(offset) is not int
        or type(length) is not int
    ):
        return None
    return os.path.join(root, rel), offset, length


_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "MetadataIndex",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    # what torch < 2.2 wrote (TensorProperties lived with ShardedTensor's metadata); still importable
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties", "MEM_FORMAT_ENCODING"),
    "torch.serialization": ("_get_layout",),  # a torch.layout pickles as _get_layout("torch.strided")
}
"""Module -> the classes and functions of torch that a ``FileSystemWriter``'s ``.metadata`` pickle names."""


def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` for every torch class and function DCP's ``.metadata`` is made of
    (`_DCP_METADATA_CLASSES`: the metadata dataclasses, the private ``_MEM_FORMAT_ENCODING`` enum
    ``TensorProperties`` pickles its memory format as, the file system's private ``_StorageInfo``, and
    ``torch.serialization._get_layout``), those this torch has; ``torch.Size`` and dtypes are the
    caller's (public)."""
    import importlib

    found: dict[tuple[str, str], Any] = {}
    for module, names in _DCP_METADATA_CLASSES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:  # pragma: no cover - a torch without this module: its names are refused
            continue
        for name in names:
            obj = getattr(mod, name, None)
            if obj is not None:
                found[module, name] = obj
    return found


def _dcp_version_module() -> Any:
    """DCP's ``_version`` module when it has the ``_derived_version`` flag, else ``None``."""
    try:
        from torch.distributed.checkpoint import _version
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return _version if hasattr(_version, "_derived_version") else None


_DCP_VERSION = _dcp_version_module()


def dcp_flatten_flag() -> Any:
    """DCP's ``_version._derived_version``: ``None`` except inside ``DefaultLoadPlanner.create_local_plan``'s
    probe for a torch <= 2.3 checkpoint (``"2_3"``: ``flatten_state_dict`` then flattens the old way)."""
    return None if _DCP_VERSION is None else _DCP_VERSION._derived_version


def clear_dcp_flatten_flag() -> None:
    """Set DCP's ``_version._derived_version`` back to ``None``: its value outside the probe of
    ``DefaultLoadPlanner.create_local_plan``, which sets ``"2_3"`` and resets it without a ``finally``
    (a ``KeyboardInterrupt`` there leaves it set, and every later ``flatten_state_dict`` -- of every
    DCP load and save -- flattens as torch <= 2.3 did: ``Missing key in checkpoint state_dict``).
    Idempotent, one statement: safe to run twice from nested ``finally`` blocks."""
    if _DCP_VERSION is not None:
        _DCP_VERSION._derived_version = None


def dcp_flatten_as_saved(plan: Callable[[], Any]) -> Any:
    """``plan()`` (``DefaultLoadPlanner.create_local_plan``), with DCP's flatten flag cleared after it
    whatever happens: an interrupt inside DCP's probe for an old checkpoint, or at any line here, never
    leaves it set (the clear is written twice, nested, on the ``try`` lines: see `sparse_ckpt._gc`)."""
    try:
        return plan()  # fmt: skip - body on the try's line: its line event is protected
    finally:
        try: clear_dcp_flatten_flag()  # fmt: skip
        finally:
            clear_dcp_flatten_flag()  # fmt: skip - idempotent: redoes a clear the first did not finish


ACCESSES: dict[str, str] = {
    "torch.optim.Optimizer._optimizer_state_dict_pre_hooks": "2.13.0",
    "torch.optim.Optimizer._optimizer_state_dict_post_hooks": "2.13.0",
    "torch.optim.Optimizer._optimizer_load_state_dict_pre_hooks": "2.13.0",
    "torch.optim.Optimizer._optimizer_load_state_dict_post_hooks": "2.13.0",
    "torch.Tensor._version": "2.13.0",
    "torch.nn.Module._modules": "2.13.0",
    "torch.nn.Module._parameters": "2.13.0",
    "torch.Tensor._make_subclass": "2.13.0",
    "DTensor.__create_chunk_list__ (DCP's tensor protocol)": "2.13.0",
    (
        "torch.distributed.checkpoint.state_dict_loader.load (caller frame; locals process_group, no_dist)"
    ): "2.13.0, 2.7.0",
    (
        "torch.distributed.checkpoint.state_dict_saver.save/async_save "
        "(caller frame; locals process_group, no_dist, use_collectives)"
    ): "2.13.0",
    "torch.distributed.checkpoint.state_dict_saver.async_save (caller frame: a save that stages)": "2.13.0, 2.7.0",
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict (caller frame; local storage_reader)": "2.13.0",
    "accelerate.checkpointing.save_custom_state (caller frame)": "accelerate 1.15.0 on torch 2.13.0",
    "sys._getframe / sys._current_frames (CPython)": "CPython 3.11, torch 2.13.0",
    (
        "torch.distributed.checkpoint.state_dict.{get,set}_optimizer_state_dict/{get,set}_state_dict.__code__ "
        "(plain functions without a closure; integrations.dsd routes them)"
    ): "2.13.0, 2.7.0 (source)",
    "torch.distributed._state_dict_utils._gather_state_dict (integrations.dsd)": "2.13.0",
    "torch.distributed._state_dict_utils._offload_state_dict_to_cpu (integrations.dsd)": "2.13.0",
    (
        "FileSystemReader.path and _StorageInfo.relative_path/offset/length/transform_descriptors (item bytes)"
    ): "2.13.0, 2.7.0",
    "torch.distributed.checkpoint._version._derived_version (DefaultLoadPlanner's flatten flag)": "2.13.0",
    "DCP metadata pickle: metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, serialization._get_layout": "2.13.0",
    "torch.distributed.distributed_c10d._get_default_store (the bounded agreement)": "2.13.0",
}
"""Every torch internal the library touches -> the versions it was checked on.
tests/core/test_torch_internals.py checks each entry against the installed torch; CI runs it on
2.13.0 and on the floor, 2.7.0 (.ci/floor.sh; also passed on 2.7.1), so the entries the core suites
use hold on both (2.7's dcp.save/async_save have no ``use_collectives``, async_save no ``no_dist``:
read with their defaults)."""
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


def default_store() -> Any:
    """The default process group's ``Store`` (torch's private ``_get_default_store``, checked on torch
    2.13.0): what the bounded agreement of `sparse_ckpt._dist.agree_on_refusal` exchanges through."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def gather_full_state_dict(
    state_dict: dict[str, Any], *, cpu_offload: bool, ranks_only: tuple[int, ...]
) -> dict[str, Any]:
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
