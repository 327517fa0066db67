"""A DCP checkpoint directory without a model: its metadata and the optimizers in it.

``.metadata`` is read by the restricted unpickler of :mod:`sparse_ckpt._dcp.safe_reader` (nothing in
it runs; no storage record may point outside the directory). :func:`find_optimizers` finds
each optimizer's entries (sparse packed/flat, or torch DSD's nested layout) by their flattened
keys, which is what DCP matches on; :mod:`sparse_ckpt.tools._reader` reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import Metadata

from .._format.keys import GROUPS_PREFIX, OPTIMIZER_PREFIXES, is_foreign_guard
from .._format.keys_record import RECORD_PREFIX
from .._format.nested import NESTED_KEYS
from ..errors import NotACheckpointError
from .paths import ObjPath, metadata_path, set_path
from .safe_reader import METADATA_FILE, read_metadata_file

__all__ = [
    "METADATA_FILE",
    "NotACheckpointError",
    "ObjPath",
    "OptimizerEntries",
    "find_optimizers",
    "metadata_path",
    "read_metadata",
    "set_path",
    "unrecognised_optimizer_items",
]


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The checkpoint's DCP metadata, read by the restricted unpickler (`read_metadata_file`);
    :class:`NotACheckpointError` when there is none, `CheckpointFormatError` when it cannot be read, names
    a global DCP's metadata is not made of, or points outside ``path``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise NotACheckpointError(f"{path!r} is not a directory: incomplete or not a DCP checkpoint")
    if not os.path.isfile(os.path.join(path, METADATA_FILE)):
        raise NotACheckpointError(f"{path!r} has no {METADATA_FILE} file: incomplete or not a DCP checkpoint")
    return read_metadata_file(os.path.join(path, METADATA_FILE), path)


@dataclass
class OptimizerEntries:
    """The entries of one optimizer state dict inside a checkpoint."""

    prefix: ObjPath
    """Object path of the optimizer dict (``()`` when it is the checkpoint's top level)."""
    inner: dict[str, str]
    """Key inside the optimizer dict (``state.*``, ``param_groups.*``; the packed format's scalar
    tables ``state.__packed__.*`` among the ``state.*`` keys) -> flattened checkpoint key."""
    guards: list[str] = field(default_factory=list)
    """Flattened keys of its foreign-loader guards (:func:`sparse_ckpt._format.keys.foreign_guard_keys`),
    not in ``inner``: they hold nothing to read."""
    nested: dict[str, ObjPath] = field(default_factory=dict)
    """torch DSD's nested layout (``{"state": {fqn: {...}}, "param_groups": [...]}``): each such
    inner key (the item's dotted path below the prefix) -> its object path below the prefix
    (``("state", fqn, key)``, ``("param_groups", i, key)``); empty for sparse and flat entries.
    :func:`sparse_ckpt.tools._reader.sparse_values` rewrites their values into the packed
    equivalent (:mod:`sparse_ckpt._format.nested`)."""

    @property
    def name(self) -> str:
        """The prefix as DCP writes it (``"optim"``, ``"train.optim"``; ``""`` for the top level)."""
        return ".".join(map(str, self.prefix))


def find_optimizers(metadata: Metadata) -> list[OptimizerEntries]:
    """Optimizer dicts in the checkpoint: object paths with ``state.*``/``param_groups.*`` children,
    or with torch DSD's nested ``state`` / ``param_groups`` children (see :attr:`OptimizerEntries.nested`).

    A prefix counts only when it has at least one ``param_groups`` entry (every optimizer has
    group settings, flat, packed or nested), so a model submodule named ``state`` is not mistaken for one.
    """
    found: dict[ObjPath, OptimizerEntries] = {}
    has_groups: set[ObjPath] = set()
    for key in metadata.state_dict_metadata:
        p = metadata_path(metadata, key)
        split = _split(p)
        if split is None:
            nested = _split_nested(p)
            if nested is None:
                continue
            prefix, rel = nested
            inner = ".".join(map(str, rel))
            entries = found.setdefault(prefix, OptimizerEntries(prefix, {}))
            entries.inner[inner] = key
            entries.nested[inner] = rel
            if rel[0] == NESTED_KEYS[1]:
                has_groups.add(prefix)
            continue
        prefix, inner = split
        entries = found.setdefault(prefix, OptimizerEntries(prefix, {}))
        if is_foreign_guard(inner, metadata.state_dict_metadata[key]):
            entries.guards.append(key)  # for loaders that do not know the format; nothing to read
            continue
        entries.inner[inner] = key
        if inner.startswith(GROUPS_PREFIX):
            has_groups.add(prefix)
    return [entries for prefix, entries in found.items() if prefix in has_groups]


def unrecognised_optimizer_items(metadata: Metadata, found: list[OptimizerEntries]) -> list[str]:
    """Checkpoint keys that look like optimizer state or settings (a ``state`` / ``param_groups``
    part in their path, or a part starting with ``state.`` / ``param_groups.``) but belong to no
    optimizer of ``found``: what a report must mention instead of "no optimizer entries"."""
    known = {flat for opt in found for flat in (*opt.inner.values(), *opt.guards)}
    out = []
    for key in metadata.state_dict_metadata:
        if key in known:
            continue
        parts = metadata_path(metadata, key)
        if any(isinstance(x, str) and (x in NESTED_KEYS or x.startswith(OPTIMIZER_PREFIXES)) for x in parts) or any(
            f".{marker}" in key for marker in OPTIMIZER_PREFIXES
        ):
            out.append(key)
    return out


def _split_nested(p: ObjPath) -> tuple[ObjPath, ObjPath] | None:
    """``(prefix, ("state", fqn, key...))`` or ``(prefix, ("param_groups", i, key...))`` for an item of
    DSD's nested layout (the first such part of the path), else None."""
    for i, part in enumerate(p):
        if len(p) - i < 3:
            return None
        if part == NESTED_KEYS[0] and isinstance(p[i + 1], str):
            return p[:i], p[i:]
        if part == NESTED_KEYS[1] and isinstance(p[i + 1], int):
            return p[:i], p[i:]
    return None


_ENTRY_PREFIXES = (*OPTIMIZER_PREFIXES, RECORD_PREFIX)
"""Key prefixes of an optimizer dict's entries: its state and groups, and (flat and nested formats)
its key record, which sits next to them."""


def _split(p: ObjPath) -> tuple[ObjPath, str] | None:
    if len(p) == 1 and isinstance(p[0], str):
        # No recorded nesting: find the optimizer namespace in the dotted key itself.
        key = p[0]
        if key.startswith(_ENTRY_PREFIXES):
            return (), key
        best = None
        for marker in _ENTRY_PREFIXES:
            i = key.find(f".{marker}")
            if i > 0 and (best is None or i < best):
                best = i
        if best is None:
            return None
        return (key[:best],), key[best + 1 :]
    last = p[-1]
    if isinstance(last, str) and last.startswith(_ENTRY_PREFIXES):
        return p[:-1], last
    # An element of a list-valued state entry (LBFGS's ``al``): DCP records ``(..., "state.{fqn}.al", 0)``
    # (dicts inside the list add str parts after the index).
    for i in range(len(p) - 2, -1, -1):
        part = p[i]
        if isinstance(part, str) and part.startswith(OPTIMIZER_PREFIXES) and isinstance(p[i + 1], int):
            return p[:i], ".".join(map(str, p[i:]))
        if isinstance(part, str) and "." in part:
            break
    return None
