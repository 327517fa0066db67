"""DCP object paths: where a flattened checkpoint key sits in the nested state dict that was saved.

Shared by the load planner (:mod:`sparse_ckpt._dcp.stateful`) and the checkpoint reader
(:mod:`sparse_ckpt._dcp.metadata`), so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

from torch.distributed.checkpoint.metadata import Metadata

ObjPath = tuple[Union[str, int], ...]


def metadata_path(metadata: Metadata, key: str) -> ObjPath:
    """The object path DCP recorded for flattened ``key`` (``(key,)`` when none was recorded)."""
    planner_data = metadata.planner_data
    if isinstance(planner_data, Mapping):
        p = planner_data.get(key)
        if p:
            return tuple(p)
    return (key,)


def metadata_paths(metadata: Metadata) -> dict[str, ObjPath]:
    """`metadata_path` of every key of the checkpoint, computed once for a whole load target."""
    return {key: metadata_path(metadata, key) for key in metadata.state_dict_metadata}


def set_path(root: dict[str, Any], path: ObjPath, value: Any) -> None:
    """Put ``value`` at ``path`` below ``root``, creating dicts (str keys) and lists (int keys)."""
    node: Any = root
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            assert isinstance(key, int)
            node.extend([None] * (key + 1 - len(node)))
            if last:
                node[key] = value
            else:
                if node[key] is None:
                    node[key] = {} if isinstance(path[i + 1], str) else []
                node = node[key]
        else:
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {} if isinstance(path[i + 1], str) else [])
