"""Crafted checkpoints for the untrusted-input tests (tests/safety/test_untrusted_*.py): a ``.metadata``
or a bytes item that pickles code which creates a marker file when unpickled, and storage records moved
outside the checkpoint directory. Each edit rewrites a checkpoint the test wrote itself (read back with
torch's own reader: trusted here)."""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

KINDS = ("exec", "dotted")
"""How a payload runs its code: ``builtins.exec`` of a string, or ``pathlib.Path.touch`` (a dotted
name inside a module whose path classes the metadata reader allows)."""
GLOBAL = {"exec": "builtins.exec", "dotted": "pathlib.Path.touch"}
"""The global each kind's pickle names (what a refusal must name)."""
ITEM_GLOBAL = {"exec": "exec", "dotted": "getattr"}
"""The first global of each kind's ``torch.save`` pickle (protocol 2: ``Path.touch`` is
``getattr(Path, "touch")``), as torch's weights-only unpickler names it (builtins without their module)."""


class Payload:
    """Pickles as a call that creates ``marker`` (``kind``: `KINDS`)."""

    def __init__(self, marker: Path, kind: str = "exec") -> None:
        self.marker = marker
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:
        if self.kind == "exec":
            return exec, (f"open({str(self.marker)!r}, 'w').close()",)
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def metadata(path: Path) -> Metadata:
    """The checkpoint's metadata, read by torch's own reader (the tests wrote it)."""
    return FileSystemReader(str(path)).read_metadata()


def write_metadata(path: Path, md: Metadata) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def poison_metadata(path: Path, marker: Path, kind: str = "exec") -> None:
    """``path``'s ``.metadata`` with a `Payload` among its planner data (the rest intact)."""
    md = metadata(path)
    md.planner_data = {**md.planner_data, "evil": Payload(marker, kind)}
    write_metadata(path, md)


def bytes_keys(path: Path, prefix: str) -> list[str]:
    """The keys of the checkpoint's bytes items under ``prefix``."""
    md = metadata(path)
    return [
        k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata) and k.startswith(prefix)
    ]


def replace_item(path: Path, key: str, value: Any) -> None:
    """Bytes item ``key`` of ``path`` replaced by ``torch.save(value)``: appended to its data file, its
    storage record pointed there (a well-formed archive: only the unpickler can refuse it)."""
    md = metadata(path)
    (index,) = [i for i in md.storage_data if i.fqn == key]
    info = md.storage_data[index]
    blob = io.BytesIO()
    torch.save(value, blob)
    file = path / info.relative_path
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(blob.getvalue())
    info.offset, info.length = offset, len(blob.getvalue())
    write_metadata(path, md)


def move_storage(path: Path, where: str) -> str:
    """Point every storage record of ``path`` at a copy of its data file outside the checkpoint:
    ``"parent"`` (``../NAME``), ``"absolute"`` (an absolute path) or ``"symlink"`` (a link inside the
    directory leading out). The copy holds the same bytes, so torch's reader loads from it. Returns the
    new ``relative_path``."""
    md = metadata(path)
    (rel,) = {info.relative_path for info in md.storage_data.values()}
    outside = path.parent / f"outside-{path.name}"
    outside.mkdir()
    os.replace(path / rel, outside / rel)
    new = {"parent": f"../{outside.name}/{rel}", "absolute": str(outside / rel), "symlink": f"link-{rel}"}[where]
    if where == "symlink":
        (path / new).symlink_to(outside / rel)
    for info in md.storage_data.values():
        info.relative_path = new
    write_metadata(path, md)
    return new
