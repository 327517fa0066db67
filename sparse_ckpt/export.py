"""Pickle-free export of a checkpoint's optimizer part: safetensors + JSON, and its loader.

A DCP checkpoint's ``.metadata`` and its non-tensor items are pickles. :func:`export_checkpoint`
writes one optimizer of a DCP checkpoint into a directory that holds no pickle at all:

* ``optimizer.safetensors`` -- every state tensor, full (unsharded), named by the checkpoint's
  flat key (``state.{fqn}.{key}``; the scalars of a packed version-2 checkpoint's scalar tables
  are exported as such per-item entries too, so an export's layout does not depend on the
  checkpoint's packed version), and every packed group table as a 1-d ``uint8`` tensor named
  by its key (``param_groups.__packed__.{leaf}.{digest}``). Flat-format group settings are
  packed into one table of leaf ``leaf`` (one group per distinct settings), so an export always
  carries binary tables (the codec of :mod:`sparse_ckpt.keys`, which never unpickles).
* ``manifest.json`` (written last: an export is complete exactly when it exists) -- format and
  version, the source, the leaves with their group and parameter counts, and non-tensor state
  values, which must be JSON-representable (``None``, ``bool``, ``int``, ``float``, ``str``,
  lists and tuples of these; tuples and non-finite floats are tagged so they come back exactly).
  Each leaf also carries ``param_groups``, a human-readable JSON rendering of its group tables
  (:func:`render_groups`): the distinct settings (lr, betas, ...; encoded by
  :func:`encode_setting`) and per group its settings' index, parameter counts and first FQNs.
  The rendering is informational only: :func:`load_export` and :func:`read_export` read the
  settings from the binary tables in ``optimizer.safetensors`` (their digests protect them) and
  never from the rendering, so editing it changes nothing that is loaded.

:func:`load_export` restores it into any model/optimizer layout through the same by-FQN path as
:func:`sparse_ckpt.load_sparse_state_dict` (strict/non-strict, transactional). In a process
group of more than one rank each rank reads only its own parameters' state from the file (other
ranks' FQNs are not "extra"), and state of a DTensor parameter becomes a DTensor with the
parameter's mesh and placements (sliced locally, no communication), as ``SparseLoadPlanner`` does.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from ._safetensors_io import data_order, st_dtype, write_safetensors
from ._version import __version__
from .checkpoint_io import find_optimizers
from .completeness import without_items_record
from .dcp import multi_rank
from .decode import decode_group_tables, table_fqns
from .errors import CheckpointFormatError, UsageError
from .fqn import Model, build_fqn_map
from .keys import (
    BUFFERS_PREFIX,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    STATE_PREFIX,
    STEP_KEY,
    is_state_item,
    last_part,
    owner_fqn,
)
from .leaves import SINGLE_LEAF
from .load import load_owned
from .tools.reader import (
    BATCH_BYTES,
    Group,
    batches,
    check_new_dir,
    decode_tables,
    dtype_name,
    expand_scalar_tables,
    named_groups,
    open_checkpoint,
    optimizer_format,
    pack_flat_groups,
    read_entries,
    select_optimizers,
    split_optimizer,
)

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "MANIFEST_FILE",
    "TENSORS_FILE",
    "ExportSummary",
    "export_checkpoint",
    "load_export",
    "read_export",
]

EXPORT_FORMAT = "sparse_ckpt.export"
EXPORT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "optimizer.safetensors"



@dataclass
class ExportSummary:
    """What :func:`export_checkpoint` wrote."""

    out_dir: str
    key: str
    """The optimizer's key in the source checkpoint (``""``: the top level)."""
    source_format: str
    """``packed``, ``flat`` or ``mixed`` (flat settings are always exported as a packed table)."""
    leaves: list[str] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    tables: int = 0
    table_bytes: int = 0
    values: int = 0
    file_bytes: int = 0
    """Bytes of ``optimizer.safetensors`` + ``manifest.json``."""
    seconds: float = 0.0


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

    The encoding of :func:`encode_value` (tuples and non-finite floats tagged), plus the other
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
    """Inverse of :func:`encode_value`."""
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
    """A JSON object :func:`manifest_text` always writes on one line (a group of the rendering)."""


def manifest_text(value: Any, level: int = 0) -> str:
    """``value`` as strict JSON (no NaN/Infinity), indented by one space per level, with every
    object or array that fits in :data:`MANIFEST_WIDTH` columns on one line (a setting's tagged
    value, say) and every :class:`OneLine` object on one line whatever its width (so one group
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
    use, each rendered by :func:`encode_setting`) and each group (``groups``, in index order)
    names its settings by index, with its number of parameters, how many of them have state and
    its first :data:`FIRST_FQNS` FQNs. A group whose ranks' tables disagree (expert parallelism)
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
        entry = OneLine({
            "index": gi,
            "settings": si,
            "params": len(group.fqns),
            "with_state": sum(1 for f in group.fqns if state_by_fqn.get(f)),
            "first_fqns": group.fqns[:FIRST_FQNS],
        })
        if group.settings_vary:
            entry["settings_vary_across_tables"] = True
        out_groups.append(entry)
    return {"settings": settings, "groups": out_groups}


# --------------------------------------------------------------------------- export


def export_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    key: str | None = None,
    *,
    leaf: str = SINGLE_LEAF,
    batch_bytes: int = BATCH_BYTES,
) -> ExportSummary:
    """Export the optimizer under ``key`` of DCP checkpoint ``ckpt_dir`` to ``out_dir`` (new or empty).

    ``key=None`` takes the checkpoint's only optimizer (a :class:`UsageError` when there are
    several). ``leaf`` names the table that flat-format settings are packed into. State tensors
    are read ``batch_bytes`` at a time, so memory stays bounded whatever the checkpoint's size.
    Everything is validated (tables, dtypes, JSON values) before the first file is written.
    """
    _require_safetensors()
    t0 = time.perf_counter()
    metadata = open_checkpoint(ckpt_dir)
    found = select_optimizers(find_optimizers(metadata), key)
    if not found:
        raise UsageError(f"{os.fspath(ckpt_dir)!r} holds no optimizer entries ('<key>.state.*' / '<key>.param_groups.*')")
    if len(found) > 1:
        names = ", ".join(repr(o.name) for o in found)
        raise UsageError(f"{os.fspath(ckpt_dir)!r} holds {len(found)} optimizers ({names}): pass --key")
    opt = found[0]
    if opt.nested:
        raise UsageError(
            f"optimizer {opt.name!r} of {os.fspath(ckpt_dir)!r} is in torch DSD's nested layout; convert it first "
            "(python -m sparse_ckpt convert SRC DST --to packed), then export the converted checkpoint"
        )
    check_new_dir(out_dir)
    sdm = metadata.state_dict_metadata
    buffered = [inner for inner in opt.inner if inner.startswith(BUFFERS_PREFIX)]
    if buffered:
        raise CheckpointFormatError(
            f"optimizer {opt.name!r} holds state_layout='buffers' state ({buffered[0]!r}); export reads per-item "
            "state: convert the checkpoint first (python -m sparse_ckpt convert SRC DST --to packed writes it "
            "per item), then export that"
        )
    group_keys = [inner for inner in opt.inner if not is_state_item(inner)]  # settings and tables
    state_keys = [inner for inner in opt.inner if is_state_item(inner)]
    tensor_keys = [k for k in state_keys if isinstance(sdm[opt.inner[k]], TensorStorageMetadata)]
    value_keys = [k for k in state_keys if not isinstance(sdm[opt.inner[k]], TensorStorageMetadata)]
    small = read_entries(ckpt_dir, metadata, [opt.inner[k] for k in group_keys + value_keys])
    values: dict[str, Any] = {k: small[opt.inner[k]] for k in group_keys + value_keys}
    values.update({k: sdm[opt.inner[k]] for k in tensor_keys})
    leaves, flat, state_by_fqn, _unmatched = split_optimizer(values)  # checks digests and decodes tables
    fmt = optimizer_format(opt, leaves, flat)  # not "nested": refused above
    # (an export holds other items than the save recorded: scalar tables become per-item entries)
    tables = {
        k: without_items_record(PACKED_PREFIX, k[len(PACKED_PREFIX) :], v)
        for k, v in values.items()
        if k.startswith(PACKED_PREFIX)
    }
    named = named_groups(leaves, [])
    if flat:
        flat_table = pack_flat_groups(flat, leaf, leaves)
        tables.update(flat_table)
        named.extend(decode_tables(flat_table).items())  # the groups as the exported table holds them
    # Scalar tables are exported as the per-item entries of packed version 1 (each FQN's first),
    # so an export's layout does not depend on the checkpoint's packed version.
    scalars = expand_scalar_tables(values, flat=False)
    scalar_tensors = {k: v for k, v in scalars.items() if isinstance(v, torch.Tensor)}
    encoded = {k: encode_value(k, v) for k, v in scalars.items() if k not in scalar_tensors}
    encoded.update({k: encode_value(k, values[k]) for k in value_keys})
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        (k, torch.uint8, (len(t),)) for k, t in tables.items()
    ]
    layout += [(k, t.dtype, tuple(t.shape)) for k, t in scalar_tensors.items()]
    layout += [(k, sdm[opt.inner[k]].properties.dtype, tuple(sdm[opt.inner[k]].size)) for k in tensor_keys]
    for k, dtype, _shape in layout:
        st_dtype(k, dtype)  # refused before anything is written

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for k, t in tables.items():
            yield k, torch.frombuffer(bytearray(t), dtype=torch.uint8) if t else torch.empty(0, dtype=torch.uint8)
        yield from scalar_tensors.items()
        inner_of = {opt.inner[k]: k for k in tensor_keys}
        for batch in batches(metadata, [opt.inner[k] for k in tensor_keys], batch_bytes):
            got = read_entries(ckpt_dir, metadata, batch)
            for flat_key in batch:
                yield inner_of[flat_key], got.pop(flat_key)

    leaves_info = [
        {
            "name": name,
            "groups": len(groups),
            "params": sum(len(g.fqns) for g in groups),
            "with_state": sum(1 for g in groups for f in g.fqns if state_by_fqn.get(f)),
            "settings_vary_across_tables": any(g.settings_vary for g in groups),
            "param_groups": render_groups(groups, state_by_fqn),
        }
        for name, groups in named
    ]
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    st_path = os.path.join(out, TENSORS_FILE)
    tmp = st_path + ".tmp"
    st_bytes = write_safetensors(tmp, layout, stream(), {"format": EXPORT_FORMAT, "version": str(EXPORT_VERSION)})
    os.replace(tmp, st_path)
    manifest = {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "created_by": f"sparse_ckpt {__version__}",
        "source": {"checkpoint": os.path.abspath(os.fspath(ckpt_dir)), "key": opt.name, "format": fmt},
        "tensors": {"file": TENSORS_FILE, "bytes": st_bytes, "count": len(scalar_tensors) + len(tensor_keys)},
        "tables": [{"key": k, "bytes": len(t)} for k, t in tables.items()],
        "leaves": leaves_info,
        "values": encoded,
    }
    text = (manifest_text(manifest) + "\n").encode("utf-8")
    man_path = os.path.join(out, MANIFEST_FILE)
    with open(man_path + ".tmp", "wb") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(man_path + ".tmp", man_path)
    return ExportSummary(
        out_dir=out,
        key=opt.name,
        source_format=fmt,
        leaves=[name for name, _groups in named],
        tensors=len(scalar_tensors) + len(tensor_keys),
        tensor_bytes=sum(math.prod(s) * d.itemsize for k, d, s in layout if not k.startswith(PACKED_PREFIX)),
        tables=len(tables),
        table_bytes=sum(len(t) for t in tables.values()),
        values=len(encoded),
        file_bytes=st_bytes + len(text),
        seconds=time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------- reading an export


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The export's manifest, checked for format and version (:class:`CheckpointFormatError`)."""
    path = os.path.join(os.fspath(out_dir), MANIFEST_FILE)
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{os.fspath(out_dir)!r} has no {MANIFEST_FILE}: incomplete or not a sparse_ckpt export")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path!r} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        raise CheckpointFormatError(f"{path!r} is not a sparse_ckpt export manifest")
    if manifest.get("version") != EXPORT_VERSION:
        raise CheckpointFormatError(
            f"{path!r}: export version {manifest.get('version')!r} is not supported (this sparse_ckpt reads {EXPORT_VERSION})"
        )
    tensors = manifest.get("tensors")
    if not (isinstance(tensors, dict) and tensors.get("file") == TENSORS_FILE and isinstance(tensors.get("bytes"), int)):
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
    """The export's safetensors file, opened lazily; every failure is a :class:`CheckpointFormatError`."""

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
            k for k in manifest["values"] if not k.startswith(STATE_PREFIX) or k.startswith(SCALARS_PREFIX) or k in names
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


def read_export(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole export as a sparse optimizer dict (tables as ``bytes``, full CPU tensors, values),
    ready for :func:`sparse_ckpt.load_sparse_state_dict`. No pickle is read."""
    manifest, tensors, tables, state_names = _open(out_dir)
    try:
        sd: dict[str, Any] = dict(tables)
        for name in state_names:
            sd[name] = tensors.get(name)
    finally:
        tensors.close()
    for k, v in manifest["values"].items():
        sd[k] = decode_value(k, v)
    return sd


def _like_param(name: str, value: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor:
    """State of a DTensor parameter as a DTensor with its mesh and placements (local slicing, no
    collective), when shaped like it and not ``step``; else ``value`` unchanged."""
    if not isinstance(param, DTensor) or last_part(name) == STEP_KEY or tuple(value.shape) != tuple(param.shape):
        return value
    dt = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    local = dt.to_local()
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        # A view into the full tensor: keep only this rank's shard alive.
        dt = DTensor.from_local(local.clone(), param.device_mesh, param.placements, run_check=False,
                                shape=dt.shape, stride=dt.stride())
    return dt


def load_export(model: Model, optimizer: Any, out_dir: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Restore an export written by :func:`export_checkpoint` into ``optimizer`` (any layout).

    Same semantics as :func:`sparse_ckpt.load_sparse_state_dict`: matched by FQN, parameters
    without saved state get none, ``strict`` missing/extra checks, and on any error every
    optimizer is exactly as before. In a process group of more than one rank, only state of the
    local model's parameters is read and saved FQNs the model does not own belong to other ranks;
    state of a DTensor parameter becomes a DTensor placed like it. Reads no pickle.
    """
    multi = multi_rank()
    fmap = build_fqn_map(model)
    manifest, tensors, tables, state_names = _open(out_dir)
    try:
        known = table_fqns(decode_group_tables({k[len(PACKED_PREFIX) :]: t for k, t in tables.items()}), fmap)
        sd: dict[str, Any] = dict(tables)

        def owner(name: str) -> tuple[bool, torch.Tensor | None]:
            """(take it, the local parameter it belongs to)."""
            fqn = owner_fqn(name[len(STATE_PREFIX) :], known)
            param = None if fqn is None else fmap.param_of.get(fmap.resolve(fqn))
            return not (multi and fqn is not None and param is None), param

        for name in state_names:
            take, param = owner(name)
            if take:
                sd[name] = _like_param(name, tensors.get(name), param)
    finally:
        tensors.close()
    for name, value in manifest["values"].items():
        if owner(name)[0]:
            sd[name] = decode_value(name, value)
    load_owned(model, optimizer, sd, strict=strict, unowned_are_other_ranks=multi)
