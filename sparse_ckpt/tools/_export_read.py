"""Reading an export back: the manifest and the safetensors file, checked against each other."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .._format.keys import PACKED_PREFIX, SCALARS_PREFIX, STATE_PREFIX
from ..errors import CheckpointFormatError
from ._export_format import EXPORT_FORMAT, EXPORT_VERSION, MANIFEST_FILE, TENSORS_FILE, _require_safetensors
from ._safetensors_io import data_order


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The export's manifest, checked for format and version (`CheckpointFormatError`)."""
    path = os.path.join(os.fspath(out_dir), MANIFEST_FILE)
    if not os.path.isfile(path):
        raise CheckpointFormatError(
            f"{os.fspath(out_dir)!r} has no {MANIFEST_FILE}: incomplete or not a sparse_ckpt export"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path!r} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        raise CheckpointFormatError(f"{path!r} is not a sparse_ckpt export manifest")
    if manifest.get("version") != EXPORT_VERSION:
        raise CheckpointFormatError(
            f"{path!r}: export version {manifest.get('version')!r} is not supported (this sparse_ckpt reads "
            f"{EXPORT_VERSION})"
        )
    tensors = manifest.get("tensors")
    if not (
        isinstance(tensors, dict) and tensors.get("file") == TENSORS_FILE and isinstance(tensors.get("bytes"), int)
    ):
        raise CheckpointFormatError(f"{path!r}: 'tensors' must name {TENSORS_FILE!r} and its size")
    if not isinstance(manifest.get("tables"), list) or not isinstance(manifest.get("values"), dict):
        raise CheckpointFormatError(f"{path!r}: 'tables' must be a list and 'values' an object")
    st_path = os.path.join(os.fspath(out_dir), TENSORS_FILE)
    size = os.path.getsize(st_path) if os.path.isfile(st_path) else None
    if size != tensors["bytes"]:
        what = "is missing" if size is None else f"has {size} bytes, the manifest says {tensors['bytes']}"
        raise CheckpointFormatError(f"{st_path!r} {what} (truncated or modified export)")
    return manifest


class _Tensors:
    """The export's safetensors file, opened lazily; every failure is a `CheckpointFormatError`."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        safetensors = _require_safetensors()
        self.path = os.path.join(os.fspath(out_dir), TENSORS_FILE)
        try:
            self._file = safetensors.safe_open(self.path, framework="pt", device="cpu")
            self._handle = self._file.__enter__()
            names = set(self._handle.keys())
            meta = self._handle.metadata() or {}
        except Exception as exc:  # noqa: BLE001 - SafetensorError and friends
            raise CheckpointFormatError(f"{self.path!r} is not a readable safetensors file ({exc})") from None
        self.keys = data_order(self.path, names)
        if meta.get("format") != EXPORT_FORMAT or meta.get("version") != str(EXPORT_VERSION):
            self.close()
            raise CheckpointFormatError(f"{self.path!r} is not a sparse_ckpt export (version {EXPORT_VERSION})")

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointFormatError(f"{self.path!r}: tensor {name!r} cannot be read ({exc})") from None

    def close(self) -> None:
        self._file.__exit__(None, None, None)


def _open(out_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], _Tensors, dict[str, bytes], list[str]]:
    """``(manifest, tensors file, tables, state tensor names)`` with names checked against the manifest."""
    manifest = read_manifest(out_dir)
    tensors = _Tensors(out_dir)
    try:
        table_keys = [t.get("key") for t in manifest["tables"] if isinstance(t, dict)]
        names = set(tensors.keys)
        for k in table_keys:
            if not isinstance(k, str) or not k.startswith(PACKED_PREFIX) or k not in names:
                raise CheckpointFormatError(f"{MANIFEST_FILE}: table {k!r} is not in {TENSORS_FILE}")
        state_names = [n for n in tensors.keys if not n.startswith(PACKED_PREFIX)]
        bad = [n for n in state_names if not n.startswith(STATE_PREFIX) or n.startswith(SCALARS_PREFIX)]
        bad += [n for n in tensors.keys if n.startswith(PACKED_PREFIX) and n not in table_keys]
        bad += [
            k
            for k in manifest["values"]
            if not k.startswith(STATE_PREFIX) or k.startswith(SCALARS_PREFIX) or k in names
        ]
        if bad:
            raise CheckpointFormatError(f"{TENSORS_FILE}/{MANIFEST_FILE}: unexpected or duplicate entry {bad[0]!r}")
        tables: dict[str, bytes] = {}
        for k in table_keys:
            t = tensors.get(k)
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise CheckpointFormatError(f"{TENSORS_FILE}: table {k!r} is not a 1-d uint8 tensor")
            tables[k] = t.numpy().tobytes()
    except BaseException:
        tensors.close()
        raise
    return manifest, tensors, tables, state_names
