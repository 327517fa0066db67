"""Finding the names other modules bound to a function before an integration replaced it.

A trainer that did ``from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict``
(or ``transformers.trainer``, which binds accelerate's ``save_fsdp_optimizer`` when it is imported)
holds the function object in its own globals; replacing the attribute of the defining module does
not reach it. :func:`bindings` finds every such name in the loaded modules by identity, so an
integration installed after the trainer's imports reaches the trainer (modules imported later bind
the replacement themselves). No trainer package is imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["bindings"]


def bindings(replacements: Mapping[int, tuple[Any, Any]], skip: Iterable[Any] = ()) -> list[tuple[Any, str, Any, Any]]:
    """``(module, name, original, replacement)`` for every global of a loaded module (other than
    those in ``skip``) bound to one of the originals; ``replacements`` maps ``id(original)`` to
    ``(original, replacement)``. Nothing is changed here."""
    skipped = {id(m) for m in skip}
    out = []
    for module in list(sys.modules.values()):
        if module is None or id(module) in skipped:
            continue
        try:
            namespace = vars(module)
        except TypeError:  # pragma: no cover - an odd sys.modules entry
            continue
        for name, value in list(namespace.items()):
            pair = replacements.get(id(value))
            if pair is not None and value is pair[0]:
                out.append((module, name, value, pair[1]))
    return out
