"""Which per-parameter state values a checkpoint holds: those a load gives back with their type and value.

A state value that is not a tensor and not in a scalar table is a DCP bytes item (DCP pickles it);
the library reads bytes items with ``weights_only=True`` (an untrusted file is never fully
unpickled), which refuses a ``numpy`` scalar, an ``Enum`` member, a
``Decimal``, a ``Fraction`` or a user's subclass of ``float`` or ``int``. Such a checkpoint would be
written and then refused by its own load, so a save refuses it first, before anything is written,
in every format and the in-memory dict alike (the dict is what DCP saves as it is), naming leaf,
FQN and key and what to store instead. Everything else round-trips with its type and value
(docs/formats.md, *State values*).
"""

from __future__ import annotations

import enum
import io
import numbers
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import CheckpointFormatError

__all__ = ["check_state_values", "values_load_back"]

_PLAIN = frozenset(
    (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size)
)
"""Exact types the restricted (weights-only) unpickler gives back as themselves (``torch.Size``:
the shape type; tensors are checked apart)."""
_SEQUENCES = frozenset((tuple, list, set))
_MAPPINGS = frozenset((dict, OrderedDict))
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_MAX_DEPTH = 64
_FINE = object()


def check_state_values(leaf: str, state_fqn: Mapping[str, Any], values: Iterable[Any]) -> None:
    """Refuse (`CheckpointFormatError`) a state value of ``state_fqn`` (``fqn -> {key: value}``) that a
    load could not give back with its type and value (see the module doc). ``values`` are the values
    the save writes as items (a cheap first look: when all are tensors, nothing is walked)."""
    if all(issubclass(kind, torch.Tensor) for kind in set(map(type, values))):
        return
    for fqn, state in state_fqn.items():
        if not isinstance(state, Mapping):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                continue
            bad = _offender(value, 0)
            if bad is not _FINE:
                raise CheckpointFormatError(_refusal(leaf, fqn, key, value, bad))


def values_load_back(values: Iterable[Any]) -> bool:
    """Whether every value of ``values`` (state values) is one a load gives back with its type and value
    (what `check_state_values` does not refuse)."""
    return all(isinstance(value, torch.Tensor) or _offender(value, 0) is _FINE for value in values)


def _offender(value: Any, depth: int, flattened: bool = True) -> Any:
    """The first (innermost) value inside ``value`` that a weights-only load refuses or gives back as
    another type, else ``_FINE``. ``flattened``: ``value`` is a state value or a value of a dict that
    is one; such dicts are flattened into keys (a dict of another type would come back a ``dict``)."""
    kind = type(value)
    if kind in _PLAIN or kind in _TENSORS:
        return _FINE
    if flattened and isinstance(value, Mapping) and kind is not dict:
        return value
    if depth < _MAX_DEPTH:
        if kind in _SEQUENCES:
            return next((bad for item in value if (bad := _offender(item, depth + 1, False)) is not _FINE), _FINE)
        if kind in _MAPPINGS:
            for k, v in value.items():
                for bad in (_offender(k, depth + 1, False), _offender(v, depth + 1, flattened)):
                    if bad is not _FINE:
                        return bad
            return _FINE
    return _FINE if _loads_back(value) else value


def _loads_back(value: Any) -> bool:
    """A value of another type round-trips when the restricted unpickler takes it back as its type
    (types a user allowed with ``torch.serialization.add_safe_globals``, a ``Counter``)."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal of the pickler or the restricted unpickler
        return False
    return type(back) is type(value)


def _refusal(leaf: str, fqn: str, key: Any, value: Any, bad: Any) -> str:
    kind = type(bad)
    name = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__
    inside = "" if bad is value else f" (inside a {type(value).__name__})"
    return (
        f"leaf {leaf!r}: state {key!r} of {fqn!r}: a value of type {name}{inside} cannot be loaded back: a load "
        "reads state values that are not tensors as plain data (weights-only unpickling), which refuses it, so "
        f"the checkpoint could not be resumed; store {_instead(bad)} in the optimizer's state instead"
    )


def _instead(bad: Any) -> str:
    """What to store instead of ``bad``: advice that, followed, saves and loads back."""
    if isinstance(bad, enum.Enum):
        return "the member's value (member.value)"
    module = type(bad).__module__.split(".")[0]
    if module == "numpy" and hasattr(bad, "item"):
        return "a plain Python value (value.item()) or a tensor (torch.tensor(value))"
    for base in (bool, int, float, complex, str, bytes, tuple, list, dict):
        if isinstance(bad, base):
            return f"a plain {base.__name__} ({base.__name__}(value))"
    if isinstance(bad, numbers.Number):
        return "a float (float(value)), a str (str(value)) or a tensor"
    return (
        "plain data: None, bool, int, float, complex, str, bytes, a tensor, a torch.dtype or torch.device, "
        "or tuples, lists, sets and dicts of these"
    )
