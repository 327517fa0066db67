"""Devices of the bench and the resume drill: ``--device cpu|cuda|npu``.

:func:`check_device` makes sure a device of the kind is present (for ``npu``, importing the module
that registers it -- ``torch_npu``, or the one ``SPARSE_CKPT_NPU_MODULE`` names -- only when no
``npu`` device type is registered yet); :func:`device_count` counts them; :func:`check_world_sizes` refuses a
multi-rank run that
needs more accelerators than the machine has (one rank per GPU/NPU). For the ranks themselves:
:func:`process_group_backend` (Gloo on CPU, NCCL on CUDA, HCCL on NPU), :func:`bind_rank` (the
rank's device), :func:`current_device` and :func:`synchronize`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any

import torch

DEVICES = ("cpu", "cuda", "npu")
PROCESS_GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""The ``torch.distributed`` backend of a run on each kind of device."""


class DeviceUnavailable(RuntimeError):
    """The requested ``--device`` cannot be used on this machine."""


NPU_MODULE_ENV = "SPARSE_CKPT_NPU_MODULE"
"""Names the module that registers the ``npu`` device type when none is registered (default
``torch_npu``, Ascend's; the tests' emulated device is ``emulated_npu``, tests/accelerator)."""


def npu_registered() -> bool:
    """Whether a ``npu`` device type exists in this process (PrivateUse1 renamed and a ``torch.npu`` module)."""
    try:
        torch.device("npu")  # parses only once a backend has claimed the name (PrivateUse1 renamed)
    except RuntimeError:
        return False
    return getattr(torch, "npu", None) is not None


def import_npu() -> None:
    """Register the ``npu`` device type: import ``$SPARSE_CKPT_NPU_MODULE`` (default ``torch_npu``)
    unless one is registered already. Raises :class:`DeviceUnavailable` when the import fails."""
    if npu_registered():
        return
    module = os.environ.get(NPU_MODULE_ENV) or "torch_npu"
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise DeviceUnavailable(f"--device npu: {module} is not importable ({exc})") from None
    if not npu_registered():
        raise DeviceUnavailable(f"--device npu: importing {module} registered no 'npu' device type")


def _accelerator_module(name: str) -> Any:
    """The device module of ``name`` (``torch.cuda``, ``torch.npu``: ``torch.get_device_module``),
    registering ``npu`` first when needed (:func:`import_npu`)."""
    if name == "npu":
        import_npu()
    return torch.get_device_module(name)


def check_device(name: str) -> None:
    """Import what ``name`` needs and make sure one such device is present."""
    if name == "cpu":
        return
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable("--device cuda: torch.cuda.is_available() is False (no GPU or a CPU-only torch)")
        return
    if name == "npu":
        import_npu()
        if not torch.get_device_module("npu").is_available():
            raise DeviceUnavailable("--device npu: the npu device type is registered but no NPU is available")
        return
    raise DeviceUnavailable(f"unknown device {name!r}")


def device_count(name: str) -> int | None:
    """How many ``name`` devices this machine has; ``None`` for ``cpu`` (ranks share the cores).

    Does not initialise CUDA (``torch.cuda.device_count`` is safe before processes start).
    """
    if name == "cpu":
        return None
    check_device(name)
    return int(_accelerator_module(name).device_count())


def check_world_sizes(name: str, sizes: Iterable[int]) -> None:
    """Refuse world sizes that need more ``name`` devices than present (one rank per GPU/NPU)."""
    wanted = max(sizes)
    have = device_count(name)
    if have is not None and wanted > have:
        unit = "GPU" if name == "cuda" else "NPU"
        raise DeviceUnavailable(
            f"--device {name} runs one rank per {unit}: a world size of {wanted} needs {wanted} {unit}s, this machine "
            f"has {have} (torch.{name}.device_count()); use --nproc and --resume-sizes of at most {have}"
        )


def process_group_backend(name: str) -> str:
    """The ``torch.distributed`` backend of a run on ``name``: :data:`PROCESS_GROUP_BACKENDS`, unless the
    ``npu`` device module names its own (``torch.npu.process_group_backend``: the emulated npu's ``npu_gloo``)."""
    if name == "npu":
        return str(getattr(_accelerator_module(name), "process_group_backend", PROCESS_GROUP_BACKENDS[name]))
    return PROCESS_GROUP_BACKENDS[name]


def bind_rank(name: str, rank: int) -> torch.device:
    """Make rank ``rank``'s device current (``cuda:<rank>`` / ``npu:<rank>``; CPU: nothing) and return it.

    On CUDA also asks torch for deterministic kernels (``warn_only``: an op without one warns) and sets
    ``CUBLAS_WORKSPACE_CONFIG`` for cuBLAS, so a run repeats bit for bit; call it before any CUDA work.
    """
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    _accelerator_module(name).set_device(rank)
    return torch.device(name, rank)


def synchronize(name: str) -> None:
    """Wait for the work queued on the current ``cuda``/``npu`` device (CPU: nothing), before reading a clock."""
    if name != "cpu":
        _accelerator_module(name).synchronize()


def device_name(name: str) -> str | None:
    """The name of the current ``name`` device (``get_device_name`` of its device module); ``None`` on the CPU."""
    if name == "cpu":
        return None
    get = getattr(_accelerator_module(name), "get_device_name", None)
    return str(get()) if get is not None else None


def current_device(name: str) -> torch.device:
    """The device a rank computes on: ``cpu``, or the current ``cuda``/``npu`` device."""
    if name == "cpu":
        return torch.device("cpu")
    return torch.device(name, _accelerator_module(name).current_device())


__all__ = [
    "DEVICES",
    "PROCESS_GROUP_BACKENDS",
    "DeviceUnavailable",
    "bind_rank",
    "check_device",
    "check_world_sizes",
    "current_device",
    "device_count",
    "device_name",
    "import_npu",
    "npu_registered",
    "process_group_backend",
    "synchronize",
]
