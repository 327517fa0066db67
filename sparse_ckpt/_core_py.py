"""Pure-Python reference core. ``csrc/`` implements the same functions as ``sparse_ckpt._C``.

This module is the contract of the core: every function here has a C++ twin with identical
outputs (including dict key order) and identical exception types and messages for every input
inside the contract below. The core owns only the hot loops; it knows nothing of hooks, DCP or
torch beyond the ``tensor_type`` and the tensor (de)serialising callbacks it is handed.

Input contract (narrow on purpose: the library checks and converts user data once, at the Python
boundary -- ``capture`` checks what post-hooks and adapters return, ``decode`` turns any mapping
into a dict -- before it reaches the core):

  * sequences (param groups, ``params``, FQN lists, ``groups_fqn``, tensor shapes) are lists or
    tuples; pairs and triples (``(settings, fqns)``, ``(index, fqns)``, ``(raw, fqn, param)``,
    what ``to_parts`` returns) are tuples of exactly that length;
  * mappings are dicts; a dict subclass (``optimizer.state``'s ``defaultdict``, an
    ``OrderedDict`` in a state or a group) is read as a dict, in its storage order, without
    calling its own methods (the Python twin uses ``dict.items(d)`` where one can arrive);
  * tables and tensor data are ``bytes``; keys, FQNs, leaf, dtype and device names are ``str``
    (the codec raises its own :class:`CheckpointFormatError` for a non-str key or FQN); tensor
    dimensions are 64-bit ints.

Outside it the C++ core raises ``TypeError``/``ValueError`` (``expected ..., got ...``) and never
reads the input another way; the Python twin does what Python does. One function reads Python's
protocols on purpose: ``map_parameters`` walks ``_parameters``/``_modules`` mappings that are not
exact dicts through their own ``items()``, as torch's ``named_parameters`` does.

Vocabulary:
  * ``groups_fqn``: ``list[tuple[dict, list[str]]]`` -- one ``(settings, fqns)`` per param group,
    ``settings`` being the group without its ``"params"`` entry.
  * ``state_fqn``: ``dict[str, dict]`` -- per-parameter optimizer state keyed by FQN.
  * A *table* is the binary encoding of a leaf's ``groups_fqn`` (format below).

Table format, version 1 (all integers little endian)::

    magic b"SCKT" | u16 version | u32 n_settings | settings* | u32 n_groups | group*
    settings := u32 n_keys | (str key, value)*
    group    := u32 settings_index | u32 n_params | str*
    str      := u32 n_bytes | utf-8 bytes
    value    := u8 tag | payload        (tags: see _TAG_*)

Identical settings are stored once; the table lists distinct settings in order of first use.
"""

from __future__ import annotations

import array
import collections
import ctypes
import struct
from collections.abc import Callable, Mapping
from typing import Any

from ._core_py_buffers import decode_layout, encode_layout, plan_scatter  # noqa: F401 - twins of csrc/buffers.cpp
from ._core_py_load import (  # noqa: F401 - twins of csrc/load_plan.cpp
    build_groups,
    cast_states,
    fqns_of_groups,
    merge_scalars,
    merge_table_settings,
    unlisted_keys,
)
from ._core_py_reader import Reader
from ._core_py_save import capture_fqns, claim_owners  # noqa: F401 - twin of csrc/save_pass.cpp
from .errors import CheckpointFormatError, CheckpointMismatchError, UnsupportedStateDictError
from .keys import (  # noqa: F401 - the key grammar's constants are the core's too (_C exports the same)
    ESCAPE,
    ESCAPE_INT,
    ESCAPE_STR,
    GROUPS_PREFIX,
    KEYS_ENTRY,
    PACKED_MARKER,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    STATE_PREFIX,
    STEP_KEY,
    WRAPPER_CHILD,
    escape_part,
    is_flat_part,
    is_plain_part,
    owner_fqn,
    unescape_part,
)

MAGIC = b"SCKT"
VERSION = 1
MAX_DEPTH = 32

_TAG_NONE = 0
_TAG_FALSE = 1
_TAG_TRUE = 2
_TAG_INT = 3
_TAG_FLOAT = 4
_TAG_STR = 5
_TAG_BYTES = 6
_TAG_TUPLE = 7
_TAG_LIST = 8
_TAG_TENSOR = 9

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_MAX_ITEMSIZE = 16
_ADDRESS_END = 2**63
_U32_MAX = 2**32 - 1

TensorToParts = Callable[[Any], tuple[str, tuple[int, ...], str, bytes]]
PartsToTensor = Callable[[str, tuple[int, ...], str, bytes], Any]
ScalarParts = Callable[[Any], "tuple[str, tuple[int, ...], str, bytes] | None"]


# --------------------------------------------------------------------------- parameter names


_MEMO_SIZE = 7
"""``map_parameters``'s memo: ``(stripped, module_wrapper, words, keys, slots, fqn_of, canonical)``."""


def map_parameters(
    model: Any,
    stripped: Any,
    module_wrapper: type | None,
    base_named_modules: Any,
    base_named_parameters: Any,
    cached: tuple | None,
) -> tuple[tuple | None, dict[int, str], dict[str, str], dict[str, Any]] | None:
    """The FQN map of ``model``: ``(memo, fqn_of, canonical, param_of)`` (see :func:`fqn_tables`),
    or ``None`` when ``type(model).named_parameters`` is not ``base_named_parameters`` or some
    module's ``type(m).named_modules`` is not ``base_named_modules`` (the caller then uses the
    public API).

    Names come from one iterative walk over each module's ``_parameters`` and ``_modules`` (what
    torch's recursive ``named_modules`` reads), in ``named_parameters(remove_duplicate=False)``
    order. A name component in ``stripped``, or ``module`` directly under a ``module_wrapper``
    instance (DDP), is left out of the canonical name.

    ``memo`` lets a later call skip building the map: ``(stripped, module_wrapper, words, keys,
    slots, fqn_of, canonical)``, where ``words`` (native ``uint64``) and ``keys`` are what the walk
    saw -- per module its ``id``, the number of ``_parameters`` entries and each value's ``id`` (0
    for ``None``), the number of ``_modules`` entries and each child's ``id``, and a wrapper word
    (0 when no key of the module is ``WRAPPER_CHILD`` or there is no wrapper, else 1 + ``isinstance``);
    ``keys`` every key in that order -- and ``slots[i]`` the name ``param_of`` holds the i-th
    parameter found under (``None`` for a repeat). ``memo`` is ``None`` when some mapping is not an
    exact ``dict`` or ``OrderedDict`` or some key not an exact ``str``. Given a memo as ``cached`` (same ``stripped``
    and ``module_wrapper`` objects), the model is walked once comparing every module, key and
    value with it; when all are the same objects in the same places (so a fresh walk would give
    the same names), the result is ``(cached, cached fqn_of, cached canonical, param_of)`` with
    ``param_of`` holding the live parameters; otherwise the map is built anew. The memo holds no
    module or parameter, only their ids (a replaced object fails the comparison or, when a new
    object took a freed one's id and place, gets that place's name, as a fresh walk would give).
    """
    if cached is not None:
        if type(cached) is not tuple or len(cached) != _MEMO_SIZE:
            raise TypeError("map_parameters: cached is not a memo of map_parameters")
        if cached[0] is stripped and cached[1] is module_wrapper:
            param_of = _replay(model, module_wrapper, base_named_modules, base_named_parameters, cached)
            if param_of is not None:
                return cached, cached[5], cached[6], param_of
    trace = _Trace()
    named = _walk(model, stripped, module_wrapper, base_named_modules, base_named_parameters, trace)
    if named is None:
        return None
    fqn_of, canonical, param_of, slots = _tables(named)
    memo = None
    if trace.replayable:
        memo = (stripped, module_wrapper, trace.words.tobytes(), tuple(trace.keys), tuple(slots), fqn_of, canonical)
    return memo, fqn_of, canonical, param_of


_REPLAYABLE = (dict, collections.OrderedDict)
"""Module containers a trace records and a replay reads again exactly (``ModuleList.__delitem__``
leaves an ``OrderedDict``); any other mapping is walked through its ``items()`` but not replayed."""


class _Trace:
    """What :func:`_walk` saw (see :func:`map_parameters`)."""

    def __init__(self) -> None:
        self.words = array.array("Q")
        self.keys: list[Any] = []
        self.replayable = True

    def key(self, k: Any) -> None:
        if type(k) is not str:
            self.replayable = False
        self.keys.append(k)


def _id_word(obj: Any) -> int:
    return 0 if obj is None else id(obj)


def _is_module_key(k: Any) -> bool:
    return type(k) is str and k == WRAPPER_CHILD


def _wrapper_word(mod: Any, module_wrapper: type | None, has_module_key: bool) -> int:
    if not has_module_key or module_wrapper is None:
        return 0
    return 1 + bool(isinstance(mod, module_wrapper))


def _walk(
    model: Any,
    stripped: Any,
    module_wrapper: type | None,
    base_named_modules: Any,
    base_named_parameters: Any,
    trace: _Trace,
) -> list[tuple[str, str, Any]] | None:
    """``(raw name, canonical name, param)`` for every parameter, recording ``trace``; ``None``
    for an override (see :func:`map_parameters`). While nothing was left out the canonical name
    is the raw ``str`` object itself."""
    if type(model).named_parameters is not base_named_parameters:
        return None
    out: list[tuple[str, str, Any]] = []
    stack: list[tuple[Any, str, str]] = [(model, "", "")]
    words = trace.words
    while stack:
        mod, raw, canon = stack.pop()
        if type(mod).named_modules is not base_named_modules:
            return None
        words.append(id(mod))
        has_module_key = False
        params = mod._parameters
        if type(params) not in _REPLAYABLE:
            trace.replayable = False
        count_at = len(words)
        words.append(0)
        if params:
            for k, v in params.items():
                trace.key(k)
                words.append(_id_word(v))
                has_module_key = has_module_key or _is_module_key(k)
                if v is None:
                    continue
                raw_k = f"{raw}.{k}" if raw else k
                if k in stripped or (module_wrapper is not None and k == WRAPPER_CHILD and isinstance(mod, module_wrapper)):
                    out.append((raw_k, canon, v))
                elif canon is raw:
                    out.append((raw_k, raw_k, v))
                else:
                    out.append((raw_k, f"{canon}.{k}" if canon else k, v))
        words[count_at] = len(words) - count_at - 1
        children = mod._modules
        items = list(children.items()) if children else []
        if type(children) not in _REPLAYABLE:
            trace.replayable = False
        words.append(len(items))
        for name, child in items:
            trace.key(name)
            words.append(_id_word(child))
            has_module_key = has_module_key or _is_module_key(name)
        for name, child in reversed(items):
            if child is None:
                continue
            raw_c = f"{raw}.{name}" if raw else name
            if name in stripped or (module_wrapper is not None and name == WRAPPER_CHILD and isinstance(mod, module_wrapper)):
                stack.append((child, raw_c, canon))
            elif canon is raw:
                stack.append((child, raw_c, raw_c))
            else:
                stack.append((child, raw_c, f"{canon}.{name}" if canon else name))
        words.append(_wrapper_word(mod, module_wrapper, has_module_key))
    return out


def _replay(
    model: Any, module_wrapper: type | None, base_named_modules: Any, base_named_parameters: Any, memo: tuple
) -> dict[str, Any] | None:
    """Walk ``model`` comparing every module, key and value with ``memo``'s trace: the new
    ``param_of`` when all are the same, else ``None`` (see :func:`map_parameters`)."""
    if type(model).named_parameters is not base_named_parameters:
        return None
    raw_words, keys, slots = memo[2], memo[3], memo[4]
    if type(raw_words) is not bytes or type(keys) is not tuple or type(slots) is not tuple:
        raise TypeError("map_parameters: cached is not a memo of map_parameters")
    words = array.array("Q")
    words.frombytes(raw_words[: len(raw_words) - len(raw_words) % words.itemsize])
    wi = ki = si = 0
    param_of: dict[str, Any] = {}
    stack = [model]
    try:
        while stack:
            mod = stack.pop()
            if words[wi] != id(mod) or type(mod).named_modules is not base_named_modules:
                return None
            wi += 1
            has_module_key = False
            params = mod._parameters
            if type(params) not in _REPLAYABLE or words[wi] != len(params):
                return None
            wi += 1
            for k, v in params.items():
                if words[wi] != _id_word(v) or not _same_key(keys[ki], k):
                    return None
                wi += 1
                ki += 1
                has_module_key = has_module_key or _is_module_key(k)
                if v is None:
                    continue
                slot = slots[si]
                si += 1
                if slot is not None:
                    param_of[slot] = v
            children = mod._modules
            if type(children) not in _REPLAYABLE or words[wi] != len(children):
                return None
            wi += 1
            found = []
            for k, v in children.items():
                if words[wi] != _id_word(v) or not _same_key(keys[ki], k):
                    return None
                wi += 1
                ki += 1
                has_module_key = has_module_key or _is_module_key(k)
                if v is not None:
                    found.append(v)
            stack.extend(reversed(found))
            if words[wi] != _wrapper_word(mod, module_wrapper, has_module_key):
                return None
            wi += 1
    except IndexError:  # the model has more than the trace
        return None
    if wi != len(words) or ki != len(keys) or si != len(slots):
        return None
    return param_of


def _same_key(saved: str, k: Any) -> bool:
    return saved is k or (type(k) is str and saved == k)


def _tables(named: Any) -> tuple[dict[int, str], dict[str, str], dict[str, Any], list[str | None]]:
    """:func:`fqn_tables` and ``slots`` (see :func:`map_parameters`)."""
    fqn_of: dict[int, str] = {}
    canonical: dict[str, str] = {}
    param_of: dict[str, Any] = {}
    slots: list[str | None] = []
    for raw, fqn, param in named:
        primary = fqn_of.get(id(param))
        if primary is None:
            if fqn in param_of:  # another parameter has this canonical name: keep the raw one
                if raw in param_of:
                    raise CheckpointMismatchError(
                        f"parameter {raw!r} and another parameter both have the FQN {fqn!r} "
                        f"and {raw!r} is taken too; rename one of them"
                    )
                fqn = raw
            fqn_of[id(param)] = fqn
            param_of[fqn] = param
            slots.append(fqn)
            primary = fqn
        else:
            slots.append(None)
        canonical.setdefault(fqn, primary)
        canonical.setdefault(raw, primary)
    return fqn_of, canonical, param_of, slots


def fqn_tables(named: Any) -> tuple[dict[int, str], dict[str, str], dict[str, Any]]:
    """``(fqn_of, canonical, param_of)`` from ``(raw, canonical name, param)`` triples.

    ``fqn_of``: ``id(param)`` -> its first canonical name; ``canonical``: every canonical and raw
    name -> the first canonical name of its parameter (first wins); ``param_of``: first canonical
    name -> param. A parameter whose canonical name already names another parameter (a root
    ``w`` and a compiled ``_orig_mod.w``) keeps its raw name as FQN, so no two parameters share one.
    """
    fqn_of, canonical, param_of, _slots = _tables(named)
    return fqn_of, canonical, param_of


# --------------------------------------------------------------------------- capture


def pack_optimizer(
    leaf: str, param_groups: list[dict], state: dict[Any, Any], tensor_type: type
) -> tuple[list[dict], dict[Any, Any], list[Any]]:
    """Pack ``param_groups``/``state`` exactly as ``torch.optim.Optimizer.state_dict`` does.

    Returns ``(packed_groups, packed_state, id_to_param)``: groups are shallow copies with
    ``"params"`` replaced by int ids (first occurrence of a parameter wins, ids advance by the
    group length as in torch), state keys are remapped to those ids, and ``id_to_param[i]`` is
    the parameter that received id ``i`` (``None`` for an id never assigned).
    """
    mapping: dict[int, int] = {}
    id_to_param: list[Any] = []
    packed_groups: list[dict] = []
    for group in param_groups:
        packed = {k: v for k, v in dict.items(group) if k != "params"}
        params = group["params"]
        start = len(id_to_param)
        for offset, p in enumerate(params):
            if id(p) not in mapping:
                mapping[id(p)] = start + offset
                id_to_param.append(p)
            else:
                id_to_param.append(None)
        packed["params"] = [mapping[id(p)] for p in params]
        packed_groups.append(packed)
    packed_state: dict[Any, Any] = {}
    for key, value in state.items():
        if isinstance(key, tensor_type):
            if id(key) not in mapping:
                raise UnsupportedStateDictError(
                    f"leaf {leaf!r}: optimizer.state holds a tensor of shape {tuple(key.shape)} "
                    "that is in no param group"
                )
            packed_state[mapping[id(key)]] = value
        else:
            packed_state[key] = value
    return packed_groups, packed_state, id_to_param


def remap_to_fqns(
    leaf: str,
    packed_groups: list[dict],
    packed_state: dict[Any, Any],
    id_to_param: list[Any],
    fqn_of: dict[int, str],
) -> tuple[list[tuple[dict, list[str]]], dict[str, Any]]:
    """Turn a packed (int-id) optimizer dict into ``(groups_fqn, state_fqn)``.

    ``id_to_param`` is the snapshot taken by :func:`pack_optimizer`; ``fqn_of`` maps
    ``id(param)`` to its canonical FQN. State entries keep the packed state's order.
    """
    n_ids = len(id_to_param)

    def fqn_for(pid: Any, where: str) -> str:
        if type(pid) is not int or pid < 0 or pid >= n_ids or id_to_param[pid] is None:
            raise CheckpointFormatError(
                f"leaf {leaf!r}: {where} refers to parameter id {pid!r}, which the optimizer never assigned"
            )
        param = id_to_param[pid]
        fqn = fqn_of.get(id(param))
        if fqn is None:
            raise CheckpointMismatchError(
                f"leaf {leaf!r}: {where}: optimizer parameter of shape {tuple(param.shape)} "
                "is not owned by the model"
            )
        return fqn

    groups_fqn: list[tuple[dict, list[str]]] = []
    for gi, group in enumerate(packed_groups):
        if "params" not in group:
            raise CheckpointFormatError(f"leaf {leaf!r}: group {gi} has no 'params' entry")
        settings = {k: v for k, v in dict.items(group) if k != "params"}
        fqns = [fqn_for(pid, f"group {gi}") for pid in group["params"]]
        groups_fqn.append((settings, fqns))
    state_fqn: dict[str, Any] = {}
    for pid, value in packed_state.items():
        if type(pid) is not int:
            raise UnsupportedStateDictError(
                f"leaf {leaf!r}: optimizer.state has a non-parameter key {pid!r}, which has no FQN"
            )
        state_fqn[fqn_for(pid, "state")] = value
    return groups_fqn, state_fqn


# --------------------------------------------------------------------------- flat keys


def _state_part(leaf: str, fqn: str, key: Any, path: tuple[Any, ...], escape: bool) -> str:
    """The flat-key form of one state key part (escaped in the packed format), or raise."""
    if is_plain_part(key):
        return key
    if escape:
        escaped = escape_part(key)
        if escaped is not None:
            return escaped
        raise CheckpointFormatError(
            f"leaf {leaf!r}: state key {_path_repr((*path, key))} of {fqn!r} is a {type(key).__name__}; "
            "state keys must be str or int"
        )
    if is_flat_part(key):
        return key
    raise CheckpointFormatError(
        f"leaf {leaf!r}: state key {_path_repr((*path, key))} of {fqn!r} cannot be written in the flat "
        "format (a key must be a str without '.'); save with format='packed'"
    )


def _path_repr(path: tuple[Any, ...]) -> str:
    return " -> ".join(repr(k) for k in path)


def _flatten_into(
    out: dict[str, Any],
    prefix: str,
    value: dict[Any, Any],
    leaf: str,
    fqn: str,
    path: tuple[Any, ...],
    known_fqns: Any,
    escape: bool,
    emitted: list[str] | None = None,
) -> None:
    for key, item in dict.items(value):
        _flatten_item(out, prefix, key, item, leaf, fqn, path, known_fqns, escape, emitted)


def _flatten_item(
    out: dict[str, Any],
    prefix: str,
    key: Any,
    item: Any,
    leaf: str,
    fqn: str,
    path: tuple[Any, ...],
    known_fqns: Any,
    escape: bool,
    emitted: list[str] | None = None,
) -> None:
    """One entry ``key: item`` of the (nested) state under ``prefix``; each key written is also
    appended to ``emitted`` when given."""
    part = _state_part(leaf, fqn, key, path, escape)
    full = f"{prefix}.{part}"
    if isinstance(item, dict):
        if not item:
            raise CheckpointFormatError(
                f"leaf {leaf!r}: state key {_path_repr((*path, key))} of {fqn!r} holds an empty dict, "
                "which has no flat key"
            )
        if full[len(STATE_PREFIX) :] in known_fqns:  # keys below would read as that parameter's state
            escaped = escape_part(key) if escape and part is key else None
            if escaped is None or f"{prefix}.{escaped}"[len(STATE_PREFIX) :] in known_fqns:
                raise CheckpointFormatError(
                    f"leaf {leaf!r}: nested state {_path_repr((*path, key))} of {fqn!r} would be read back as "
                    f"state of parameter {full[len(STATE_PREFIX) :]!r}"
                    + ("" if escape else "; save with format='packed'")
                )
            full = f"{prefix}.{escaped}"
        _flatten_into(out, full, item, leaf, fqn, (*path, key), known_fqns, escape, emitted)
    else:
        out[full] = item
        if emitted is not None:
            emitted.append(full)


def flatten_state(leaf: str, state_fqn: dict[str, Any], known_fqns: Any, escape: bool) -> dict[str, Any]:
    """``state.{fqn}.{key}`` for every state entry; nested dicts are flattened with ``.``.

    ``escape=True`` (packed format) escapes key parts that are not plain (see
    :mod:`sparse_ckpt.keys`) and nested parts whose dotted path is in ``known_fqns`` (another
    parameter's FQN); ``escape=False`` (flat format) refuses them. Empty nested dicts are refused
    (no flat key can hold them); an empty top-level state dict emits nothing (no state).
    """
    out: dict[str, Any] = {}
    for fqn, state in state_fqn.items():
        if not isinstance(state, dict):
            raise CheckpointFormatError(f"leaf {leaf!r}: state of {fqn!r} is a {type(state).__name__}, expected a dict")
        _flatten_into(out, f"{STATE_PREFIX}{fqn}", state, leaf, fqn, (), known_fqns, escape)
    return out


def _check_cpu_dtypes(cpu_dtypes: Any) -> None:
    """``cpu_dtypes`` of :func:`flatten_packed_state`: an exact dict of ``dtype -> (name, itemsize)``."""
    if type(cpu_dtypes) is not dict:
        raise TypeError(f"flatten_packed_state: cpu_dtypes must be a dict, got {type(cpu_dtypes).__name__}")
    for spec in cpu_dtypes.values():
        if not (
            type(spec) is tuple
            and len(spec) == 2
            and type(spec[0]) is str
            and type(spec[1]) is int
            and 1 <= spec[1] <= _MAX_ITEMSIZE
        ):
            raise TypeError(
                "flatten_packed_state: cpu_dtypes values must be (str, int) tuples with an item size "
                f"from 1 to {_MAX_ITEMSIZE}, got {spec!r}"
            )


def _cpu_scalar_data(value: Any, cpu_dtypes: dict, strided: Any) -> tuple[str, bytes] | None:
    """``(dtype name, element bytes)`` of a 0-d ``tensor_type`` value that the core reads itself:
    its ``dtype`` is in ``cpu_dtypes``, ``requires_grad`` and ``is_neg()`` are ``False``,
    ``is_cpu`` is ``True``, ``layout`` is ``strided`` and ``data_ptr()`` is a positive 64-bit
    int; the bytes are the element's ``itemsize`` bytes at ``data_ptr()``. ``None``: any other
    0-d tensor. ``cpu_dtypes`` holds no complex dtype, the only ones with a conj bit.

    The C++ twin reads the properties through the data descriptors it looks up on
    ``tensor_type`` once per call (what attribute access does for a data descriptor), so the
    callbacks must not change ``tensor_type``'s attributes."""
    spec = cpu_dtypes.get(value.dtype)
    if (
        spec is None
        or value.requires_grad is not False
        or value.is_cpu is not True
        or value.layout is not strided
        or value.is_neg() is not False
    ):
        return None
    ptr = value.data_ptr()
    if type(ptr) is not int or not 0 < ptr < _ADDRESS_END:
        return None
    return spec[0], ctypes.string_at(ptr, spec[1])


def _scalar_record(
    leaf: str,
    fqn: Any,
    key: Any,
    value: Any,
    tensor_type: type,
    cpu_dtypes: dict,
    strided: Any,
    scalar_parts: ScalarParts,
) -> bytes | None:
    """The table-codec bytes of one state entry (``str key, value``) that belongs in a scalar
    table, or ``None`` when it stays a per-item entry: the key must be a plain part that UTF-8
    can encode, the value an exact ``bool``, a 64-bit ``int``, a ``float``, or a ``tensor_type``
    (exact type) whose ``ndim`` is ``0`` and which is either a plain CPU scalar
    (:func:`_cpu_scalar_data`, read without a callback) or one for which ``scalar_parts``
    returns tensor parts (not ``None``)."""
    if not is_plain_part(key):
        return None
    try:
        raw_key = key.encode("utf-8")
    except UnicodeEncodeError:
        return None
    out = bytearray(_len32(len(raw_key)))
    out += raw_key
    kind = type(value)
    if kind is bool:
        out.append(_TAG_TRUE if value else _TAG_FALSE)
    elif kind is int:
        if value < _INT64_MIN or value > _INT64_MAX:
            return None
        out.append(_TAG_INT)
        out += _I64.pack(value)
    elif kind is float:
        out.append(_TAG_FLOAT)
        out += _F64.pack(value)
    elif kind is tensor_type:
        ndim = value.ndim
        if type(ndim) is not int or ndim != 0:
            return None
        fast = _cpu_scalar_data(value, cpu_dtypes, strided)
        if fast is not None:
            parts: Any = (fast[0], (), "cpu", fast[1])
        else:
            parts = scalar_parts(value)
            if parts is None:
                return None
        _encode_tensor_parts(out, parts, f"leaf {leaf!r}: state {key!r} of {fqn!r}")
    else:
        return None
    return bytes(out)


def flatten_packed_state(
    leaf: str,
    state_fqn: dict[str, Any],
    known_fqns: Any,
    tensor_type: type,
    cpu_dtypes: dict,
    strided: Any,
    scalar_parts: ScalarParts,
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], list[str]]]]:
    """:func:`flatten_state` (``escape=True``) of the packed format, version 2, with the scalars
    hoisted into a scalar table's groups.

    Returns ``(items, scalar_groups)``. Each parameter's *leading run* of state entries that
    :func:`_scalar_record` accepts (in the state dict's order) is left out of ``items``;
    ``scalar_groups`` lists ``(scalars, fqns)``: every distinct scalar dict (distinct by its
    encoded bytes, in order of first appearance; a new dict holding the saved values) with the
    FQNs whose leading run is exactly it, in state order -- ready for :func:`encode_table`.
    Every parameter with state is in one group: its scalar dict ends with the entry
    :data:`~sparse_ckpt.keys.KEYS_ENTRY` (``"~keys"``), the tuple of the keys it wrote to
    ``items`` without their ``state.{fqn}.`` prefix, in order (the checkpoint's record of which
    state each parameter has; a key UTF-8 cannot encode is recorded as its surrogate-passing
    UTF-8 ``bytes``). A parameter whose state is an empty dict has no state: no group.

    ``cpu_dtypes`` (an exact dict, else :class:`TypeError`) maps each ``dtype`` whose plain CPU
    0-d tensors the core encodes itself to ``(codec dtype name, item size)`` (no complex dtype:
    the core does not read the conj bit); ``strided`` is the
    strided layout object. ``scalar_parts`` is called only for the other 0-d tensors (another
    device or dtype, autograd, conj/neg bits...), never for tensors with ``ndim != 0``. Errors
    are :func:`flatten_state`'s.
    """
    _check_cpu_dtypes(cpu_dtypes)
    out: dict[str, Any] = {}
    groups: list[tuple[dict[str, Any], list[str]]] = []
    index_of: dict[bytes, int] = {}
    for fqn, state in state_fqn.items():
        if not isinstance(state, dict):
            raise CheckpointFormatError(f"leaf {leaf!r}: state of {fqn!r} is a {type(state).__name__}, expected a dict")
        prefix = f"{STATE_PREFIX}{fqn}"
        scalars: dict[str, Any] = {}
        blob = bytearray()
        leading = True
        emitted: list[str] = []
        for key, item in dict.items(state):
            if leading:
                record = _scalar_record(leaf, fqn, key, item, tensor_type, cpu_dtypes, strided, scalar_parts)
                if record is not None:
                    scalars[key] = item
                    blob += record
                    continue
                leading = False
            _flatten_item(out, prefix, key, item, leaf, fqn, (), known_fqns, True, emitted)
        if scalars or emitted:
            cut = len(prefix) + 1
            keys = tuple(_recorded_key(k[cut:]) for k in emitted)
            scalars[KEYS_ENTRY] = keys
            blob += _keys_record(keys)
            ident = _len32(len(scalars)) + bytes(blob)
            idx = index_of.get(ident)
            if idx is None:
                index_of[ident] = len(groups)
                groups.append((scalars, [fqn]))
            else:
                groups[idx][1].append(fqn)
    return out, groups


def _recorded_key(key: str) -> str | bytes:
    """A per-item key as :data:`~sparse_ckpt.keys.KEYS_ENTRY` records it: the ``str`` itself, or
    its UTF-8 bytes with lone surrogates passed through when UTF-8 cannot encode it (the table
    codec holds only valid text)."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return key.encode("utf-8", "surrogatepass")
    return key


def _keys_record(keys: tuple[str | bytes, ...]) -> bytes:
    """The grouping bytes of a :data:`~sparse_ckpt.keys.KEYS_ENTRY` entry (name, tuple tag, count,
    each key's UTF-8 bytes, lone surrogates passed through): only compared, never decoded."""
    out = bytearray(_len32(len(KEYS_ENTRY)))
    out += KEYS_ENTRY.encode("utf-8")
    out.append(_TAG_TUPLE)
    out += _len32(len(keys))
    for k in keys:
        raw = k if isinstance(k, bytes) else k.encode("utf-8", "surrogatepass")
        out.append(_TAG_STR)
        out += _len32(len(raw))
        out += raw
    return bytes(out)


def flatten_groups(leaf: str, groups_fqn: list[tuple[dict, list[str]]]) -> dict[str, Any]:
    """``param_groups.{fqn}.{key}`` for every parameter of every group (DSD's flat layout).

    A setting key that is not a ``str`` or contains ``.`` cannot be read back from that layout
    and is refused.
    """
    out: dict[str, Any] = {}
    for gi, (settings, fqns) in enumerate(groups_fqn):
        for key in dict.keys(settings):
            if not is_flat_part(key):
                raise CheckpointFormatError(
                    f"leaf {leaf!r} group {gi}: setting key {key!r} cannot be written in the flat format "
                    "(a key must be a str without '.'); save with format='packed'"
                )
        for fqn in fqns:
            for key, value in dict.items(settings):
                out[f"{GROUPS_PREFIX}{fqn}.{key}"] = value
    return out


def unflatten(
    flat: dict[str, Any], known_fqns: Any
) -> tuple[dict[str, dict], dict[str, dict], dict[str, bytes], dict[str, bytes], list[str]]:
    """Split a flat/packed optimizer dict into its parts.

    Returns ``(settings_by_fqn, state_by_fqn, packed_tables, scalar_tables, unmatched_keys)``:
      * ``param_groups.{fqn}.{key}`` -> ``settings_by_fqn[fqn][key]`` (split at the last dot);
      * ``param_groups.__packed__.{rest}`` -> ``packed_tables[rest]`` (must be bytes);
      * ``state.__packed__.{rest}`` -> ``scalar_tables[rest]`` (must be bytes; decoded by the caller);
      * ``state.{fqn}.{k1}.{k2}`` -> ``state_by_fqn[fqn][k1][k2]``, where ``fqn`` is the longest
        prefix that is in ``known_fqns`` or among the flat param-group FQNs. ``known_fqns`` is a
        dict or set, or a callable that is given ``packed_tables`` once they are split off and
        returns one (so state resolves against the FQNs the checkpoint's own tables list). When
        there are packed or scalar tables, key parts starting with ``~`` are unescaped (see
        :mod:`sparse_ckpt.keys`);
      * every other key, and state keys with no known FQN, -> ``unmatched_keys``.
    Each key is resolved with O(depth) hash lookups; there are no prefix scans. ``flat`` is never
    modified: a dict value that nested keys extend (``state.w.a`` = ``{...}`` and ``state.w.a.b``)
    is copied (``.copy()``) before it is written into.
    """
    settings_by_fqn: dict[str, dict] = {}
    packed: dict[str, bytes] = {}
    scalars: dict[str, bytes] = {}
    unmatched: list[str] = []
    state_keys: list[str] = []
    for key, value in flat.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"optimizer state dict key {key!r} is not a string")
        if key.startswith(SCALARS_PREFIX):
            if not isinstance(value, bytes):
                raise CheckpointFormatError(f"scalar table {key!r} is a {type(value).__name__}, expected bytes")
            scalars[key[len(SCALARS_PREFIX) :]] = value
        elif key.startswith(STATE_PREFIX):
            state_keys.append(key)
        elif key.startswith(PACKED_PREFIX):
            if not isinstance(value, bytes):
                raise CheckpointFormatError(
                    f"packed group table {key!r} is a {type(value).__name__}, expected bytes"
                )
            packed[key[len(PACKED_PREFIX) :]] = value
        elif key.startswith(GROUPS_PREFIX):
            body = key[len(GROUPS_PREFIX) :]
            dot = body.rfind(".")
            if dot <= 0 or dot == len(body) - 1:
                unmatched.append(key)
                continue
            settings_by_fqn.setdefault(body[:dot], {})[body[dot + 1 :]] = value
        else:
            unmatched.append(key)
    if callable(known_fqns):
        known_fqns = known_fqns(packed)
    unescape = bool(packed) or bool(scalars)
    state_by_fqn: dict[str, dict] = {}
    owned: set[int] = set()  # ids of the dicts built here (all alive in state_by_fqn until we return)
    for key in state_keys:
        body = key[len(STATE_PREFIX) :]
        fqn = owner_fqn(body, known_fqns, settings_by_fqn)
        if fqn is None:
            unmatched.append(key)
            continue
        parts: list[Any] = body[len(fqn) + 1 :].split(".")
        if unescape:
            parts = [unescape_part(p, key) if p.startswith(ESCAPE) else p for p in parts]
        node = state_by_fqn.get(fqn)
        if node is None:
            node = state_by_fqn[fqn] = {}
            owned.add(id(node))
        for part in parts[:-1]:
            fresh: dict = {}
            child = node.setdefault(part, fresh)
            if child is fresh:
                owned.add(id(fresh))
            elif not isinstance(child, dict):
                raise CheckpointFormatError(f"state key {key!r} nests under a non-dict value of {fqn!r}")
            elif id(child) not in owned:  # a dict value of the input: copy it, never write into it
                child = child.copy()
                node[part] = child
                owned.add(id(child))
            node = child
        if parts[-1] in node and isinstance(node[parts[-1]], dict):
            raise CheckpointFormatError(f"state key {key!r} collides with nested state of {fqn!r}")
        node[parts[-1]] = flat[key]
    return settings_by_fqn, state_by_fqn, packed, scalars, unmatched


# --------------------------------------------------------------------------- table codec


def _len32(n: int) -> bytes:
    """A length as u32; one the table format cannot hold is a :class:`CheckpointFormatError`."""
    if n > _U32_MAX:
        raise CheckpointFormatError(f"length {n} does not fit the table format (at most {_U32_MAX})")
    return _U32.pack(n)


def _encode_value(out: bytearray, value: Any, tensor_type: type, to_parts: TensorToParts, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise CheckpointFormatError(f"{where}: value nested deeper than {MAX_DEPTH} levels")
    if value is None:
        out.append(_TAG_NONE)
    elif isinstance(value, bool):
        out.append(_TAG_TRUE if value else _TAG_FALSE)
    elif isinstance(value, int):
        if value < _INT64_MIN or value > _INT64_MAX:
            raise CheckpointFormatError(f"{where}: int {value} does not fit in 64 bits")
        out.append(_TAG_INT)
        out += _I64.pack(value)
    elif isinstance(value, float):
        out.append(_TAG_FLOAT)
        out += _F64.pack(value)
    elif isinstance(value, str):
        out.append(_TAG_STR)
        _encode_str(out, value, where)
    elif isinstance(value, bytes):
        out.append(_TAG_BYTES)
        out += _len32(len(value))
        out += value
    elif isinstance(value, (tuple, list)):
        out.append(_TAG_TUPLE if isinstance(value, tuple) else _TAG_LIST)
        out += _len32(len(value))
        for item in value:
            _encode_value(out, item, tensor_type, to_parts, where, depth + 1)
    elif isinstance(value, tensor_type):
        _encode_tensor_parts(out, to_parts(value), where)
    else:
        raise CheckpointFormatError(f"{where}: unsupported value type {type(value).__name__}")


def _encode_tensor_parts(out: bytearray, parts: Any, where: str) -> None:
    """A tensor value (tag and payload) from its ``(dtype, shape, device_type, data)`` parts."""
    dtype, shape, device_type, data = parts
    out.append(_TAG_TENSOR)
    _encode_str(out, dtype, where)
    out += _len32(len(shape))
    for dim in shape:
        out += _I64.pack(dim)
    _encode_str(out, device_type, where)
    out += _U64.pack(len(data))
    out += data


def _encode_str(out: bytearray, text: str, where: str) -> None:
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CheckpointFormatError(f"{where}: string is not valid unicode ({exc.reason})") from None
    out += _len32(len(raw))
    out += raw


def encode_settings(leaf: str, group_index: int, settings: dict[Any, Any], tensor_type: type, to_parts: TensorToParts) -> bytes:
    """Encode one group's settings (the ``settings`` production of the table format)."""
    out = bytearray()
    out += _len32(len(settings))
    for key, value in dict.items(settings):
        if not isinstance(key, str):
            raise CheckpointFormatError(f"leaf {leaf!r} group {group_index}: setting key {key!r} is not a string")
        where = f"leaf {leaf!r} group {group_index} key {key!r}"
        _encode_str(out, key, where)
        _encode_value(out, value, tensor_type, to_parts, where, 0)
    return bytes(out)


def encode_table(leaf: str, groups_fqn: list[tuple[dict, list[str]]], tensor_type: type, to_parts: TensorToParts) -> bytes:
    """Encode a leaf's groups as a version-1 table; deterministic, settings deduplicated (one
    settings object listed by several groups is encoded once: callers do not change it meanwhile)."""
    if not isinstance(leaf, str):
        raise CheckpointFormatError(f"leaf name {leaf!r} is not a string")
    index_of: dict[bytes, int] = {}
    index_of_id: dict[int, int] = {}  # id(settings) -> its index: a settings dict met again is not re-encoded
    blobs: list[bytes] = []
    refs: list[int] = []
    for gi, (settings, _fqns) in enumerate(groups_fqn):
        idx = index_of_id.get(id(settings))
        if idx is None:
            blob = encode_settings(leaf, gi, settings, tensor_type, to_parts)
            idx = index_of.get(blob)
            if idx is None:
                idx = index_of[blob] = len(blobs)
                blobs.append(blob)
            index_of_id[id(settings)] = idx
        refs.append(idx)
    out = bytearray(MAGIC)
    out += _U16.pack(VERSION)
    out += _len32(len(blobs))
    for blob in blobs:
        out += blob
    out += _len32(len(groups_fqn))
    for gi, ((_settings, fqns), idx) in enumerate(zip(groups_fqn, refs)):
        out += _U32.pack(idx)
        out += _len32(len(fqns))
        for fqn in fqns:
            if not isinstance(fqn, str):
                raise CheckpointFormatError(f"leaf {leaf!r} group {gi}: FQN {fqn!r} is not a string")
            _encode_str(out, fqn, f"leaf {leaf!r} group {gi}")
    return bytes(out)


def _decode_value(r: Reader, from_parts: PartsToTensor, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise r.fail(f"value nested deeper than {MAX_DEPTH} levels")
    tag = r.u8("value tag")
    if tag == _TAG_NONE:
        return None
    if tag == _TAG_FALSE:
        return False
    if tag == _TAG_TRUE:
        return True
    if tag == _TAG_INT:
        return _I64.unpack(r.take(8, "int"))[0]
    if tag == _TAG_FLOAT:
        return _F64.unpack(r.take(8, "float"))[0]
    if tag == _TAG_STR:
        return r.string("str value")
    if tag == _TAG_BYTES:
        return r.take(r.u32("bytes length"), "bytes value")
    if tag == _TAG_TUPLE or tag == _TAG_LIST:
        n = r.count("sequence", 1)
        items = [_decode_value(r, from_parts, depth + 1) for _ in range(n)]
        return tuple(items) if tag == _TAG_TUPLE else items
    if tag == _TAG_TENSOR:
        dtype = r.string("tensor dtype")
        ndim = r.count("tensor shape", 8)
        shape = tuple(_I64.unpack(r.take(8, "tensor dim"))[0] for _ in range(ndim))
        device_type = r.string("tensor device")
        nbytes = _U64.unpack(r.take(8, "tensor byte count"))[0]
        data = r.take(nbytes, "tensor data")
        try:
            return from_parts(dtype, shape, device_type, data)
        except CheckpointFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - any callback failure means a bad tensor record
            raise r.fail(f"bad tensor ({exc})") from None
    raise r.fail(f"unknown value tag {tag}")


def decode_table(leaf: str, data: bytes, from_parts: PartsToTensor) -> tuple[list[dict], list[bytes], list[tuple[int, list[str]]]]:
    """Decode a table. Returns ``(settings, settings_blobs, groups)``.

    ``settings[i]`` is the i-th distinct settings dict, ``settings_blobs[i]`` its encoded bytes
    (a canonical identity for comparing settings), and ``groups`` lists ``(settings_index,
    fqns)`` in group order. Every read is bounds-checked; any defect raises
    :class:`CheckpointFormatError`.
    """
    if not isinstance(data, bytes):
        raise CheckpointFormatError(f"leaf {leaf!r}: group table is a {type(data).__name__}, expected bytes")
    r = Reader(data, f"leaf {leaf!r} group table")
    r.header(MAGIC, VERSION, "a sparse_ckpt table")
    n_settings = r.count("settings list", 4)
    settings: list[dict] = []
    blobs: list[bytes] = []
    for _ in range(n_settings):
        start = r.pos
        n_keys = r.count("settings keys", 5)
        entry: dict[str, Any] = {}
        for _ in range(n_keys):
            key = r.string("setting key")
            if key in entry:
                raise r.fail(f"duplicate setting key {key!r}")
            entry[key] = _decode_value(r, from_parts, 0)
        settings.append(entry)
        blobs.append(data[start : r.pos])
    n_groups = r.count("group list", 8)
    groups: list[tuple[int, list[str]]] = []
    for _ in range(n_groups):
        idx = r.u32("group settings index")
        if idx >= n_settings:
            raise r.fail(f"group refers to settings {idx} of {n_settings}")
        n_params = r.count("group params", 4)
        groups.append((idx, [r.string("FQN") for _ in range(n_params)]))
    if r.pos != len(data):
        raise r.fail(f"{len(data) - r.pos} trailing bytes after the table")
    return settings, blobs, groups


# --------------------------------------------------------------------------- load matching


def match_groups(
    leaf: str, target_fqns: list[list[str]], settings_of: dict[str, Any]
) -> tuple[list[Any], list[str]]:
    """For each target group pick the saved settings of its FQNs.

    ``settings_of`` maps FQN to an *interned* settings object (equal settings are the same
    object). Returns ``(chosen, missing)``: ``chosen[g]`` is the settings object of group ``g``
    or ``None`` when none of its FQNs is saved; ``missing`` lists FQNs without saved settings in
    group order. Two FQNs of one group with different settings raise
    :class:`CheckpointMismatchError` naming both FQNs and the first differing key.
    """
    chosen: list[Any] = []
    missing: list[str] = []
    for gi, fqns in enumerate(target_fqns):
        pick = None
        pick_fqn = ""
        for fqn in fqns:
            s = settings_of.get(fqn)
            if s is None:
                missing.append(fqn)
            elif pick is None:
                pick, pick_fqn = s, fqn
            elif s is not pick:
                key = _first_differing_key(pick, s)
                raise CheckpointMismatchError(
                    f"leaf {leaf!r} group {gi}: saved settings differ between {pick_fqn!r} and {fqn!r} "
                    f"(key {key!r}); one target group cannot take both"
                )
        chosen.append(pick)
    return chosen, missing


def _first_differing_key(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    for key in a:
        if key not in b:
            return key
        va, vb = a[key], b[key]
        if type(va) is not type(vb):
            return key
        try:
            same = bool(va == vb)
        except Exception:  # noqa: BLE001 - tensors and other values without a scalar truth value
            same = va is vb
        if not same:
            return key
    for key in b:
        if key not in a:
            return key
    return "?"


def assign_state_ids(target_fqns: list[list[str]], state_by_fqn: dict[str, Any]) -> tuple[dict[int, Any], list[str]]:
    """Give saved state to the target's packed ids (torch's id assignment order).

    Returns ``(packed_state, used_fqns)``: ``packed_state`` maps the id of every target
    parameter whose FQN has saved state to that state, in ``state_by_fqn``'s order (the saved
    dict's order, which torch's ``load_state_dict`` keeps); ``used_fqns`` lists those FQNs in the
    same order (so the caller can find saved state that no target parameter took).
    """
    pid_of: dict[str, int] = {}
    pid = 0
    for fqns in target_fqns:
        for fqn in fqns:
            if fqn not in pid_of:
                pid_of[fqn] = pid
            pid += 1
    packed_state: dict[int, Any] = {}
    used: list[str] = []
    for fqn, s in state_by_fqn.items():
        if s is not None and fqn in pid_of:
            packed_state[pid_of[fqn]] = s
            used.append(fqn)
    return packed_state, used


