"""The export's format, written once: its names and version, JSON values, and the manifest's
human-readable rendering of the group tables (specification: docs/export.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from .._layouts.bucketed import dtype_name
from ..errors import CheckpointFormatError
from ._reader import Group

EXPORT_FORMAT = "sparse_ckpt.export"
EXPORT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "optimizer.safetensors"


def _require_safetensors() -> Any:
    try:
        import safetensors
    except ImportError:
        raise ImportError("sparse_ckpt.export needs the safetensors package: pip install safetensors") from None
    return safetensors


# --------------------------------------------------------------------------- JSON values


def encode_value(key: str, value: Any) -> Any:
    """A non-tensor state value as exact JSON (tuples and non-finite floats tagged), or refuse it."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [encode_value(key, v) for v in value]
    if kind is tuple:
        return {"tuple": [encode_value(key, v) for v in value]}
    raise CheckpointFormatError(
        f"state value {key!r} is a {kind.__name__}: an export holds only tensors and JSON values "
        "(None, bool, int, float, str, lists and tuples of these)"
    )


def encode_setting(key: str, value: Any) -> Any:
    """A param-group setting as JSON, for the manifest's informational ``param_groups`` rendering.

    The encoding of `encode_value` (tuples and non-finite floats tagged), plus the other
    values a group table can hold: a tensor as ``{"tensor": dtype, "shape": [...], "values":
    [...]}`` (its elements flattened in row-major order, each encoded the same way; a complex
    element as ``{"complex": [real, imag]}``) and ``bytes`` as ``{"bytes_hex": "..."}``.
    """
    kind = type(value)
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").reshape(-1)
        if flat.is_complex():
            elements: list[Any] = [
                {"complex": [encode_value(key, v.real), encode_value(key, v.imag)]} for v in flat.tolist()
            ]
        else:
            elements = [encode_value(key, v) for v in flat.tolist()]
        return {"tensor": dtype_name(value.dtype), "shape": list(value.shape), "values": elements}
    if kind is bytes:
        return {"bytes_hex": value.hex()}
    if kind is list:
        return [encode_setting(key, v) for v in value]
    if kind is tuple:
        return {"tuple": [encode_setting(key, v) for v in value]}
    return encode_value(key, value)


def decode_value(key: str, value: Any) -> Any:
    """Inverse of `encode_value`."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [decode_value(key, v) for v in value]
    if type(value) is dict and len(value) == 1:
        if "tuple" in value and type(value["tuple"]) is list:
            return tuple(decode_value(key, v) for v in value["tuple"])
        if value.get("float") in ("nan", "inf", "-inf"):
            return float(value["float"])
    raise CheckpointFormatError(f"{MANIFEST_FILE}: state value {key!r} is not a valid exported value")


# --------------------------------------------------------------------------- group settings as JSON


MANIFEST_WIDTH = 120
"""``manifest.json`` puts an object or array on one line when it fits in this many columns."""


class OneLine(dict[str, Any]):
    """A JSON object `manifest_text` always writes on one line (a group of the rendering)."""


def manifest_text(value: Any, level: int = 0) -> str:
    """``value`` as strict JSON (no NaN/Infinity), indented by one space per level, with every
    object or array that fits in `MANIFEST_WIDTH` columns on one line (a setting's tagged
    value, say) and every `OneLine` object on one line whatever its width (so one group
    takes one line, however many groups a leaf has). Linear time."""
    if isinstance(value, OneLine):
        return json.dumps(value, allow_nan=False)
    if not isinstance(value, (dict, list)) or not value:
        return json.dumps(value, allow_nan=False)
    if isinstance(value, dict):
        items = [f"{json.dumps(k)}: {manifest_text(v, level + 1)}" for k, v in value.items()]
        opening, closing = "{", "}"
    else:
        items = [manifest_text(v, level + 1) for v in value]
        opening, closing = "[", "]"
    if not any("\n" in item for item in items):
        line = opening + ", ".join(items) + closing
        if level + len(line) <= MANIFEST_WIDTH:
            return line
    pad = "\n" + " " * (level + 1)
    return opening + pad + ("," + pad).join(items) + "\n" + " " * level + closing


FIRST_FQNS = 3
"""How many FQNs of each group the manifest's ``param_groups`` rendering lists."""


def render_groups(groups: list[Group], state_by_fqn: Mapping[str, Any]) -> dict[str, Any]:
    """One leaf's groups as the manifest's informational JSON rendering of its packed table(s).

    Like the table itself, distinct settings are listed once (``settings``, in order of first
    use, each rendered by `encode_setting`) and each group (``groups``, in index order)
    names its settings by index, with its number of parameters, how many of them have state and
    its first `FIRST_FQNS` FQNs. A group whose ranks' tables disagree (expert parallelism)
    shows the first table's settings and ``"settings_vary_across_tables": true``.
    """
    index_of: dict[bytes, int] = {}
    settings: list[dict[str, Any]] = []
    out_groups: list[dict[str, Any]] = []
    for gi, group in enumerate(groups):
        si = index_of.get(group.blob)
        if si is None:
            si = index_of[group.blob] = len(settings)
            settings.append({k: encode_setting(k, v) for k, v in group.settings.items()})
        entry = OneLine(
            {
                "index": gi,
                "settings": si,
                "params": len(group.fqns),
                "with_state": sum(1 for f in group.fqns if state_by_fqn.get(f)),
                "first_fqns": group.fqns[:FIRST_FQNS],
            }
        )
        if group.settings_vary:
            entry["settings_vary_across_tables"] = True
        out_groups.append(entry)
    return {"settings": settings, "groups": out_groups}
