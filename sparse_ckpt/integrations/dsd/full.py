"""``full_state_dict``, ``cpu_offload`` and ``broadcast_from_rank0`` for DSD-layout optimizer dicts.

Saving: `full_or_cpu` is DSD's own post-processing (torch's gathering and offloading), applied
to the sparse dict, so the values are DSD's. Loading: a full dict holds whole tensors; before the
library's loader reads it, `broadcast_from_rank0` gives every rank rank 0's dict (one
``broadcast_object_list`` of its structure, then one ``broadcast`` per tensor, in key order) and
`shard_like_params` cuts each parameter-shaped state tensor of a DTensor parameter into this
rank's shard (locally, no communication). Unlike DSD, no local template is needed, so nothing is
stepped to make one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from ..._dist import initialised, world_and_rank
from ..._format.keys import STATE_PREFIX, STEP_KEY, last_part, owner_fqn
from ..._fqn import FqnMap
from ..._torch_internals import gather_full_state_dict, offload_state_dict_to_cpu
from ...errors import SparseCheckpointError

__all__ = ["broadcast_from_rank0", "full_or_cpu", "shard_like_params"]


def full_or_cpu(state_dict: dict[str, Any], full_state_dict: bool, cpu_offload: bool) -> dict[str, Any]:
    """DSD's ``_maybe_full_or_cpu_state_dict``: gathered (kept on rank 0 only with ``cpu_offload``
    in a process group), or offloaded to CPU, or as it is."""
    if full_state_dict:
        ranks_only = (0,) if cpu_offload and initialised() else ()
        return gather_full_state_dict(state_dict, cpu_offload=cpu_offload, ranks_only=ranks_only)
    if cpu_offload:
        return offload_state_dict_to_cpu(state_dict)
    return state_dict


class _TensorSpec:
    """A tensor's place in the structure rank 0 broadcasts (its data follows separately)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = tuple(t.shape)
        self.dtype = t.dtype


def broadcast_from_rank0(
    data: dict[str, Any], device: torch.device, refusal: SparseCheckpointError | None = None
) -> dict[str, Any]:
    """Rank 0's ``data`` (a loadable flat dict: str keys, values plain) on every rank of the default
    process group; tensors travel through ``device`` (CPU for Gloo) and arrive on CPU. A ``refusal``
    rank 0 met reading its dict travels instead and is raised on every rank (the other ranks would
    otherwise wait in the broadcast for data that never comes)."""
    _world, rank = world_and_rank()
    skeleton: list[Any] = [None]
    if rank == 0:
        skeleton[0] = (
            refusal
            if refusal is not None
            else {k: _TensorSpec(v) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
        )
    dist.broadcast_object_list(skeleton, src=0)
    if isinstance(skeleton[0], SparseCheckpointError):
        raise skeleton[0]
    out: dict[str, Any] = {}
    for key, value in skeleton[0].items():
        if isinstance(value, _TensorSpec):
            if rank == 0:
                t = data[key].detach().to(device).contiguous()
            else:
                t = torch.empty(value.shape, dtype=value.dtype, device=device)
            dist.broadcast(t, src=0)
            out[key] = t.cpu() if device.type != "cpu" else t
        else:
            out[key] = value
    return out


def shard_like_params(data: dict[str, Any], fmap: FqnMap) -> dict[str, Any]:
    """``data`` with every whole state tensor of a DTensor parameter (same shape as the parameter,
    not ``step``) replaced by the DTensor of this rank's shard (same mesh and placements)."""
    out = dict(data)
    for key, value in data.items():
        if not (isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and key.startswith(STATE_PREFIX)):
            continue
        fqn = owner_fqn(key[len(STATE_PREFIX) :], fmap.canonical)
        if fqn is None or last_part(key) == STEP_KEY:
            continue
        param = fmap.param_of[fmap.canonical[fqn]]
        if isinstance(param, DTensor) and tuple(value.shape) == tuple(param.shape):
            out[key] = distribute_tensor(
                value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
            )
    return out
