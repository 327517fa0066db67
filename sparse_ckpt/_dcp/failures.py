"""Which error a caller of ``dcp.save``/``dcp.load`` sees when the ranks failed inside sparse_ckpt."""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import SparseCheckpointError

__all__ = ["load_raising_own", "own_failure"]


def own_failure(exc: CheckpointException) -> BaseException | None:
    """The lowest rank's failure out of DCP's ``CheckpointException`` when every rank failed with a
    sparse_ckpt error (which then says what is wrong better than DCP's wrapper), else ``None``."""
    failures = []
    for _rank, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        if not isinstance(error, SparseCheckpointError):
            return None
        failures.append(error)
    return failures[0] if failures else None


def load_raising_own(state_dict: Any, **options: Any) -> None:
    """``dcp.load(state_dict, **options)``; a sparse_ckpt error every rank raised inside DCP comes out
    as itself (`own_failure`), not inside DCP's ``CheckpointException``."""
    try:
        dcp.load(state_dict, **options)
    except CheckpointException as exc:
        own = own_failure(exc)
        if own is None:
            raise
        raise own from exc
