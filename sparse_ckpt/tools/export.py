"""Pickle-free export of a checkpoint's optimizer part: safetensors + JSON, and its loader.

A DCP checkpoint's ``.metadata`` and its non-tensor items are pickles. `export_checkpoint`
writes one optimizer of a DCP checkpoint into a directory that holds no pickle at all:

* ``optimizer.safetensors`` -- every state tensor, full (unsharded), per-item or buffered
  (``state_layout="buffers"``, read through `FullTensors`), named by the checkpoint's
  flat key (``state.{fqn}.{key}``; the scalars of a packed version-2 checkpoint's scalar tables
  are exported as such per-item entries too, so an export's layout does not depend on the
  checkpoint's packed version), and every packed group table as a 1-d ``uint8`` tensor named
  by its key (``param_groups.__packed__.{leaf}.{digest}``). Flat-format group settings are
  packed into one table of leaf ``leaf`` (one group per distinct settings), so an export always
  carries binary tables (the table codec of docs/formats.md, which never unpickles). The order
  is the export's own (`sparse_ckpt.tools._export_order`), so a checkpoint of the same state
  exports to the same bytes whatever its state layout.
* ``manifest.json`` (written last: an export is complete exactly when it exists) -- format and
  version, the source, the leaves with their group and parameter counts, and non-tensor state
  values, which must be JSON-representable (``None``, ``bool``, ``int``, ``float``, ``str``,
  lists and tuples of these; tuples and non-finite floats are tagged so they come back exactly).
  Each leaf also carries ``param_groups``, a human-readable JSON rendering of its group tables
  (`render_groups`): the distinct settings (lr, betas, ...; encoded by
  `encode_setting`) and per group its settings' index, parameter counts and first FQNs.
  The rendering is informational only: `load_export` and `read_export` read the
  settings from the binary tables in ``optimizer.safetensors`` (their digests protect them) and
  never from the rendering, so editing it changes nothing that is loaded.

`load_export` restores it into any model/optimizer layout through the same by-FQN path as
`sparse_ckpt.load_sparse_state_dict` (strict/non-strict, transactional). In a process
group of more than one rank each rank reads only its own parameters' state from the file (other
ranks' FQNs are not "extra"), and state of a DTensor parameter becomes a DTensor with the
parameter's mesh and placements (sliced locally, no communication), as ``SparseLoadPlanner`` does.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from .._dcp.metadata import find_optimizers
from .._dist import multi_rank
from .._format.keys import (
    BUFFERS_PREFIX,
    PACKED_PREFIX,
    STATE_PREFIX,
    STEP_KEY,
    is_buffer_item,
    is_state_item,
    last_part,
    owner_fqn,
    state_key,
)
from .._fqn import Model, build_fqn_map
from .._layouts.bucketed_view import FullTensors
from .._leaves import SINGLE_LEAF
from .._load.completeness import without_items_record
from .._load.decode import decode_group_tables, table_fqns
from .._load.load import load_owned
from .._version import __version__
from ..errors import CheckpointFormatError, UsageError
from ._export_format import (
    EXPORT_FORMAT,
    EXPORT_VERSION,
    MANIFEST_FILE,
    TENSORS_FILE,
    _require_safetensors,
    decode_value,
    encode_value,
    manifest_text,
    render_groups,
)
from ._export_order import StateOrder, tables_first
from ._export_read import _open
from ._reader import (
    BATCH_BYTES,
    check_new_dir,
    cut,
    decode_tables,
    expand_scalar_tables,
    named_groups,
    open_checkpoint,
    optimizer_format,
    pack_flat_groups,
    read_entries,
    select_optimizers,
    split_optimizer,
)
from ._safetensors_io import st_dtype, write_safetensors

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


@dataclass
class ExportSummary:
    """What `export_checkpoint` wrote."""

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
    buffer_reads: int = 0
    """Buckets of buffered state (``state_layout="buffers"``) read: each once per batch that needs part of it."""
    buffer_bytes_read: int = 0
    """Their bytes."""


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

    ``key=None`` takes the checkpoint's only optimizer (a `UsageError` when there are
    several). ``leaf`` names the table that flat-format settings are packed into. State tensors
    are read ``batch_bytes`` at a time, so memory stays bounded whatever the checkpoint's size
    (buffered state: a batch of full tensors plus one bucket being read, each bucket read once
    per batch that needs part of it). Everything is validated (tables, dtypes, JSON values, the
    buffers' layouts) before the first file is written; the data of an item as it is read.
    """
    _require_safetensors()
    t0 = time.perf_counter()
    metadata = open_checkpoint(ckpt_dir)
    found = select_optimizers(find_optimizers(metadata), key)
    if not found:
        raise UsageError(
            f"{os.fspath(ckpt_dir)!r} holds no optimizer entries ('<key>.state.*' / '<key>.param_groups.*')"
        )
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
    bucket_keys = [inner for inner in opt.inner if is_buffer_item(inner)]
    # settings, group and scalar tables, layout tables: read; per-item tensors and buckets: their metadata
    group_keys = [inner for inner in opt.inner if not is_state_item(inner) and not is_buffer_item(inner)]
    state_keys = [inner for inner in opt.inner if is_state_item(inner)]
    tensor_keys = [k for k in state_keys if isinstance(sdm[opt.inner[k]], TensorStorageMetadata)]
    value_keys = [k for k in state_keys if not isinstance(sdm[opt.inner[k]], TensorStorageMetadata)]
    small = read_entries(ckpt_dir, metadata, [opt.inner[k] for k in group_keys + value_keys])
    values: dict[str, Any] = tables_first({k: small[opt.inner[k]] for k in group_keys + value_keys})
    values.update({k: sdm[opt.inner[k]] for k in tensor_keys + bucket_keys})
    # checks digests, decodes tables, checks the buffers against their layouts (as verify does)
    leaves, flat, state_by_fqn, _unmatched = split_optimizer(values)
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
    order = StateOrder((f for _name, groups in named for g in groups for f in g.fqns), state_by_fqn, values)
    # Scalar tables are exported as the per-item entries of packed version 1 (each FQN's first),
    # so an export's layout does not depend on the checkpoint's packed version.
    scalars = expand_scalar_tables(values, flat=False)
    scalar_tensors = {k: scalars[k] for k in sorted(scalars, key=order.key) if isinstance(scalars[k], torch.Tensor)}
    encoded = {k: encode_value(k, v) for k, v in scalars.items() if k not in scalar_tensors}
    encoded.update({k: encode_value(k, values[k]) for k in value_keys})
    encoded = {k: encoded[k] for k in sorted(encoded, key=order.key)}
    buffers_keys = [k for k in opt.inner if k.startswith(BUFFERS_PREFIX)]  # layout tables and buckets
    buffered = FullTensors(buffers_keys, values) if buffers_keys else None
    state = _state_entries(tensor_keys, sdm, opt.inner, buffered, order)
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = [(k, torch.uint8, (len(t),)) for k, t in tables.items()]
    layout += [(k, t.dtype, tuple(t.shape)) for k, t in scalar_tensors.items()]
    layout += [(e.name, e.dtype, e.shape) for e in state]
    for k, dtype, _shape in layout:
        st_dtype(k, dtype)  # refused before anything is written

    def read_buckets(keys: list[str], consume: Callable[[str, Any], None]) -> None:
        for bucket in keys:  # one at a time: a failure names its bucket
            read_entries(
                ckpt_dir,
                metadata,
                [opt.inner[bucket]],
                require_storage=True,
                consume=lambda _flat, value, bucket=bucket: consume(bucket, value),
            )

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for k, t in tables.items():
            yield k, torch.frombuffer(bytearray(t), dtype=torch.uint8) if t else torch.empty(0, dtype=torch.uint8)
        yield from scalar_tensors.items()
        # Read per-item entries in the checkpoint's order and buffered ones in the order their
        # buckets hold them (so each bucket is read about once, whatever the export's order);
        # the writer puts each tensor at its place in the export's order.
        position = {k: i for i, k in enumerate(tensor_keys)}
        reading = sorted(state, key=lambda e: (0, position[e.item]) if e.item is not None else (1, e.buffered))
        for batch in cut(reading, _StateEntry.nbytes, batch_bytes):
            got = read_entries(ckpt_dir, metadata, [opt.inner[e.item] for e in batch if e.item is not None])
            full = (
                buffered.read([e.buffered for e in batch if e.buffered is not None], read_buckets) if buffered else []
            )
            full.reverse()
            for e in batch:
                yield e.name, got.pop(opt.inner[e.item]) if e.item is not None else full.pop()

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
        "tensors": {"file": TENSORS_FILE, "bytes": st_bytes, "count": len(scalar_tensors) + len(state)},
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
        tensors=len(scalar_tensors) + len(state),
        tensor_bytes=sum(math.prod(s) * d.itemsize for k, d, s in layout if not k.startswith(PACKED_PREFIX)),
        tables=len(tables),
        table_bytes=sum(len(t) for t in tables.values()),
        values=len(encoded),
        file_bytes=st_bytes + len(text),
        seconds=time.perf_counter() - t0,
        buffer_reads=buffered.buffer_reads if buffered else 0,
        buffer_bytes_read=buffered.buffer_bytes if buffered else 0,
    )


@dataclass(frozen=True)
class _StateEntry:
    """One exported state tensor: its name, dtype and shape, and where it is read from (a per-item
    entry's key, or a buffered tensor's index in `FullTensors.tensors`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    item: str | None = None
    buffered: int | None = None

    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _state_entries(
    tensor_keys: list[str],
    sdm: Mapping[str, Any],
    inner: Mapping[str, str],
    buffered: FullTensors | None,
    order: StateOrder,
) -> list[_StateEntry]:
    """Every exported state tensor, per item or buffered, in the export's order (`StateOrder`)."""
    entries = [
        (order.key(k), _StateEntry(k, sdm[inner[k]].properties.dtype, tuple(sdm[inner[k]].size), item=k))
        for k in tensor_keys
    ]
    for i, (fqn, key, dtype, shape) in enumerate(buffered.tensors if buffered else []):
        name = state_key(fqn, key)
        entries.append((order.key(name, fqn), _StateEntry(name, dtype, shape, buffered=i)))
    entries.sort(key=lambda e: e[0])
    names = [e.name for _key, e in entries]
    if len(set(names)) != len(names):
        twice = next(n for i, n in enumerate(names) if n in names[:i])
        raise CheckpointFormatError(
            f"state {twice!r} is both in a buffer and a per-item entry (corrupt or edited checkpoint)"
        )
    return [e for _key, e in entries]


def read_export(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole export as a sparse optimizer dict (tables as ``bytes``, full CPU tensors, values),
    ready for `sparse_ckpt.load_sparse_state_dict`. No pickle is read."""
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
        dt = DTensor.from_local(
            local.clone(), param.device_mesh, param.placements, run_check=False, shape=dt.shape, stride=dt.stride()
        )
    return dt


def load_export(model: Model, optimizer: Any, out_dir: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Restore an export written by `export_checkpoint` into ``optimizer`` (any layout).

    Same semantics as `sparse_ckpt.load_sparse_state_dict`: matched by FQN, parameters
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
