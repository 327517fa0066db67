"""Every exception and warning class of sparse_ckpt.

Every error raised on purpose by the library derives from `SparseCheckpointError`,
and its message names the leaf, group, FQN and key involved where they are known. The modules
that raise an error or issue a warning import it from here; the integration modules re-export
the ones their users catch (``sparse_ckpt.integrations.veomni.StockCheckpointWarning``).
"""

from __future__ import annotations

__all__ = [
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CoreFallbackWarning",
    "CrossRankStateError",
    "LauncherError",
    "NotACheckpointError",
    "PositionalLoadWarning",
    "ReentrantSerializationError",
    "SparseCheckpointError",
    "StockCheckpointWarning",
    "UnsupportedStateDictError",
    "UsageError",
]


class SparseCheckpointError(Exception):
    """Base class of every error sparse_ckpt raises on purpose."""


class UnsupportedStateDictError(SparseCheckpointError):
    """The optimizer customises ``state_dict`` in a way the library cannot reproduce faithfully."""


class ReentrantSerializationError(SparseCheckpointError):
    """A hook called back into serialization of an optimizer that is already being captured."""


class CheckpointMismatchError(SparseCheckpointError):
    """Checkpoint and target disagree: missing/extra FQNs, group sizes, conflicting settings."""


class CheckpointFormatError(SparseCheckpointError):
    """Corrupt, truncated or unknown-version data, or a value the codec cannot represent."""


class CrossRankStateError(CheckpointMismatchError):
    """One rank's optimizer dict reached another rank (docs/semantics.md): a pickled
    dict loaded on another rank, or a ``state_dict()`` saved by the main process only."""


class NotACheckpointError(CheckpointFormatError):
    """The directory does not exist or has no ``.metadata`` file (raised by the checkpoint reader)."""


class CoreFallbackWarning(UserWarning):
    """Issued once, when the package is first used, where it runs its Python core because the C++ core
    ``sparse_ckpt._C`` is not built in the package's folder or was built from other C++ sources than
    the ``csrc/`` beside it (the message says which, and how to rebuild)."""


class StockCheckpointWarning(UserWarning):
    """Issued when a stock VeOmni checkpoint was migrated (`sparse_ckpt.integrations.veomni`);
    its message is the ``StockMigrationReport``."""


class PositionalLoadWarning(UserWarning):
    """Issued when a torch ``Optimizer.state_dict()`` (int parameter ids, no names) was loaded by
    position onto the target's groups, as torch's own ``load_state_dict`` loads it (docs/semantics.md)."""


class UsageError(SparseCheckpointError):
    """A bad argument or destination given to the checkpoint tools or export (CLI exit status 2)."""


class LauncherError(SparseCheckpointError, RuntimeError):
    """``sparse-ckpt-run --strict`` (``SPARSE_CKPT_RUN_STRICT=1``): an integration the launcher was to
    activate in this process failed to install; raised from the import that triggered it."""
