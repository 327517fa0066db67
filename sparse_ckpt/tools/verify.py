"""``verify``: read every item of a checkpoint and report what is missing or corrupt."""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._dcp.items import FileWindow
from .._dcp.metadata import find_optimizers
from .._format.bucket_checksums import tensor_crc
from .._format.keys import is_buffer_item
from .._layouts.bucketed_view import checksum_failures
from .._text import one_line
from ..errors import SparseCheckpointError
from ._reader import (
    BATCH_BYTES,
    batches,
    entry_values,
    loader_needed,
    named_groups,
    open_checkpoint,
    optimizer_format,
    read_entries,
    read_keys,
    split_optimizer,
)

__all__ = ["format_verify", "storage_problems", "verify_checkpoint"]

_ZIP_MAGIC = b"PK\x03\x04"


def _check_zip(f: io.BufferedReader, offset: int, length: int) -> tuple[str | None, int]:
    """``(error, members whose CRC-32 was not recorded)`` of one item written by ``torch.save``.

    Every member is read and its CRC-32 compared (bit flips that ``torch.load`` accepts silently
    are caught). An item that does not start like a zip archive is not checked here.
    """
    f.seek(offset)
    if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
        return None, 1
    unchecked = 0
    try:
        with zipfile.ZipFile(FileWindow(f, offset, length)) as zf:
            for info in zf.infolist():
                if info.CRC == 0 and info.file_size:  # written with CRC-32 disabled
                    unchecked += 1
                    continue
                with zf.open(info) as member:
                    while member.read(1 << 22):
                        pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError) as exc:
        return one_line(exc), 0
    return None, unchecked


def storage_problems(
    path: str | os.PathLike[str], metadata: Metadata, *, check_data: bool = False
) -> tuple[list[dict[str, Any]], set[str], dict[str, Any]]:
    """Missing storage records, missing data files, items past the end of their file and (with
    ``check_data``) items whose zip structure or CRC-32 is broken.

    Returns ``(problems, bad keys, stats)``; a problem is ``{"key", "file", "problem"}`` (a
    missing file is one problem naming how many items it held). Without ``check_data`` only file
    sizes are read (cheap: what ``inspect`` does).
    """
    root = os.fspath(path)
    problems: list[dict[str, Any]] = []
    bad: set[str] = set()
    records: dict[str, list[Any]] = {}
    storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
    for index, info in storage.items():
        records.setdefault(getattr(index, "fqn", str(index)), []).append(info)
    sizes: dict[str, int | None] = {}
    missing_files: dict[str, list[str]] = {}
    to_check: dict[str, list[tuple[int, int, str]]] = {}
    total = 0
    for key, md in metadata.state_dict_metadata.items():
        infos = records.get(key, [])
        expected = len(md.chunks) if isinstance(md, TensorStorageMetadata) else 1
        if len(infos) < expected:
            problems.append(
                {
                    "key": key,
                    "file": None,
                    "problem": f"{expected - len(infos)} of {expected} storage record(s) missing from .metadata",
                }
            )
            bad.add(key)
            continue
        for info in infos:
            rel = getattr(info, "relative_path", None)
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if not isinstance(rel, str) or not isinstance(offset, int) or not isinstance(length, int):
                problems.append({"key": key, "file": None, "problem": f"storage record is not a file range ({info!r})"})
                bad.add(key)
                break
            total += length
            if rel not in sizes:
                full = os.path.join(root, rel)
                sizes[rel] = os.path.getsize(full) if os.path.isfile(full) else None
            size = sizes[rel]
            if size is None:
                missing_files.setdefault(rel, []).append(key)
                bad.add(key)
                break
            if offset < 0 or length < 0 or offset + length > size:
                problems.append(
                    {
                        "key": key,
                        "file": rel,
                        "problem": f"truncated: needs bytes {offset}..{offset + length} of {rel!r}, which has {size}",
                    }
                )
                bad.add(key)
                break
            if check_data and not getattr(info, "transform_descriptors", None):
                to_check.setdefault(rel, []).append((offset, length, key))
    for rel, keys in missing_files.items():
        problems.append(
            {
                "key": keys[0],
                "file": rel,
                "problem": f"data file {rel!r} is missing ({len(keys)} item(s), e.g. {keys[0]!r})",
            }
        )
    unchecked = 0
    for rel, items in to_check.items():
        with open(os.path.join(root, rel), "rb") as f:
            for offset, length, key in sorted(items):
                if key in bad:
                    continue
                error, n = _check_zip(f, offset, length)
                unchecked += n
                if error is not None:
                    problems.append(
                        {
                            "key": key,
                            "file": rel,
                            "problem": f"corrupt item (bytes {offset}..{offset + length} of {rel!r}): {error}",
                        }
                    )
                    bad.add(key)
    stats = {
        "items": len(metadata.state_dict_metadata),
        "files": len(sizes),
        "bytes": total,
        "crc_unchecked": unchecked,
    }
    return problems, bad, stats


def verify_checkpoint(path: str | os.PathLike[str], *, batch_bytes: int = BATCH_BYTES) -> dict[str, Any]:
    """Read every item of the checkpoint and report what is missing or corrupt (``verify --json``).

    1. Storage: every item has its storage records, its data file exists and holds its byte
       range, and (items written by ``torch.save``, DCP's default) every zip member's CRC-32 matches.
    2. Every intact item is read through ``dcp.load`` (tensors reassembled and size-checked, in
       batches of ``batch_bytes``); bytes items of optimizers with ``weights_only=True``, other
       bytes items not unpickled at all.
    3. Every optimizer's group tables decode (digest, codec) and every state key belongs to a
       parameter of its tables or flat entries.

    ``ok`` is true when ``problems`` is empty. ``crc_unchecked`` counts zip members saved
    without a CRC-32 and items not in zip form (read in step 2 only).
    """
    metadata = open_checkpoint(path)
    problems, bad, stats = storage_problems(path, metadata, check_data=True)
    optimizers = find_optimizers(metadata)
    opt_keys = {flat for opt in optimizers for flat in opt.inner.values()}
    raw_keys = {
        key
        for key, md in metadata.state_dict_metadata.items()
        if not isinstance(md, TensorStorageMetadata) and key not in opt_keys
    }
    group_keys = {flat for opt in optimizers for flat in read_keys(opt)}
    bucket_keys = {
        flat
        for opt in optimizers
        for inner, flat in opt.inner.items()
        if is_buffer_item(inner) and flat not in group_keys
    }
    kept: dict[str, Any] = {}
    bucket_crcs: dict[str, int] = {}  # flattened bucket key -> its CRC-32C as read
    read = 0
    intact = [key for key in metadata.state_dict_metadata if key not in bad]
    for batch in batches(metadata, intact, batch_bytes):
        try:
            got = read_entries(path, metadata, batch, raw_keys=raw_keys)
        except SparseCheckpointError:
            got = {}
            for key in batch:  # find the culprits
                try:
                    got.update(read_entries(path, metadata, [key], raw_keys=raw_keys))
                except SparseCheckpointError as exc:
                    problems.append({"key": key, "file": None, "problem": f"unreadable: {exc}"})
                    bad.add(key)
        read += len(got)
        bucket_crcs.update(
            {k: tensor_crc(v) for k, v in got.items() if k in bucket_keys and isinstance(v, torch.Tensor)}
        )
        kept.update({k: v for k, v in got.items() if k in group_keys})
        del got
    loaders: dict[str, str] = {}
    for opt in optimizers:
        if any(flat in bad for flat in opt.inner.values()):
            continue  # already reported; decoding would only repeat it
        values = entry_values(opt, metadata, kept)
        name = opt.name or "(top level)"
        for bucket, problem in checksum_failures(
            values, values, lambda inner, o=opt: bucket_crcs.get(o.inner.get(inner, ""))
        ):
            problems.append({"key": opt.inner.get(bucket, bucket), "file": None, "problem": problem})
        try:
            leaves, flat, state_by_fqn, unmatched = split_optimizer(values)
        except SparseCheckpointError as exc:
            problems.append({"key": name, "file": None, "problem": f"optimizer {name!r}: {exc}"})
            continue
        named = named_groups(leaves, flat)
        grouped = {fqn for _leaf, groups in named for g in groups for fqn in g.fqns}
        orphans = [fqn for fqn in state_by_fqn if fqn not in grouped]
        without = len({f for f in grouped if not state_by_fqn.get(f)})
        fmt = optimizer_format(opt, leaves, flat)
        loaders[opt.name] = loader_needed({"format": fmt, "without_state": without, "foreign_guards": len(opt.guards)})
        if orphans:
            problems.append(
                {
                    "key": name,
                    "file": None,
                    "problem": (
                        f"optimizer {name!r}: state of {len(orphans)} parameter(s) in no group (e.g. {orphans[0]!r})"
                    ),
                }
            )
        if unmatched:
            problems.append(
                {
                    "key": name,
                    "file": None,
                    "problem": (
                        f"optimizer {name!r}: {len(unmatched)} key(s) match no parameter (e.g. {unmatched[0]!r})"
                    ),
                }
            )
    return {
        "checkpoint": os.fspath(path),
        "ok": not problems,
        **stats,
        "read": read,
        "optimizers": [opt.name for opt in optimizers],
        "loaders": loaders,
        "problems": problems,
    }


# --------------------------------------------------------------------------- text form


def format_verify(report: dict[str, Any]) -> str:
    """The text form of a ``verify`` report."""
    lines = [
        f"checkpoint: {report['checkpoint']}",
        (
            f"{report['items']} item(s) in {report['files']} file(s), {report['bytes']} bytes; "
            f"{report['read']} read; optimizers: "
            f"{', '.join(repr(o or '(top level)') for o in report['optimizers']) or 'none'}"
        ),
    ]
    for name, loader in report.get("loaders", {}).items():
        lines.append(f"optimizer {name or '(top level)'!r} loads with {loader}")
    if report["crc_unchecked"]:
        lines.append(f"{report['crc_unchecked']} item part(s) without a CRC-32 (read, not checksummed)")
    for p in report["problems"]:
        lines.append(f"problem: {p['key']}: {p['problem']}")
    lines.append("OK" if report["ok"] else f"{len(report['problems'])} problem(s)")
    return "\n".join(lines)
