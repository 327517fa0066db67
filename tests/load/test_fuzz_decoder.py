"""Fuzzing the core's decoders: only ``CheckpointFormatError`` may escape, on either backend.

``decode_table`` gets random bytes and mutated valid tables (bit flips, truncation, insertion,
deletion, splicing two tables, overwritten length fields); ``unflatten`` gets random flat dicts
with adversarial keys and values. Valid tables come from the core's own ``encode_table`` with
random groups. Runs are derandomized (reproducible in CI) and sized to a few thousand cases.
Every run under ``.ci/sanitize.sh`` also drives the C++ decoder through ASan/UBSan.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from table_bytes import encode, u16, u32, u64

from sparse_ckpt import _backend
from sparse_ckpt._core_py import MAGIC, VERSION
from sparse_ckpt._tensor_parts import parts_to_tensor
from sparse_ckpt.errors import CheckpointFormatError

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

# --------------------------------------------------------------------------- strategies

# Bulk inputs come from a ``random.Random`` seeded by hypothesis: each call on hypothesis's own
# ``st.randoms()`` is a recorded draw, which made the bulk tests ten times slower.
SEEDS = st.integers(min_value=0, max_value=2**32 - 1)

names = st.text(alphabet=st.sampled_from("abcxyz._0123é"), min_size=0, max_size=8)
fqns = st.text(alphabet=st.sampled_from("abw.01_"), min_size=1, max_size=10)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=6),
)


@st.composite
def small_tensors(draw: st.DrawFn) -> torch.Tensor:
    """A small CPU tensor of a codec-supported dtype."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.uint8]))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    return torch.zeros(shape, dtype=dtype) + (1 if dtype is not torch.bool else 0)


values = st.recursive(
    st.one_of(scalars, small_tensors()),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple)),
    max_leaves=6,
)
settings_dicts = st.dictionaries(names, values, max_size=4)


@st.composite
def groups_fqn(draw: st.DrawFn) -> list[tuple[dict, list[str]]]:
    """Random ``groups_fqn`` (each FQN used once, some groups empty, settings often repeated)."""
    pool = draw(st.lists(fqns, unique=True, max_size=8))
    shared = draw(settings_dicts)
    n_groups = draw(st.integers(0, 4))
    out: list[tuple[dict, list[str]]] = []
    for gi in range(n_groups):
        take = draw(st.integers(0, len(pool))) if gi < n_groups - 1 else len(pool)
        members, pool = pool[:take], pool[take:]
        out.append((shared if draw(st.booleans()) else draw(settings_dicts), members))
    return out


_ALPHABET = "abcxyz._0123é"
_DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16, torch.uint8]


def random_value(rnd: random.Random, depth: int = 0) -> Any:
    """A random codec value (cheap: no hypothesis draws), nested up to 3 levels."""
    kind = rnd.randrange(10 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.random() < 0.5
    if kind == 2:
        return rnd.choice([0, 1, -1, 2**63 - 1, -(2**63), rnd.randint(-(10**6), 10**6)])
    if kind == 3:
        return rnd.choice([0.0, -0.0, 1e-3, float("inf"), float("nan"), rnd.uniform(-10, 10)])
    if kind == 4:
        return "".join(rnd.choice(_ALPHABET) for _ in range(rnd.randint(0, 5)))
    if kind == 5:
        return rnd.randbytes(rnd.randint(0, 5))
    if kind in (6, 7):
        if rnd.random() < 0.7:
            return rnd.uniform(0, 1)
        shape = tuple(rnd.randint(0, 3) for _ in range(rnd.randint(0, 2)))
        return torch.ones(shape, dtype=rnd.choice(_DTYPES))
    items = [random_value(rnd, depth + 1) for _ in range(rnd.randint(0, 3))]
    return tuple(items) if kind == 8 else items


def random_groups(rnd: random.Random) -> list[tuple[dict, list[str]]]:
    """Random ``groups_fqn``: unique FQNs, some empty groups, repeated settings."""
    pool = list(dict.fromkeys("".join(rnd.choice("abw.01_") for _ in range(rnd.randint(1, 8))) for _ in range(8)))
    shared = {f"k{i}": random_value(rnd) for i in range(rnd.randint(0, 4))}
    out: list[tuple[dict, list[str]]] = []
    for _ in range(rnd.randint(0, 4)):
        cut = rnd.randint(0, len(pool))
        take, pool = pool[:cut], pool[cut:]
        settings_ = shared if rnd.random() < 0.5 else {f"k{i}": random_value(rnd) for i in range(rnd.randint(0, 4))}
        out.append((settings_, take))
    return out


INTERESTING_U32 = [0, 1, 2, 7, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]


def mutate(buf: bytearray, rnd: random.Random, other: bytes) -> bytes:
    """Apply 1-4 random mutations (bit flip, byte, truncate, insert, delete, splice, length field, tag)."""
    for _ in range(rnd.randint(1, 4)):
        kind = rnd.choice(["flip", "byte", "truncate", "insert", "delete", "splice", "u32", "u64", "tag"])
        pos = rnd.randint(0, len(buf))
        if kind == "flip" and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rnd.randint(0, 7)
        elif kind == "byte" and buf:
            buf[min(pos, len(buf) - 1)] = rnd.randint(0, 255)
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = rnd.randbytes(rnd.randint(1, 8))
        elif kind == "delete":
            del buf[pos : pos + rnd.randint(1, 8)]
        elif kind == "splice":
            buf[pos:] = other[rnd.randint(0, len(other)) :]
        elif kind == "u32":
            word = rnd.choice(INTERESTING_U32) if rnd.random() < 0.5 else len(buf) - pos + rnd.randint(-2, 2)
            buf[pos : pos + 4] = u32(word % 2**32)
        elif kind == "u64":
            buf[pos : pos + 8] = u64(rnd.choice([2**64 - 1, 2**63, 2**63 - 1, 2**32, len(buf)]))
        elif kind == "tag":
            buf[pos:pos] = bytes([rnd.choice([0, 3, 4, 5, 6, 7, 8, 9, 10, 255])])
    return bytes(buf)


def check_decoded(result: Any) -> None:
    """A successful decode is well formed."""
    settings_list, blobs, groups = result
    assert isinstance(settings_list, list) and isinstance(blobs, list) and isinstance(groups, list)
    assert len(settings_list) == len(blobs)
    assert all(isinstance(s, dict) and all(isinstance(k, str) for k in s) for s in settings_list)
    assert all(isinstance(b, bytes) for b in blobs)
    for idx, members in groups:
        assert isinstance(idx, int) and 0 <= idx < len(settings_list)
        assert isinstance(members, list) and all(isinstance(f, str) for f in members)


def try_decode(data: bytes, leaf: str = "fz", decoder: Any = None) -> bool:
    """Decode with the active core; ``True`` on success. Only CheckpointFormatError may escape."""
    decode_table = decoder if decoder is not None else _backend.core.decode_table
    try:
        result = decode_table(leaf, data, parts_to_tensor)
    except CheckpointFormatError as exc:
        assert f"leaf {leaf!r}" in str(exc), str(exc)
        return False
    check_decoded(result)
    return True


# --------------------------------------------------------------------------- decode_table


_TOKENS = [b"\x00", b"\x01\x00\x00\x00", b"\xff\xff\xff\xff", b"\x09", b"\x07", b"\x05", b"a", b"\x03" + bytes(8)]
HEADER = MAGIC + u16(VERSION)


@settings(FUZZ, max_examples=300)
@given(data=st.binary(max_size=64), seed=SEEDS)
def test_decode_table_random_bytes(data: bytes, seed: int) -> None:
    """Random bytes, raw and behind a valid header, and random token streams (8 inputs per example)."""
    try_decode(data)
    try_decode(HEADER + data)
    rnd = random.Random(seed)
    for _ in range(3):
        try_decode(HEADER + b"".join(rnd.choice(_TOKENS) for _ in range(rnd.randint(0, 24))))
        try_decode(HEADER + rnd.randbytes(rnd.randint(0, 48)))


MUTANTS_PER_TABLE = 16


def _check_and_mutate(table: bytes, groups: list[tuple[dict, list[str]]], other: bytes, rnd: random.Random) -> None:
    settings_list, _blobs, decoded = _backend.core.decode_table("fz", table, parts_to_tensor)
    assert [members for _idx, members in decoded] == [members for _s, members in groups]
    for (idx, _members), (settings_in, _m) in zip(decoded, groups):
        assert list(settings_list[idx]) == list(settings_in)
    for _ in range(MUTANTS_PER_TABLE):
        try_decode(mutate(bytearray(table), rnd, other))


@settings(FUZZ, max_examples=300)
@given(seed=SEEDS)
def test_decode_table_mutated(seed: int) -> None:
    """A valid random table decodes to its groups; mutants decode cleanly or raise the format error.

    Each example encodes one random table (built by a ``random.Random`` seeded by hypothesis: far
    cheaper than structured strategies) and decodes ``MUTANTS_PER_TABLE`` mutants: 4800 per backend.
    """
    rnd = random.Random(seed)
    groups = random_groups(rnd)
    other = encode("fz", random_groups(rnd))
    _check_and_mutate(encode("fz", groups), groups, other, rnd)


@settings(FUZZ, max_examples=60)
@given(groups=groups_fqn(), seed=SEEDS)
def test_decode_table_structured(groups: list[tuple[dict, list[str]]], seed: int) -> None:
    """Same property with hypothesis-structured groups (shrinks to a minimal failing table)."""
    table = encode("fz", groups)
    _check_and_mutate(table, groups, table[::-1], random.Random(seed))


# --------------------------------------------------------------------------- unflatten

_KEY_PARTS = ["state", "param_groups", "__packed__", "a", "b", "w", "0", "", "exp_avg", "step", "lr", "a.w", "é"]
_TENSOR = torch.zeros(2)


def random_key(rnd: random.Random) -> Any:
    """Mostly dotted strings built from meaningful parts; sometimes not a string at all."""
    if rnd.random() < 0.05:
        return rnd.choice([0, -1, None, b"state.a", ("state", "a"), 1.5, frozenset()])
    return ".".join(rnd.choice(_KEY_PARTS) for _ in range(rnd.randint(1, 6)))


def random_flat_value(rnd: random.Random) -> Any:
    """A value as DCP could hand back: bytes, tensors, scalars, strings -- or odd ones."""
    return rnd.choice(
        [b"SCKT", b"", _TENSOR, 1, 0.5, None, "lr", [1, 2], (3,), {"x": 1}, {}, bytearray(b"x"), object()]
    )


FLATS_PER_EXAMPLE = 8


@settings(FUZZ, max_examples=300)
@given(seed=SEEDS)
def test_unflatten_random(seed: int) -> None:
    """Random flat dicts (8 per example, 2400 per backend): consistent split or CheckpointFormatError."""
    rnd = random.Random(seed)
    for _ in range(FLATS_PER_EXAMPLE):
        flat = {random_key(rnd): random_flat_value(rnd) for _ in range(rnd.randint(0, 10))}
        known = {random_key(rnd): 0 for _ in range(rnd.randint(0, 5))}
        known = {k: v for k, v in known.items() if isinstance(k, str)}
        check_unflatten(flat, known)


def check_unflatten(flat: dict[Any, Any], known: dict[str, Any]) -> None:
    """Only CheckpointFormatError may escape; a successful split accounts for every key."""
    try:
        settings_by, state_by, packed, scalars, unmatched = _backend.core.unflatten(flat, known)
    except CheckpointFormatError:
        return
    assert all(isinstance(k, str) for k in flat)
    assert all(isinstance(v, bytes) for v in packed.values())
    assert all(isinstance(v, bytes) for v in scalars.values())
    assert set(unmatched) <= set(flat)
    if not any(isinstance(v, dict) for v in flat.values()):  # dict values would merge with nested state
        n_state = sum(1 for k in flat if k.startswith("state.") and not k.startswith("state.__packed__."))
        n_state -= sum(1 for k in unmatched if k.startswith("state."))
        assert n_state == sum(_leaves(v) for v in state_by.values())
    for key, value in flat.items():
        if key.startswith("param_groups.__packed__."):
            assert packed[key[len("param_groups.__packed__.") :]] is value
        if key.startswith("state.__packed__."):
            assert scalars[key[len("state.__packed__.") :]] is value
    assert all(isinstance(v, dict) for v in settings_by.values())


def _leaves(node: Any) -> int:
    if isinstance(node, dict) and node:
        return sum(_leaves(v) for v in node.values())
    return 1


def test_fuzz_harness_can_fail() -> None:
    """The harness lets any other exception escape, and rejects a malformed decode result."""

    def raises(*_args: Any) -> Any:
        raise IndexError("out of range")

    with pytest.raises(IndexError):
        try_decode(b"SCKT", decoder=raises)
    with pytest.raises(AssertionError):
        try_decode(b"SCKT", decoder=lambda *_a: ([{}], [b""], [(1, ["a"])]))
