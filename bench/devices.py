"""Devices of the bench and the resume drill: ``--device cpu|cuda|npu``.

:func:`check_device` makes sure a device of the kind is present (importing ``torch_npu`` for
``npu``); :func:`device_count` counts them; :func:`check_world_sizes` refuses a multi-rank run that
needs more accelerators than the machine has (one rank per GPU/NPU). For the ranks themselves:
:data:`PROCESS_GROUP_BACKENDS` (Gloo on CPU, NCCL on CUDA, HCCL on NPU), :func:`bind_rank` (the
rank's device), :func:`current_device` and :func:`synchronize`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

DEVICES = ("cpu", "cuda", "npu")
PROCESS_GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""The ``torch.distributed`` backend of a run on each kind of device."""


class DeviceUnavailable(RuntimeError):
    """The requested ``--device`` cannot be used on this machine."""


def _accelerator_module(name: str) -> Any:
    """``torch.cuda`` or ``torch.npu`` (importing ``torch_npu`` for the latter)."""
    if name == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    return getattr(torch, name)


def check_device(name: str) -> None:
    """Import what ``name`` needs and make sure one such device is present."""
    if name == "cpu":
        return
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable("--device cuda: torch.cuda.is_available() is False (no GPU or a CPU-only torch)")
        return
    if name == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise DeviceUnavailable(f"--device npu: torch_npu is not importable ({exc})") from None
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            raise DeviceUnavailable("--device npu: torch_npu is installed but no NPU is available")
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
    "synchronize",
]
