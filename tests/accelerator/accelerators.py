"""The accelerator types the device tests run on, each skipped with its reason where absent.

``cuda`` where ``torch.cuda.is_available()``; ``npu`` where an ``npu`` device type is registered or
registers on import: ``torch_npu`` on Ascend machines, or the module that ``SPARSE_CKPT_NPU_MODULE``
names (``.ci/npu.sh`` sets ``emulated_npu``: tests/accelerator/emulated_npu.py, PrivateUse1 in host
memory renamed ``npu``). The same lookup as the bench's (``bench.suite.devices.check_device``).

``SPARSE_CKPT_TEST_DEVICE`` narrows the list: ``cuda`` or ``npu`` runs that type only; ``cpu`` runs
the modules on the CPU instead (their dry run, for a machine without an accelerator: the dry run of
``bench/device_check.sh --device cpu`` does it).
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.suite.devices import DeviceUnavailable, check_device

DEVICE_TYPES = ("cuda", "npu")
CHOSEN = os.environ.get("SPARSE_CKPT_TEST_DEVICE", "")


def skip_reason(device_type: str) -> str | None:
    """Why ``device_type`` cannot run here (``None`` when it can)."""
    if device_type == "cpu":
        return None
    try:
        check_device(device_type)
    except DeviceUnavailable as exc:
        how = (
            "run it on a GPU machine, e.g. with bench/device_check.sh"
            if device_type == "cuda"
            else "install torch_npu on an Ascend machine, or run .ci/npu.sh (the emulated npu device)"
        )
        return f"{exc}; {how}"
    return None


def device_types() -> list[str]:
    """The types the tests are parametrised over (:data:`CHOSEN` narrows them)."""
    if CHOSEN == "cpu":
        return ["cpu"]
    if CHOSEN:
        if CHOSEN not in DEVICE_TYPES:
            raise ValueError(f"SPARSE_CKPT_TEST_DEVICE={CHOSEN!r}: use one of {DEVICE_TYPES} or 'cpu'")
        return [CHOSEN]
    return list(DEVICE_TYPES)


def params() -> list:
    """``pytest.param`` per type in :func:`device_types`, skipped with :func:`skip_reason` where absent."""
    out = []
    for t in device_types():
        reason = skip_reason(t)
        out.append(pytest.param(t, id=t, marks=[pytest.mark.skipif(reason is not None, reason=reason or "")]))
    return out


def on_accelerator(device_type: str) -> bool:
    """Whether ``device_type`` is an accelerator (not the CPU dry run)."""
    return device_type != "cpu" and torch.device(device_type).type != "cpu"
