"""Tensor <-> ``(dtype, shape, device_type, raw bytes)`` for the group-table codec.

Both core backends call these two functions for tensors inside param-group settings (a tensor
learning rate, say). No pickle is involved: the bytes are the tensor's raw storage.
"""

from __future__ import annotations

import torch

CODEC_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
"""The dtypes the table codec holds, by the name a table stores (``"float32"``); the only list of them."""


def tensor_to_parts(t: torch.Tensor) -> tuple[str, tuple[int, ...], str, bytes]:
    """Describe ``t`` as dtype name, shape, device type and its raw little-endian bytes."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in CODEC_DTYPES:
        raise TypeError(f"tensor dtype {t.dtype} is not supported in param-group settings")
    local = t.detach()
    if hasattr(local, "full_tensor"):  # DTensor settings are replicated; store the full value
        local = local.full_tensor()
    cpu = local.to("cpu").contiguous()
    data = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return name, tuple(int(d) for d in cpu.shape), t.device.type, data


def parts_to_tensor(dtype: str, shape: tuple[int, ...], device_type: str, data: bytes) -> torch.Tensor:
    """Rebuild a tensor; it lands on ``device_type`` when that device is available, else CPU."""
    dt = CODEC_DTYPES.get(dtype)
    if dt is None:
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dt).element_size()
    if numel * itemsize != len(data):
        raise ValueError(f"{len(data)} bytes do not hold a {dtype} tensor of shape {shape}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dt).reshape(shape) if numel else torch.empty(shape, dtype=dt)
    if device_type != "cpu" and _device_available(device_type):
        t = t.to(device_type)
    return t


def _device_available(device_type: str) -> bool:
    mod = getattr(torch, device_type, None)
    is_available = getattr(mod, "is_available", None)
    try:
        return bool(is_available()) if callable(is_available) else False
    except Exception:  # noqa: BLE001 - a broken device backend means "not available"
        return False


def value_to_name(value: object) -> tuple[str, str] | None:
    """The table codec's *named value* of a group setting that is no number, string, sequence or
    tensor: ``("dtype", "bfloat16")`` for a ``torch.dtype``, ``("device", "cuda:0")`` for a
    ``torch.device``; ``None`` for anything else (refused at save)."""
    if isinstance(value, torch.dtype):
        return "dtype", str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return "device", str(value)
    return None


def name_to_value(kind: str, text: str) -> object:
    """The ``torch.dtype`` or ``torch.device`` of a named value (:func:`value_to_name`'s inverse)."""
    if kind == "dtype":
        dtype = getattr(torch, text, None) if text.isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError("no such torch dtype")
        return dtype
    return torch.device(text)
