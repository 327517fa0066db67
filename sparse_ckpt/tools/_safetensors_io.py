"""The safetensors files of `sparse_ckpt.tools.export`: a streaming writer and the data order.

`write_safetensors` writes the header from the planned layout first, then each tensor as it
arrives (at its planned offset), so only one batch of state needs to be in memory. Measured at 61x256 with 64x64 weights
(747 MiB of state): the export's peak memory is less than half of what collecting every tensor
and calling ``safetensors.torch.save_file`` takes (bench/README.md, "Export memory").
`data_order` lists tensors in the order of their data (``safe_open`` lists them sorted),
which is the export's order (`sparse_ckpt.tools._export_order`).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import CheckpointFormatError

__all__ = ["ST_DTYPES", "data_order", "st_dtype", "write_safetensors"]

ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
"""torch dtype -> safetensors dtype name (the types safetensors >= 0.6 reads into torch)."""
MAX_HEADER = 100_000_000
"""safetensors refuses headers above 100 MB."""


def st_dtype(key: str, dtype: torch.dtype) -> str:
    """safetensors' name of ``dtype`` (`CheckpointFormatError` when it cannot hold it)."""
    name = ST_DTYPES.get(dtype)
    if name is None:
        raise CheckpointFormatError(f"state {key!r} has dtype {dtype}, which safetensors cannot hold")
    return name


def write_safetensors(
    path: str,
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str],
) -> int:
    """Stream ``tensors`` into a safetensors file laid out as ``layout``; returns the file's bytes.

    The header is built from ``layout`` up front, so tensors are written as they arrive and only
    one batch needs to be in memory. They may arrive in any order: each is written at its planned
    offset (in ``layout`` order they are written sequentially), so the file's bytes follow
    ``layout`` alone. Each planned tensor must arrive exactly once.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    planned: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
    offset = 0
    for name, dtype, shape in layout:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": st_dtype(name, dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
        planned[name] = (offset, dtype, shape)
        offset += n
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER:
        raise CheckpointFormatError(f"the safetensors header would take {len(raw)} bytes (limit {MAX_HEADER})")
    base = 8 + len(raw)
    written = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        at = base
        for name, tensor in tensors:
            want = planned.pop(name, None)
            if want is None or tensor.dtype != want[1] or tuple(tensor.shape) != want[2]:
                raise CheckpointFormatError(
                    f"internal: tensor {name!r} is not planned (or twice), or not as planned: {want}"
                )
            if tensor.numel():
                flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                if at != base + want[0]:
                    f.seek(base + want[0])
                f.write(flat.numpy().data)
                at = base + want[0] + flat.numel()
                written += flat.numel()
        if planned or written != offset:
            raise CheckpointFormatError("internal: fewer tensors written than planned")
        f.flush()
        os.fsync(f.fileno())
    return base + offset


def data_order(path: str, names: set[str]) -> list[str]:
    """``names`` in the order of their data in the file (``safe_open`` lists them sorted), which is
    the export's order: state keys of one parameter come back in their saved order."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))  # already validated by safe_open
    order = sorted(
        (k for k in header if k in names), key=lambda k: header[k]["data_offsets"][0]
    )  # stable: zero-size tensors keep their header order
    return order
