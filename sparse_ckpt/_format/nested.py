"""Read torch DSD's *nested* optimizer layout (the migration path for existing checkpoints).

``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns, unless asked for
``flatten_optimizer_state_dict=True``, one nested dict per optimizer::

    {"state": {fqn: {key: value, ...}, ...},
     "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}, ...]}

This is what Hugging Face Accelerate's FSDP2 ``save_state`` writes (under ``"optimizer"`` in
``optimizer_{i}``) and what many trainers save. :func:`nested_to_sparse` rewrites such a dict
into the packed format's equivalent -- every group as it is, in order, in one group table of
leaf :data:`~sparse_ckpt._leaves.SINGLE_LEAF`, and each state value as its own item -- so every
reader (``load_sparse_state_dict``, the DCP planner, the CLI) reads it exactly as it reads a
sparse checkpoint: by FQN, settings of every group, state only where the dict has state.

It is faithful, not corrective: a nested dict written by DSD from an optimizer that had never
stepped holds the ``step=1`` / zero state that DSD's synthetic step invented, and that state is
loaded like any other (nothing is invented here, nothing is dropped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import _backend
from .._leaves import SINGLE_LEAF
from ..errors import CheckpointFormatError
from .codec import encode_table
from .keys import packed_table_key
from .keys_record import is_record_key

__all__ = ["NESTED_KEYS", "nested_kind", "nested_to_sparse"]

NESTED_KEYS = ("state", "param_groups")
"""The two entries of a torch optimizer state dict (``Optimizer.state_dict()`` and DSD's nested one)."""

PARAMS = "params"

_FQNS_ADVICE = (
    "write every 'params' entry and every 'state' key as its parameter's FQN, as "
    "get_optimizer_state_dict(model, optimizer) does (optimizer.load_state_dict would pair the entries by "
    "position and ignore the names)"
)
"""What to do with a nested dict that lists some parameters by FQN and others otherwise (an int id)."""


def nested_kind(sd: Any) -> str | None:
    """``"fqn"`` for DSD's nested FQN-keyed layout, ``"ids"`` for a torch ``Optimizer.state_dict()``
    (int parameter ids), ``None`` for anything else (a sparse or flat dict).

    A dict whose state and first group list no parameter at all is taken to be a torch one
    (neither layout can then be told from the other, and DSD never writes one)."""
    if not (isinstance(sd, Mapping) and NESTED_KEYS[0] in sd and NESTED_KEYS[1] in sd):
        return None
    state, groups = sd[NESTED_KEYS[0]], sd[NESTED_KEYS[1]]
    if not (isinstance(state, Mapping) and isinstance(groups, (list, tuple))):
        return None
    first_params = [list(g.get(PARAMS, ()))[:1] for g in groups[:1] if isinstance(g, Mapping)]
    keys = list(state)[:1] + [p for ps in first_params for p in ps]
    if any(isinstance(k, int) for k in keys) or not keys:
        return "ids"
    return "fqn"


def nested_to_sparse(sd: Mapping[str, Any], *, leaf: str = SINGLE_LEAF) -> dict[str, Any]:
    """DSD's nested dict ``sd`` as the equivalent packed-format dict (version 1: per-item state).

    Groups keep their order and settings (``params`` aside) in one table of leaf ``leaf``, so a
    group without parameters is matched by (leaf, index) like any packed one; each parameter's
    state becomes ``state.{fqn}.{key}`` items (nested state flattened, odd key parts escaped
    against the dict's own FQNs). Values are not copied. A structure that is not DSD's layout is
    a :class:`CheckpointFormatError` naming the group or FQN.
    """
    state, groups = sd[NESTED_KEYS[0]], sd[NESTED_KEYS[1]]
    if not isinstance(state, Mapping) or not isinstance(groups, (list, tuple)):
        raise CheckpointFormatError("a nested optimizer dict needs a 'state' mapping and a 'param_groups' list")
    extra = [k for k in sd if k not in NESTED_KEYS and not is_record_key(k)]
    if extra:
        raise CheckpointFormatError(
            f"nested optimizer dict: unexpected entries {extra[:3]!r} next to 'state' and 'param_groups'"
        )
    groups_fqn: list[tuple[dict, list[str]]] = []
    fqns: set[str] = set()
    for gi, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise CheckpointFormatError(
                f"nested optimizer dict: param group {gi} is a {type(group).__name__}, not a dict"
            )
        params = group.get(PARAMS)
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, str) for p in params):
            raise CheckpointFormatError(
                f"nested optimizer dict: param group {gi} has no 'params' list of FQNs (got {_kind(params)}): "
                + _FQNS_ADVICE
            )
        groups_fqn.append(({k: v for k, v in group.items() if k != PARAMS}, list(params)))
        fqns.update(params)
    bad = next((k for k in state if not isinstance(k, str)), None)
    if bad is not None:
        raise CheckpointFormatError(
            f"nested optimizer dict: state key {bad!r} is a {type(bad).__name__}, not an FQN: " + _FQNS_ADVICE
        )
    fqns.update(state)
    core = _backend.core
    plain_state = state if type(state) is dict else dict(state)
    out: dict[str, Any] = core.flatten_state(leaf, plain_state, fqns, True)
    table = encode_table(leaf, groups_fqn)
    out[packed_table_key(leaf, table)] = table
    out.update((k, v) for k, v in sd.items() if is_record_key(k))  # the key record: checked by the load
    return out


def _kind(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        odd = next((p for p in value if not isinstance(p, str)), None)
        return f"a list holding {type(odd).__name__} {odd!r}"
    return "nothing" if value is None else f"a {type(value).__name__}"
