"""A sparse dict captured before a trainer writes anything of its checkpoint.

VeOmni's checkpointer writes ``extra_state/`` and Accelerate's ``save_state`` writes the models
before they call ``dcp.save`` for the optimizer, so a save that sparse_ckpt refuses inside
``dcp.save`` would leave a partial checkpoint behind. Their integrations capture the optimizer
first (`sparse_ckpt.SparseOptimizerState._captured`, with the table keys ``dcp.save`` would
choose) and hand DCP a `Captured`, which saves exactly that dict.
"""

from __future__ import annotations

from typing import Any

from .._dcp.stateful import SparseStateDict

__all__ = ["Captured"]


class Captured:
    """A DCP ``Stateful`` for a save whose dict was captured beforehand; never a load target."""

    def __init__(self, captured: SparseStateDict) -> None:
        self.captured = captured

    def state_dict(self) -> SparseStateDict:
        """The captured dict."""
        return self.captured

    def load_state_dict(self, state_dict: Any) -> None:
        """Refused: a captured optimizer is saved, never loaded."""
        raise TypeError("a captured optimizer is saved, never loaded")
