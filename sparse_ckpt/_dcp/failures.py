"""Which error a caller of ``dcp.save``/``dcp.load`` sees when the ranks failed inside sparse_ckpt."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import SparseCheckpointError

__all__ = ["own_failure"]


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
