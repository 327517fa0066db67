"""Reading a DCP checkpoint from elsewhere without running it: ``.metadata`` by a restricted unpickler,
and nothing read outside the checkpoint's directory.

DCP's ``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a ``.metadata`` that pickles an
object with a ``__reduce__`` runs its code. `read_metadata_file` unpickles it with `MetadataUnpickler`,
which resolves only what DCP's metadata is made of (the metadata dataclasses and the file system's
storage records, ``torch.Size``, dtypes, layouts, memory formats, path objects, a few builtins) and
refuses any other global, naming it, before it is called. `check_storage_paths` refuses a storage
record whose ``relative_path`` resolves outside the checkpoint directory (``../x``, an absolute path, a
symbolic link leading out). `SafeFileSystemReader` is DCP's reader with both; the checkpoint tools read
through it, and `sparse_ckpt.integrations.safe_load` puts both into torch's own ``FileSystemReader``.
"""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from functools import lru_cache
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .._text import one_line
from .._torch_internals import dcp_metadata_globals
from ..errors import CheckpointFormatError

__all__ = [
    "METADATA_FILE",
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "check_storage_paths",
    "read_metadata_file",
    "safe_read_metadata",
    "safe_reader_for",
    "safe_reader_like",
    "safe_set_up_storage_reader",
]

METADATA_FILE = ".metadata"
"""The name of DCP's metadata file in a checkpoint directory (``__{rank}.metadata``: a rank's own)."""

_PATHS = ("Path", "PurePath", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
"""``pathlib`` classes (a ``StorageMeta.checkpoint_id`` saved as a path; ``pathlib._local`` on Python 3.13+)."""
_BUILTINS = (
    "set",
    "frozenset",
    "bytearray",
    "complex",
    "tuple",
    "list",
    "dict",
    "int",
    "float",
    "str",
    "bytes",
    "bool",
)
"""Builtin containers and scalars an older pickle protocol names (protocol 4 has opcodes for them)."""


@lru_cache(maxsize=1)
def _allowed() -> dict[tuple[str, str], Any]:
    import builtins
    import pathlib

    allowed = dcp_metadata_globals()
    allowed["torch", "Size"] = torch.Size
    allowed["collections", "OrderedDict"] = OrderedDict
    for name in _PATHS:
        for module in ("pathlib", "pathlib._local"):
            allowed[module, name] = getattr(pathlib, name)
    for name in _BUILTINS:
        allowed["builtins", name] = getattr(builtins, name)
    return allowed


def _torch_value(name: str) -> Any:
    """``torch.<name>`` when it is a dtype, layout or memory format (they pickle by name), else ``None``.
    Looked up in the module's namespace only: no attribute hook of torch runs for an unknown name."""
    value = vars(torch).get(name)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler of DCP's ``.metadata`` that resolves only the globals DCP's metadata is made of.

    Any other global (a function, another class, a dotted name such as ``pathlib.Path.touch``, an
    extension code) is a `CheckpointFormatError` naming it, raised when the pickle names it: before
    it could be called. Persistent ids are refused too (``pickle.Unpickler``'s default)."""

    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        """The allowed object ``module.name``; `CheckpointFormatError` for anything else."""
        found = _allowed().get((module, name))
        if found is None and module == "torch":
            found = _torch_value(name)
        if found is None:
            shown = f"{module}.{name}"
            shown = shown if len(shown) <= 120 else shown[:117] + "..."
            raise CheckpointFormatError(
                f"{self.where} names the global {shown!r}, which DCP's metadata is not made of: refused before "
                "anything in the file ran (a crafted or damaged checkpoint; if it comes from a source you trust "
                "and a custom planner wrote it, torch's own FileSystemReader reads it)"
            )
        return found


def read_metadata_file(file: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Metadata:
    """The DCP metadata in ``file``, unpickled by `MetadataUnpickler`; with ``root`` (the checkpoint
    directory), its storage records are checked by `check_storage_paths`.

    `CheckpointFormatError` naming the file: a refused global, a file that is not a pickle of
    ``Metadata`` (garbage, truncated, another format), a storage path outside ``root``. A missing file
    raises ``FileNotFoundError`` as DCP's reader does."""
    where = repr(os.fspath(file))
    with open(file, "rb") as f:
        try:
            metadata = MetadataUnpickler(f, where).load()
        except CheckpointFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the unpickler raises on garbage
            raise CheckpointFormatError(
                f"{where} cannot be read ({one_line(exc)}): corrupt, or not a DCP checkpoint"
            ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, Mapping):
        raise CheckpointFormatError(f"{where} holds a {type(metadata).__name__}, not DCP metadata")
    if root is not None:
        check_storage_paths(metadata, root)
    return metadata


def check_storage_paths(metadata: Metadata, root: str | os.PathLike[str]) -> None:
    """`CheckpointFormatError` naming the item when a storage record of ``metadata`` points outside the
    checkpoint directory ``root``: its ``relative_path`` is no string, absolute, or resolves (``..``,
    symbolic links) outside ``root``. One check per distinct file."""
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        return  # DCP refuses it when it sets up its reader
    if not isinstance(storage, Mapping):
        raise CheckpointFormatError(
            f"the checkpoint {os.fspath(root)!r} has storage records of type {type(storage).__name__}"
        )
    base = os.path.realpath(root)
    checked: set[str] = set()
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str) and rel in checked:
            continue
        problem = _outside(base, rel)
        if problem is not None:
            raise CheckpointFormatError(
                f"checkpoint item {getattr(index, 'fqn', index)!r} of {os.fspath(root)!r} is stored at {rel!r}, "
                f"{problem}: refused (a crafted or damaged .metadata; nothing outside the checkpoint directory is read)"
            )
        checked.add(rel)


def _outside(base: str, rel: Any) -> str | None:
    """Why storage path ``rel`` is not a file inside directory ``base`` (resolved), or ``None``."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return "which is not a file name"
    if os.path.isabs(rel) or os.path.splitdrive(rel)[0]:
        return "an absolute path"
    full = os.path.realpath(os.path.join(base, rel))
    if full == base or os.path.commonpath([base, full]) != base:
        return "outside the checkpoint directory"
    return None


_TORCH_SET_UP_STORAGE_READER = vars(FileSystemReader)["set_up_storage_reader"]
"""torch's own, taken before `sparse_ckpt.integrations.safe_load` may replace it."""


def safe_read_metadata(reader: FileSystemReader, *args: Any, **kwargs: Any) -> Metadata:
    """``FileSystemReader.read_metadata`` with `read_metadata_file` (``rank=R``: the rank's own
    ``__R.metadata``, as torch's reader): stamped with the reader's load id as torch's reader does."""
    rank = kwargs.get("rank")
    name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
    metadata = read_metadata_file(os.path.join(os.fspath(reader.path), name), reader.path)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = getattr(reader, "load_id", None)
    return metadata


def safe_set_up_storage_reader(
    reader: FileSystemReader, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
) -> None:
    """``FileSystemReader.set_up_storage_reader`` that first refuses storage records outside the
    reader's directory (`check_storage_paths`): every rank checks the metadata it reads from."""
    check_storage_paths(metadata, reader.path)
    _TORCH_SET_UP_STORAGE_READER(reader, metadata, is_coordinator, *args, **kwargs)


class SafeFileSystemReader(FileSystemReader):
    """A DCP ``FileSystemReader`` for checkpoints from elsewhere: ``.metadata`` is read by a restricted
    unpickler (DCP's metadata classes only; anything else is a `sparse_ckpt.CheckpointFormatError`
    naming the global, before it is called), and no item is read from outside ``path`` (a storage
    record whose file resolves outside it is refused). Everything else is DCP's reader::

        dcp.load(sd, storage_reader=sc.SafeFileSystemReader(path), planner=sc.SparseLoadPlanner())

    With `sparse_ckpt.SparseLoadPlanner` the optimizer's bytes items are read weights-only too; other
    bytes items are unpickled by the planner as DCP does (``SPARSE_CKPT_SAFE_LOAD=1`` reads every one
    weights-only: `sparse_ckpt.integrations.safe_load`)."""

    files_like_torchs_reader = True
    """Its items lie in its files as in torch's ``FileSystemReader`` (`file_item_location` reads them)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read by the restricted unpickler (`safe_read_metadata`)."""
        return safe_read_metadata(self, *args, **kwargs)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """As DCP's, after refusing storage records outside the checkpoint (`safe_set_up_storage_reader`)."""
        safe_set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs)


def safe_reader_for(checkpoint_id: str | os.PathLike[str]) -> SafeFileSystemReader | None:
    """The reader ``dcp.load(checkpoint_id=...)`` would make, as a `SafeFileSystemReader`, where DCP would
    make a ``FileSystemReader``; ``None`` where it would pick another storage (an fsspec URL)."""
    return SafeFileSystemReader(checkpoint_id) if FileSystemReader.validate_checkpoint_id(checkpoint_id) else None


def safe_reader_like(reader: Any) -> Any:
    """``reader`` itself, or, when it is exactly torch's ``FileSystemReader`` (a trainer's default), a
    `SafeFileSystemReader` of the same directory and stream transforms."""
    if type(reader) is not FileSystemReader:
        return reader
    safe = SafeFileSystemReader(reader.path)
    safe.__dict__.update({k: v for k, v in vars(reader).items() if k == "transforms"})
    return safe
