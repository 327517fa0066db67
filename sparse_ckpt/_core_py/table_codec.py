"""Twins of csrc/table_codec.cpp: ``encode_settings`` / ``encode_table`` / ``decode_table`` (the
group-table codec) and the scalar-table records of ``flatten_packed_state``.

The table format (``SCKT``, versions 1 and 2) is specified in docs/formats.md ("Table codec").
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from .._format.keys import is_plain_part
from .common import (
    F64,
    I64,
    INT64_MAX,
    INT64_MIN,
    MAGIC,
    MAX_DEPTH,
    MAX_ITEMSIZE,
    U16,
    U32,
    U64,
    VERSION,
    PartsToTensor,
    Reader,
    ScalarParts,
    TensorToParts,
    len32,
    utf8,
)
from .errors import CheckpointFormatError

TAG_NONE = 0
TAG_FALSE = 1
TAG_TRUE = 2
TAG_INT = 3
TAG_FLOAT = 4
TAG_STR = 5
TAG_BYTES = 6
TAG_TUPLE = 7
TAG_LIST = 8
TAG_TENSOR = 9
TAG_DTYPE = 10
TAG_DEVICE = 11

NAMED_TAGS = {"dtype": TAG_DTYPE, "device": TAG_DEVICE}
"""The kinds a ``to_name`` callback may return, and their tags (a named value: a kind and a text)."""
NAMED_VERSION = 2
"""The version of a table that holds a named value (tags 10 and 11); a table without one is
written as version ``VERSION`` (1), byte for byte as before, so older readers still read it."""

ValueToName = Callable[[Any], "tuple[str, str] | None"]
NameToValue = Callable[[str, str], Any]

_ADDRESS_END = 2**63


def check_cpu_dtypes(cpu_dtypes: Any) -> None:
    """``cpu_dtypes`` of :func:`flatten_packed_state`: an exact dict of ``dtype -> (name, itemsize)``."""
    if type(cpu_dtypes) is not dict:
        raise TypeError(f"flatten_packed_state: cpu_dtypes must be a dict, got {type(cpu_dtypes).__name__}")
    for spec in cpu_dtypes.values():
        if not (
            type(spec) is tuple
            and len(spec) == 2
            and type(spec[0]) is str
            and type(spec[1]) is int
            and 1 <= spec[1] <= MAX_ITEMSIZE
        ):
            raise TypeError(
                "flatten_packed_state: cpu_dtypes values must be (str, int) tuples with an item size "
                f"from 1 to {MAX_ITEMSIZE}, got {spec!r}"
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


def scalar_record(
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
    out = bytearray(len32(len(raw_key)))
    out += raw_key
    kind = type(value)
    if kind is bool:
        out.append(TAG_TRUE if value else TAG_FALSE)
    elif kind is int:
        if value < INT64_MIN or value > INT64_MAX:
            return None
        out.append(TAG_INT)
        out += I64.pack(value)
    elif kind is float:
        out.append(TAG_FLOAT)
        out += F64.pack(value)
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


def _encode_value(
    out: bytearray,
    value: Any,
    tensor_type: type,
    to_parts: TensorToParts,
    to_name: ValueToName | None,
    where: str,
    depth: int,
    named: list[bool],
) -> None:
    """One value (tag and payload); ``named[0]`` is set when a named value (dtype, device) is written."""
    if depth > MAX_DEPTH:
        raise CheckpointFormatError(f"{where}: value nested deeper than {MAX_DEPTH} levels")
    if value is None:
        out.append(TAG_NONE)
    elif type(value) not in _EXACT and isinstance(value, _BASES):
        _refuse_subclass(value, where)
    elif isinstance(value, bool):
        out.append(TAG_TRUE if value else TAG_FALSE)
    elif isinstance(value, int):
        if value < INT64_MIN or value > INT64_MAX:
            raise CheckpointFormatError(f"{where}: int {value} does not fit in 64 bits")
        out.append(TAG_INT)
        out += I64.pack(value)
    elif isinstance(value, float):
        out.append(TAG_FLOAT)
        out += F64.pack(value)
    elif isinstance(value, str):
        out.append(TAG_STR)
        _encode_str(out, value, where)
    elif isinstance(value, bytes):
        out.append(TAG_BYTES)
        out += len32(len(value))
        out += value
    elif isinstance(value, (tuple, list)):
        out.append(TAG_TUPLE if isinstance(value, tuple) else TAG_LIST)
        out += len32(len(value))
        for item in value:
            _encode_value(out, item, tensor_type, to_parts, to_name, where, depth + 1, named)
    elif isinstance(value, tensor_type):
        _encode_tensor_parts(out, to_parts(value), where)
    else:
        name = None if to_name is None else to_name(value)
        if name is None:
            raise CheckpointFormatError(f"{where}: unsupported value type {type(value).__name__}")
        if not (
            type(name) is tuple
            and len(name) == 2
            and type(name[0]) is str
            and name[0] in NAMED_TAGS
            and type(name[1]) is str
        ):
            raise TypeError(f"to_name must return None or a ('dtype' or 'device', str) tuple, got {name!r}")
        out.append(NAMED_TAGS[name[0]])
        _encode_str(out, name[1], where)
        named[0] = True


_EXACT = frozenset((bool, int, float, str, bytes, tuple, list))
_BASES = (int, float, str, bytes, tuple, list)
"""The value kinds the codec writes itself: a value of a subclass of one of them (``numpy.float64``,
an ``IntEnum`` or ``str`` ``Enum`` member, a ``namedtuple``) is refused, since it would decode as the
plain base type (docs/formats.md, *Table codec*)."""


def _refuse_subclass(value: Any, where: str) -> None:
    kind = type(value)
    base = next(b for b in _BASES if isinstance(value, b)).__name__
    raise CheckpointFormatError(
        f"{where}: a value of type {kind.__module__}.{kind.__qualname__} (a subclass of {base}) would load back "
        f"as a plain {base}; set it to a plain {base} (e.g. {base}(value)) before saving"
    )


def _encode_tensor_parts(out: bytearray, parts: Any, where: str) -> None:
    """A tensor value (tag and payload) from its ``(dtype, shape, device_type, data)`` parts."""
    dtype, shape, device_type, data = parts
    out.append(TAG_TENSOR)
    _encode_str(out, dtype, where)
    out += len32(len(shape))
    for dim in shape:
        out += I64.pack(dim)
    _encode_str(out, device_type, where)
    out += U64.pack(len(data))
    out += data


def _encode_str(out: bytearray, text: str, where: str) -> None:
    raw = utf8(text, where)
    out += len32(len(raw))
    out += raw


def encode_settings(
    leaf: str,
    group_index: int,
    settings: dict[Any, Any],
    tensor_type: type,
    to_parts: TensorToParts,
    to_name: ValueToName | None = None,
) -> bytes:
    """Encode one group's settings (the ``settings`` production of the table format).

    Values the codec does not hold itself (not ``None``, ``bool``, ``int``, ``float``, ``str``,
    ``bytes``, a tuple or list, or a ``tensor_type`` given to ``to_parts``) go to ``to_name``:
    ``None`` refuses the value, ``("dtype", text)`` or ``("device", text)`` writes it as a named value
    (without ``to_name``, every such value is refused)."""
    return _encode_settings(leaf, group_index, settings, tensor_type, to_parts, to_name, [False])


def _encode_settings(
    leaf: str,
    group_index: int,
    settings: dict[Any, Any],
    tensor_type: type,
    to_parts: TensorToParts,
    to_name: ValueToName | None,
    named: list[bool],
) -> bytes:
    out = bytearray()
    out += len32(len(settings))
    for key, value in dict.items(settings):
        if not isinstance(key, str):
            raise CheckpointFormatError(f"leaf {leaf!r} group {group_index}: setting key {key!r} is not a string")
        where = f"leaf {leaf!r} group {group_index} key {key!r}"
        _encode_str(out, key, where)
        _encode_value(out, value, tensor_type, to_parts, to_name, where, 0, named)
    return bytes(out)


def encode_table(
    leaf: str,
    groups_fqn: list[tuple[dict, list[str]]],
    tensor_type: type,
    to_parts: TensorToParts,
    to_name: ValueToName | None = None,
) -> bytes:
    """Encode a leaf's groups as a table (version 1, or 2 when it holds a named value, see
    :func:`encode_settings`); deterministic, settings deduplicated (one settings object listed by
    several groups is encoded once: callers do not change it meanwhile)."""
    if not isinstance(leaf, str):
        raise CheckpointFormatError(f"leaf name {leaf!r} is not a string")
    index_of: dict[bytes, int] = {}
    index_of_id: dict[int, int] = {}  # id(settings) -> its index: a settings dict met again is not re-encoded
    blobs: list[bytes] = []
    refs: list[int] = []
    named = [False]
    for gi, (settings, _fqns) in enumerate(groups_fqn):
        idx = index_of_id.get(id(settings))
        if idx is None:
            blob = _encode_settings(leaf, gi, settings, tensor_type, to_parts, to_name, named)
            idx = index_of.get(blob)
            if idx is None:
                idx = index_of[blob] = len(blobs)
                blobs.append(blob)
            index_of_id[id(settings)] = idx
        refs.append(idx)
    out = bytearray(MAGIC)
    out += U16.pack(NAMED_VERSION if named[0] else VERSION)
    out += len32(len(blobs))
    for blob in blobs:
        out += blob
    out += len32(len(groups_fqn))
    for gi, ((_settings, fqns), idx) in enumerate(zip(groups_fqn, refs)):
        out += U32.pack(idx)
        out += len32(len(fqns))
        for fqn in fqns:
            if not isinstance(fqn, str):
                raise CheckpointFormatError(f"leaf {leaf!r} group {gi}: FQN {fqn!r} is not a string")
            _encode_str(out, fqn, f"leaf {leaf!r} group {gi}")
    return bytes(out)


def _decode_value(r: Reader, from_parts: PartsToTensor, from_name: NameToValue | None, depth: int) -> Any:
    """One value; ``from_name`` is ``None`` in a version-1 table (which holds no named value)."""
    if depth > MAX_DEPTH:
        raise r.fail(f"value nested deeper than {MAX_DEPTH} levels")
    tag = r.u8("value tag")
    if tag == TAG_NONE:
        return None
    if tag == TAG_FALSE:
        return False
    if tag == TAG_TRUE:
        return True
    if tag == TAG_INT:
        return I64.unpack(r.take(8, "int"))[0]
    if tag == TAG_FLOAT:
        return F64.unpack(r.take(8, "float"))[0]
    if tag == TAG_STR:
        return r.string("str value")
    if tag == TAG_BYTES:
        return r.take(r.u32("bytes length"), "bytes value")
    if tag == TAG_TUPLE or tag == TAG_LIST:
        n = r.count("sequence", 1)
        items = [_decode_value(r, from_parts, from_name, depth + 1) for _ in range(n)]
        return tuple(items) if tag == TAG_TUPLE else items
    if tag == TAG_TENSOR:
        dtype = r.string("tensor dtype")
        ndim = r.count("tensor shape", 8)
        shape = tuple(I64.unpack(r.take(8, "tensor dim"))[0] for _ in range(ndim))
        device_type = r.string("tensor device")
        nbytes = U64.unpack(r.take(8, "tensor byte count"))[0]
        data = r.take(nbytes, "tensor data")
        try:
            return from_parts(dtype, shape, device_type, data)
        except CheckpointFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - any callback failure means a bad tensor record
            raise r.fail(f"bad tensor ({exc})") from None
    if from_name is not None and (tag == TAG_DTYPE or tag == TAG_DEVICE):
        kind = "dtype" if tag == TAG_DTYPE else "device"
        text = r.string(f"{kind} name")
        try:
            return from_name(kind, text)
        except CheckpointFormatError:
            raise
        except Exception as exc:  # noqa: BLE001 - any callback failure means a bad named value
            raise r.fail(f"bad {kind} {text!r} ({exc})") from None
    raise r.fail(f"unknown value tag {tag}")


def decode_table(
    leaf: str, data: bytes, from_parts: PartsToTensor, from_name: NameToValue | None = None
) -> tuple[list[dict], list[bytes], list[tuple[int, list[str]]]]:
    """Decode a table (version 1 or 2). Returns ``(settings, settings_blobs, groups)``.

    Tensors are rebuilt by ``from_parts(dtype, shape, device_type, data)``, the named values of a
    version-2 table by ``from_name(kind, text)`` (``kind``: ``"dtype"`` or ``"device"``; without
    ``from_name`` their tags are unknown, as in a version-1 table).

    ``settings[i]`` is the i-th distinct settings dict, ``settings_blobs[i]`` its encoded bytes
    (a canonical identity for comparing settings), and ``groups`` lists ``(settings_index,
    fqns)`` in group order. Every read is bounds-checked; any defect raises
    :class:`CheckpointFormatError`.
    """
    if not isinstance(data, bytes):
        raise CheckpointFormatError(f"leaf {leaf!r}: group table is a {type(data).__name__}, expected bytes")
    r = Reader(data, f"leaf {leaf!r} group table")
    version = r.header(MAGIC, NAMED_VERSION, "a sparse_ckpt table", VERSION)
    named = from_name if version >= NAMED_VERSION else None
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
            entry[key] = _decode_value(r, from_parts, named, 0)
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
