"""Bad checkpoints give ``CheckpointFormatError`` or ``CheckpointMismatchError`` -- never a crash,
a hang, a giant allocation or a wrong silent load -- and the message names the leaf, FQN or key.

Tables are corrupted both through the full load path (digest check first) and, with the digest
bypassed, straight through the core's ``decode_table``, so the decoder itself is exercised on
every defect. Hand-built tables (``Tab``) follow the version-1 table codec of docs/formats.md.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path
from typing import Any

import _backends
import hypothesis
import pytest
import torch
from helpers import deep_equal, same_bits
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from table_bytes import decode, encode, group, i64, s, settings, tab, u16, u32, u64, v_float, v_tensor
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import _core_py
from sparse_ckpt._core_py import MAGIC, VERSION
from sparse_ckpt._format.keys import check_table
from sparse_ckpt._format.tensor_parts import name_to_value, parts_to_tensor, tensor_to_parts, value_to_name
from sparse_ckpt._fqn import build_fqn_map
from sparse_ckpt._load.decode import decode_checkpoint
from sparse_ckpt._save.save import packed_table_key
from sparse_ckpt.errors import CheckpointFormatError

REPO = Path(__file__).resolve().parents[2]
PACKED = "param_groups.__packed__."
FMT = sc.CheckpointFormatError
MISMATCH = sc.CheckpointMismatchError


# --------------------------------------------------------------------------- fixtures


class Net(nn.Module):
    """Two linear layers; FQNs ``a.weight``, ``a.bias``, ``b.weight``, ``b.bias``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def make_optimizer(model: Net, lr: float = 0.02) -> torch.optim.Adam:
    """Adam with a tensor lr in group 0, a plain group and an empty group (rich table)."""
    return torch.optim.Adam(
        [
            {"params": [model.a.weight, model.a.bias], "lr": torch.tensor(0.01), "tag": ("x", b"\x00", [None, True])},
            {"params": [model.b.weight, model.b.bias]},
            {"params": []},
        ],
        lr=lr,
        foreach=False,
    )


def saved() -> tuple[Net, dict[str, Any]]:
    """A stepped model and its packed sparse state dict."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(model)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, sc.sparse_state_dict(model, opt)


def fresh_target() -> tuple[Net, torch.optim.Adam]:
    """A target with its own (different) state."""
    torch.manual_seed(1)
    model = Net()
    opt = make_optimizer(model, lr=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


class LrOnly(torch.optim.Optimizer):
    """An optimizer class whose only setting is ``lr``: the target of the hand-built tables, which hold
    no other (an Adam target refuses them as another class's settings)."""

    def __init__(self, params: Any, lr: float = 0.5) -> None:
        super().__init__(params, {"lr": lr})


def lr_only_target() -> tuple[Net, Any]:
    """``Net`` and an `LrOnly` over the groups of `make_optimizer` (no state)."""
    model = Net()
    groups = [{"params": [model.a.weight, model.a.bias]}, {"params": [model.b.weight, model.b.bias]}, {"params": []}]
    return model, LrOnly(groups)


# "Unchanged" is exact: key order included, NaN never equal, dicts required to be dicts.
SAME = {"nan_equal": "none", "mapping": dict}


def table_of(sd: dict[str, Any]) -> tuple[str, bytes]:
    """The single packed table of ``sd``: ``(key, table bytes)`` (a sealed value unsealed)."""
    ((key, value),) = [(k, v) for k, v in sd.items() if isinstance(k, str) and k.startswith(PACKED)]
    return key, check_table(PACKED, key[len(PACKED) :], value)[1]


def with_table(sd: dict[str, Any], table: Any, leaf: str = "optim", key: str | None = None) -> dict[str, Any]:
    """``sd`` with its table replaced; the key's digest matches ``table`` unless ``key`` is given."""
    out = {k: v for k, v in sd.items() if not (isinstance(k, str) and k.startswith(PACKED))}
    out[key if key is not None else packed_table_key(leaf, table)] = table
    return out


def load_fails(
    sd: dict[str, Any],
    error: type[Exception],
    *names: str,
    strict: bool = True,
    target: tuple[Net, torch.optim.Adam] | None = None,
) -> str:
    """Load ``sd`` into ``target`` (default: a fresh one); assert ``error`` naming ``names`` and an
    unchanged target."""
    model, opt = target if target is not None else fresh_target()
    before = opt.state_dict()
    state_obj, groups_obj = opt.state, opt.param_groups
    with pytest.raises(error) as info:
        sc.load_sparse_state_dict(model, opt, sd, strict=strict)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    assert opt.state is state_obj and opt.param_groups is groups_obj
    assert deep_equal(opt.state_dict(), before, **SAME)
    return message


def decode_fails(table: Any, *names: str, leaf: str = "optim") -> str:
    """Assert the core rejects ``table`` with ``CheckpointFormatError`` naming the leaf and ``names``."""
    with pytest.raises(FMT) as info:
        decode(table, leaf)
    assert type(info.value) is FMT
    message = str(info.value)
    for name in (f"leaf {leaf!r}", *names):
        assert name in message, f"{name!r} not named in: {message}"
    return message


# --------------------------------------------------------------------------- hand-built tables


# The encoders (u16, u32, s, v_float, v_tensor, settings, group, tab, ...) are in tests/table_bytes.py.


GOOD_GROUPS = [group(0, ["a.weight", "a.bias"]), group(1, ["b.weight", "b.bias"]), group(1, [])]
GOOD_SETTINGS = [settings(("lr", v_float(0.01))), settings(("lr", v_float(0.02)))]


def test_hand_built_table_matches_encoder() -> None:
    """The hand-built layout is the real one, so the defects below are precise."""
    built = tab(GOOD_SETTINGS, GOOD_GROUPS)
    encoded = encode(
        "optim", [({"lr": 0.01}, ["a.weight", "a.bias"]), ({"lr": 0.02}, ["b.weight", "b.bias"]), ({"lr": 0.02}, [])]
    )
    assert built == encoded
    _setts, _blobs, groups = decode(built)
    assert groups == [(0, ["a.weight", "a.bias"]), (1, ["b.weight", "b.bias"]), (1, [])]
    model, opt = lr_only_target()
    sc.load_sparse_state_dict(model, opt, with_table({}, built))
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.02, 0.02]
    assert not opt.state  # the table carries no state


# --------------------------------------------------------------------------- byte-level corruption


def test_every_flipped_byte_is_caught_by_the_digest() -> None:
    """Flipping any byte of a stored table is detected before decoding (key and leaf named)."""
    _model, sd = saved()
    key, table = table_of(sd)
    assert len(table) > 200
    target = fresh_target()
    for pos in range(len(table)):
        bad = bytearray(table)
        bad[pos] ^= 0xFF
        load_fails(with_table(sd, bytes(bad), key=key), FMT, "'optim'", "digest", key, target=target)


def test_every_flipped_byte_decodes_or_raises_format_error() -> None:
    """With the digest bypassed, each flipped byte either decodes or raises CheckpointFormatError.

    Header flips (magic, version) must always be rejected. Through the load path with a forged
    digest, the outcome is a clean error with the target unchanged, or a load of a valid table.
    """
    _model_src, sd = saved()
    _key, table = table_of(sd)
    outcomes: dict[str, int] = {"decoded": 0, "format_error": 0}
    for pos in range(len(table)):
        for mask in (0xFF, 0x01, 0x80):
            bad = bytearray(table)
            bad[pos] ^= mask
            try:
                setts, blobs, groups = decode(bytes(bad))
            except FMT as exc:
                assert "leaf 'optim'" in str(exc)
                outcomes["format_error"] += 1
                continue
            assert pos >= 6, f"header byte {pos} flipped with mask {mask:#x} was accepted"
            assert len(setts) == len(blobs)
            assert all(0 <= idx < len(setts) for idx, _ in groups)
            outcomes["decoded"] += 1
    assert outcomes["format_error"] > 0 and outcomes["decoded"] > 0, outcomes
    model, opt = fresh_target()
    before = opt.state_dict()
    for pos in range(0, len(table), 5):  # a forged digest: the load fails cleanly or loads a valid table
        bad = bytearray(table)
        bad[pos] ^= 0xFF
        try:
            sc.load_sparse_state_dict(model, opt, with_table(sd, bytes(bad)))
        except (FMT, MISMATCH):
            assert deep_equal(opt.state_dict(), before, **SAME)
        else:
            model, opt = fresh_target()
            before = opt.state_dict()


def test_every_truncation_is_rejected() -> None:
    """Each proper prefix of a table raises CheckpointFormatError, in the core and through a load."""
    _model, sd = saved()
    key, table = table_of(sd)
    target = fresh_target()
    for n in range(len(table)):
        decode_fails(table[:n])
        load_fails(with_table(sd, table[:n]), FMT, "'optim'", target=target)  # forged digest
        load_fails(with_table(sd, table[:n], key=key), FMT, "digest", target=target)  # stored digest
    load_fails(with_table(sd, table[:-1]), FMT, "'optim'", "truncated", target=target)
    load_fails(with_table(sd, table + b"\x00"), FMT, "'optim'", "trailing", target=target)


# --------------------------------------------------------------------------- structural defects

# (id, table bytes, words the message must contain)
STRUCTURAL: list[tuple[str, bytes, list[str]]] = [
    ("bad_magic", tab(GOOD_SETTINGS, GOOD_GROUPS, magic=b"PK\x03\x04"), ["magic"]),
    ("version_0", tab(GOOD_SETTINGS, GOOD_GROUPS, version=0), ["version 0"]),
    ("version_3", tab(GOOD_SETTINGS, GOOD_GROUPS, version=3), ["version 3"]),  # 2: tables with a dtype or device
    ("version_ffff", tab(GOOD_SETTINGS, GOOD_GROUPS, version=0xFFFF), ["version 65535"]),
    ("empty", b"", ["truncated"]),
    ("settings_count_plus_one", tab(GOOD_SETTINGS, GOOD_GROUPS, n_settings=3), []),
    ("groups_count_plus_one", tab(GOOD_SETTINGS, GOOD_GROUPS, n_groups=len(GOOD_GROUPS) + 1), []),
    ("params_count_plus_one", tab(GOOD_SETTINGS, [group(0, ["a.weight"], n=2)]), []),
    ("keys_count_plus_one", tab([settings(("lr", v_float(0.1)), n=2)], [group(0, ["a.weight"])]), []),
    ("settings_index_out_of_range", tab(GOOD_SETTINGS, [group(2, ["a.weight"])]), ["settings 2 of 2"]),
    ("trailing_bytes", tab(GOOD_SETTINGS, GOOD_GROUPS) + b"junk", ["trailing"]),
    ("unknown_tag_10", tab([settings(("lr", b"\x0a"))], [group(0, ["a.weight"])]), ["unknown value tag 10"]),
    ("unknown_tag_127", tab([settings(("lr", b"\x7f" + i64(1)))], [group(0, ["a.weight"])]), ["unknown value tag 127"]),
    ("unknown_tag_255", tab([settings(("lr", b"\xff"))], [group(0, ["a.weight"])]), ["unknown value tag 255"]),
    ("truncated_int", tab([settings(("lr", b"\x03\x01\x02"))], []), ["int"]),
    ("duplicate_setting_key", tab([settings(("lr", v_float(0.1)), ("lr", v_float(0.2)))], []), ["'lr'"]),
    ("invalid_utf8_fqn", tab(GOOD_SETTINGS[:1], [u32(0) + u32(1) + s(b"\xff\xfe")]), ["utf-8"]),
    ("invalid_utf8_key", tab([u32(1) + s(b"l\xc3") + v_float(0.1)], []), ["utf-8"]),
    ("nesting_too_deep", tab([settings(("x", b"\x07\x01\x00\x00\x00" * 40 + b"\x00"))], []), ["deeper"]),
    ("tensor_unknown_dtype", tab([settings(("lr", v_tensor(dtype="object")))], []), ["tensor"]),
    ("tensor_negative_dim", tab([settings(("lr", v_tensor(shape=(-1,))))], []), ["tensor"]),
    ("tensor_bytes_mismatch", tab([settings(("lr", v_tensor(shape=(2,))))], []), ["tensor"]),
    ("tensor_dims_overflow", tab([settings(("lr", v_tensor(shape=(2**62, 2**62, 4))))], []), ["tensor"]),
]


@pytest.mark.parametrize(("table", "words"), [c[1:] for c in STRUCTURAL], ids=[c[0] for c in STRUCTURAL])
def test_structural_defect(table: bytes, words: list[str]) -> None:
    """Each defect raises CheckpointFormatError in the core and through a load (digest forged)."""
    decode_fails(table, *words)
    load_fails(with_table({}, table), FMT, "'optim'", *words)


# Each field a reader sizes something by, set to its maximum. No giant allocation may follow.
HUGE: list[tuple[str, bytes]] = [
    ("n_settings", tab([], [], n_settings=0xFFFFFFFF)),
    ("n_keys", tab([settings(n=0xFFFFFFFF)], [])),
    ("key_length", tab([u32(1) + u32(0xFFFFFFFF) + b"lr"], [])),
    ("str_value_length", tab([settings(("s", b"\x05" + u32(0xFFFFFFFF) + b"abc"))], [])),
    ("bytes_value_length", tab([settings(("s", b"\x06" + u32(0xFFFFFFFF) + b"abc"))], [])),
    ("tuple_length", tab([settings(("s", b"\x07" + u32(0xFFFFFFFF) + b"\x00\x00"))], [])),
    ("list_length", tab([settings(("s", b"\x08" + u32(0xFFFFFFFF) + b"\x00\x00"))], [])),
    ("tensor_dtype_length", tab([settings(("t", b"\x09" + u32(0xFFFFFFFF) + b"float32"))], [])),
    ("tensor_ndim", tab([settings(("t", v_tensor(ndim=0xFFFFFFFF)))], [])),
    ("tensor_nbytes_u64_max", tab([settings(("t", v_tensor(nbytes=2**64 - 1)))], [])),
    ("tensor_nbytes_2_63", tab([settings(("t", v_tensor(nbytes=2**63)))], [])),
    ("tensor_nbytes_u32_max", tab([settings(("t", v_tensor(nbytes=0xFFFFFFFF)))], [])),
    ("tensor_device_length", tab([settings(("t", b"\x09" + s("float32") + u32(0) + u32(0xFFFFFFFF) + b"cpu"))], [])),
    ("n_groups", tab(GOOD_SETTINGS, [], n_groups=0xFFFFFFFF)),
    ("n_groups_0x40000000", tab(GOOD_SETTINGS, [], n_groups=0x40000000)),
    ("n_params", tab(GOOD_SETTINGS, [group(0, [], n=0xFFFFFFFF)])),
    ("fqn_length", tab(GOOD_SETTINGS, [u32(0) + u32(1) + u32(0xFFFFFFFF) + b"a.weight"])),
]


@pytest.mark.parametrize("table", [c[1] for c in HUGE], ids=[c[0] for c in HUGE])
def test_huge_length_field(table: bytes, core_backend: str) -> None:
    """A 0xFFFFFFFF (or 2**64-1) count/length raises CheckpointFormatError without allocating for it."""
    if core_backend == "python":
        tracemalloc.start()
        try:
            decode_fails(table)
            _current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, f"decoding allocated {peak} bytes"
    else:
        decode_fails(table)
    load_fails(with_table({}, table), FMT, "'optim'")


def test_huge_length_fields_under_address_space_limit(core_backend: str, tmp_path: Path) -> None:
    """In a child process whose address space is capped near its current size, no huge field allocates.

    This catches a giant ``reserve``/``malloc`` in the C++ decoder that tracemalloc cannot see
    (untouched pages do not show in RSS, but they do count against RLIMIT_AS). The Python core
    is covered in-process by tracemalloc above, so only the C++ core pays for a child process.
    """
    if core_backend != "cpp":
        pytest.skip("the Python core is checked with tracemalloc in test_huge_length_field")
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({name: table.hex() for name, table in HUGE}))
    script = textwrap.dedent(
        f"""
        import json, resource, sys
        import torch  # noqa: F401  (imported before the cap)
        from sparse_ckpt import _backend
        from sparse_ckpt._format.tensor_parts import parts_to_tensor, tensor_to_parts
        from sparse_ckpt.errors import CheckpointFormatError
        core = _backend.core
        assert _backend.NAME == {core_backend!r}, _backend.NAME
        cases = json.load(open({str(cases)!r}))
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        cap = vm + (256 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        out = {{}}
        for name, hexed in cases.items():
            try:
                core.decode_table("optim", bytes.fromhex(hexed), parts_to_tensor)
                out[name] = "decoded"
            except CheckpointFormatError:
                out[name] = "CheckpointFormatError"
            except BaseException as exc:
                out[name] = type(exc).__name__ + ": " + str(exc)[:200]
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "SPARSE_CKPT_BACKEND": core_backend, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {name: "CheckpointFormatError" for name, _ in HUGE}


# --------------------------------------------------------------------------- dict-level defects


def test_digest_mismatch_names_key() -> None:
    """A valid table under a key whose digest is wrong (e.g. renamed or edited) is refused."""
    _model, sd = saved()
    key, table = table_of(sd)
    bad_key = key[:-4] + ("0000" if not key.endswith("0000") else "1111")
    load_fails(with_table(sd, table, key=bad_key), FMT, "'optim'", bad_key, "digest")


def test_duplicate_fqn_within_group_decodes() -> None:
    """An FQN listed twice in one group is what torch saves for a parameter given twice to a group:
    it decodes to one FQN with that group's settings."""
    table = tab(GOOD_SETTINGS, [group(0, ["a.weight", "a.bias", "a.weight"]), group(1, ["b.weight", "b.bias"])])
    ckpt = decode_checkpoint(with_table({}, table), build_fqn_map(Net()))
    assert ckpt.settings_of["a.weight"] == {"lr": 0.01}
    assert ckpt.settings_of["b.bias"] == {"lr": 0.02}


def test_duplicate_fqn_across_groups_same_settings_decodes() -> None:
    """An FQN in two groups with the same settings (``opt.param_groups.extend(opt.param_groups)``)."""
    same = tab(GOOD_SETTINGS[:1], [group(0, ["a.weight", "a.bias"]), group(0, ["b.weight", "a.bias", "b.bias"])])
    ckpt = decode_checkpoint(with_table({}, same), build_fqn_map(Net()))
    assert ckpt.settings_of["a.bias"] is ckpt.settings_of["b.weight"]


def test_duplicate_fqn_across_groups_different_settings() -> None:
    """An FQN in two groups with different settings: a load by FQN cannot tell which applies."""
    differ = tab(GOOD_SETTINGS, [group(0, ["a.weight", "a.bias"]), group(1, ["b.weight", "a.bias", "b.bias"])])
    load_fails(with_table({}, differ), MISMATCH, "a.bias", "group 1")


def test_same_fqn_in_two_tables_with_different_settings() -> None:
    """Two tables (two ranks) disagreeing on one FQN's settings."""
    _model, sd = saved()
    other = tab([settings(("lr", v_float(7.0)))], [group(0, ["a.weight"])])
    sd[packed_table_key("optim", other)] = other
    load_fails(sd, MISMATCH, "a.weight")


def test_state_key_for_fqn_the_model_lacks() -> None:
    """``state.ghost.weight.exp_avg``: no model parameter ``ghost.weight``."""
    _model, sd = saved()
    sd["state.ghost.weight.exp_avg"] = torch.zeros(2)
    load_fails(sd, MISMATCH, "state.ghost.weight.exp_avg")


def test_group_table_for_leaf_the_target_lacks() -> None:
    """A table of leaf ``dense`` when the target has only leaf ``experts`` (strict)."""
    torch.manual_seed(0)
    model = Net()
    multi = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.SGD(model.a.parameters(), lr=0.1),
            "dense": torch.optim.SGD(model.b.parameters(), lr=0.2),
        },
    )
    sd = sc.sparse_state_dict(model, multi)
    target = {"experts": torch.optim.SGD(model.a.parameters(), lr=0.5)}
    before = target["experts"].state_dict()
    with pytest.raises(MISMATCH) as info:
        sc.load_sparse_state_dict(model, target, sd)
    assert "'dense'" in str(info.value) and "b.weight" in str(info.value)
    assert deep_equal(target["experts"].state_dict(), before, **SAME)


def test_empty_group_of_leaf_the_target_lacks() -> None:
    """An empty group can only be matched by (leaf, index); a leaf the target lacks is an error."""
    _model, sd = saved()
    extra = tab(GOOD_SETTINGS[:1], [group(0, [])])
    sd[packed_table_key("ghostleaf", extra)] = extra
    load_fails(sd, MISMATCH, "ghostleaf")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (torch.zeros(2, 2), ["'exp_avg'", "'a.weight'", "(2, 2)"]),
        (torch.zeros(3, 5), ["'exp_avg'", "'a.weight'", "(3, 5)"]),
        (torch.zeros(3, 4, dtype=torch.complex64), ["'exp_avg'", "'a.weight'", "complex64"]),
    ],
    ids=["shape_2x2", "shape_3x5", "complex"],
)
def test_state_tensor_wrong_shape_or_dtype(value: torch.Tensor, words: list[str]) -> None:
    """A state tensor that cannot belong to the parameter."""
    _model, sd = saved()
    sd["state.a.weight.exp_avg"] = value
    load_fails(sd, MISMATCH, *words)


@pytest.mark.parametrize(
    "value",
    ["a string", bytearray(b"SCKT"), memoryview(b"SCKT"), 17, None, torch.zeros(4, dtype=torch.uint8), [b"SCKT"]],
    ids=["str", "bytearray", "memoryview", "int", "None", "tensor", "list"],
)
def test_non_bytes_value_under_packed_key(value: Any) -> None:
    """Only ``bytes`` may sit under ``param_groups.__packed__.*``."""
    _model, sd = saved()
    key, _table = table_of(sd)
    load_fails(with_table(sd, value, key=key), FMT, key, type(value).__name__)


@pytest.mark.parametrize(
    "key",
    [3, ("state", "a.weight"), None, b"state.a.weight.exp_avg", 1.5],
    ids=["int", "tuple", "None", "bytes", "float"],
)
def test_non_string_key(key: Any) -> None:
    """A key that is not a ``str``."""
    _model, sd = saved()
    sd[key] = torch.zeros(1)
    load_fails(sd, FMT, repr(key))


@pytest.mark.parametrize(
    "key", ["param_groups.__packed__.optim", "param_groups.__packed__..abc", "param_groups.__packed__.optim."]
)
def test_malformed_packed_key(key: str) -> None:
    """A packed key without leaf or digest."""
    _model, sd = saved()
    _key, table = table_of(sd)
    load_fails(with_table(sd, table, key=key), FMT, key)


def test_flat_entry_with_unsupported_value() -> None:
    """A flat ``param_groups.{fqn}.{key}`` whose value the codec cannot represent."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sd = sc.sparse_state_dict(model, opt, format="flat")
    sd["param_groups.a.weight.lr"] = {1, 2}
    with pytest.raises(FMT) as info:
        sc.load_sparse_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1), sd)
    assert "a.weight" in str(info.value) and "'lr'" in str(info.value) and "set" in str(info.value)


def test_state_nested_under_tensor() -> None:
    """``state.{fqn}.exp_avg`` and ``state.{fqn}.exp_avg.x`` cannot both exist."""
    _model, sd = saved()
    sd["state.a.weight.exp_avg.x"] = torch.zeros(1)
    load_fails(sd, FMT, "a.weight", "exp_avg")


def test_table_lists_fqn_the_model_lacks() -> None:
    """A settings table whose FQNs are unknown to the target model (strict)."""
    table = tab(
        GOOD_SETTINGS, [group(0, ["a.weight", "a.bias", "zzz"]), group(1, ["b.weight", "b.bias"]), group(1, [])]
    )
    load_fails(with_table({}, table), MISMATCH, "zzz", target=lr_only_target())


# --------------------------------------------------------------------------- fuzzing the decoders
#
# ``decode_table`` gets random bytes and mutated valid tables (bit flips, truncation, insertion,
# deletion, splicing two tables, overwritten length fields); ``unflatten`` gets random flat dicts
# with adversarial keys and values. Every input goes to every core: only CheckpointFormatError may
# escape and the C++ core and the Python twin agree (result to the bit, or message). Runs are
# derandomized (reproducible in CI) and sized to a few thousand cases; under ``.ci/sanitize.sh``
# they drive the C++ decoder through ASan/UBSan.

ONCE = _backends.only(_backends.DEFAULT)
"""The fuzz tests call every core themselves: one run (id ``cpp`` where it is built, for ``-k cpp``)."""

FUZZ = hypothesis.settings(
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
            buf[pos:pos] = bytes([rnd.choice([0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 255])])
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


def _decoded(decode_table: Any, leaf: str, data: bytes) -> tuple:
    """``("ok", result)`` or ``("err", message)``; only CheckpointFormatError may escape."""
    try:
        result = decode_table(leaf, data, parts_to_tensor, name_to_value)
    except CheckpointFormatError as exc:
        assert f"leaf {leaf!r}" in str(exc), str(exc)
        return ("err", str(exc))
    check_decoded(result)
    return ("ok", result)


def try_decode(data: bytes, leaf: str = "fz", decoders: list[Any] | None = None) -> bool:
    """Decode with every core (or ``decoders``); ``True`` on success. Only CheckpointFormatError may
    escape, and the cores agree: the same result to the bit, or the same message."""
    if decoders is None:
        decoders = [core.decode_table for core in _backends.cores()]
    first, *others = [_decoded(d, leaf, data) for d in decoders]
    for other in others:
        assert first[0] == other[0] and (same_bits(first[1], other[1]) if first[0] == "ok" else first == other), (
            f"the cores disagree on {data!r}:\n{first!r}\n{other!r}"
        )
    return first[0] == "ok"


# --------------------------------------------------------------------------- decode_table


_TOKENS = [b"\x00", b"\x01\x00\x00\x00", b"\xff\xff\xff\xff", b"\x09", b"\x07", b"\x05", b"a", b"\x03" + bytes(8)]
HEADER = MAGIC + u16(VERSION)
HEADER_NAMED = MAGIC + u16(2)  # a table holding a dtype or device (tags 10 and 11)


@ONCE
@hypothesis.settings(FUZZ, max_examples=300)
@given(data=st.binary(max_size=64), seed=SEEDS)
def test_decode_table_random_bytes(data: bytes, seed: int) -> None:
    """Random bytes, raw and behind a valid header, and random token streams (8 inputs per example)."""
    try_decode(data)
    try_decode(HEADER + data)
    try_decode(HEADER_NAMED + data)
    rnd = random.Random(seed)
    for _ in range(3):
        try_decode(HEADER + b"".join(rnd.choice(_TOKENS) for _ in range(rnd.randint(0, 24))))
        try_decode(HEADER + rnd.randbytes(rnd.randint(0, 48)))


MUTANTS_PER_TABLE = 16


def _check_and_mutate(table: bytes, groups: list[tuple[dict, list[str]]], other: bytes, rnd: random.Random) -> None:
    settings_list, _blobs, decoded = _core_py.decode_table("fz", table, parts_to_tensor)
    assert [members for _idx, members in decoded] == [members for _s, members in groups]
    for (idx, _members), (settings_in, _m) in zip(decoded, groups):
        assert list(settings_list[idx]) == list(settings_in)
    for _ in range(MUTANTS_PER_TABLE):
        try_decode(mutate(bytearray(table), rnd, other))


@ONCE
@hypothesis.settings(FUZZ, max_examples=300)
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


def _rich_tables() -> list[bytes]:
    """Valid tables covering every value tag, unicode, the deepest nesting and shared settings."""
    rich = {
        "lr": 0.1,
        "betas": (0.9, 0.999),
        "nan": float("nan"),
        "neg0": -0.0,
        "big": 2**63 - 1,
        "small": -(2**63),
        "flag": True,
        "off": False,
        "none": None,
        "name": "é日本🙂",
        "raw": b"\x00\xff",
        "list": [1, [2.5, ("x",)]],
        "t": torch.tensor([-0.0, 1.5], dtype=torch.float64),
        "t0": torch.tensor(0.5),
        "empty": torch.zeros(0, 3),
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    }
    nested: Any = 1
    for level in range(32):
        nested = (nested,) if level % 2 else [nested]
    groups_list = [
        [],
        [({}, [])],
        [(rich, ["a.w", "a.b"]), ({"lr": 0.2}, ["c"]), (dict(rich), ["日本.x"]), ({}, [])],
        [({"deep": nested, "lr": torch.tensor([1, -2, 3], dtype=torch.int32)}, ["p"]), ({"lr": 1}, ["q", "r", "s"])],
    ]
    named = {
        "momentum_dtype": torch.bfloat16,
        "dev": torch.device("cuda", 1),
        "mix": (torch.float32, [torch.device("cpu"), None]),
    }
    tables = [_core_py.encode_table("fz", g, torch.Tensor, tensor_to_parts) for g in groups_list]
    return tables + [
        _core_py.encode_table("fz", [(rich, ["a"]), (named, ["b", "c"])], torch.Tensor, tensor_to_parts, value_to_name)
    ]


RICH_TABLES = _rich_tables()


@ONCE
@hypothesis.settings(FUZZ, max_examples=200)
@given(seed=SEEDS)
def test_decode_rich_tables_mutated(seed: int) -> None:
    """Mutants of tables holding every value tag, unicode and 32 levels of nesting (3200 inputs)."""
    rnd = random.Random(seed)
    for _ in range(MUTANTS_PER_TABLE):
        try_decode(mutate(bytearray(rnd.choice(RICH_TABLES)), rnd, rnd.choice(RICH_TABLES)))


@ONCE
@hypothesis.settings(FUZZ, max_examples=60)
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


@ONCE
@hypothesis.settings(FUZZ, max_examples=300)
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
    """On every core: only CheckpointFormatError may escape, the cores agree, and a successful
    split accounts for every key."""
    outcomes = []
    for core in _backends.cores():
        try:
            outcomes.append(("ok", core.unflatten(flat, known)))
        except CheckpointFormatError as exc:
            outcomes.append(("err", str(exc)))
    first, *others = outcomes
    for other in others:
        assert first[0] == other[0] and (same_bits(first[1], other[1]) if first[0] == "ok" else first == other), (
            f"the cores disagree on {flat!r}:\n{first!r}\n{other!r}"
        )
    if first[0] == "err":
        return
    settings_by, state_by, packed, scalars, unmatched = first[1]
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


@ONCE
def test_fuzz_harness_can_fail() -> None:
    """The harness lets any other exception escape, and rejects a malformed decode result."""

    def raises(*_args: Any) -> Any:
        raise IndexError("out of range")

    with pytest.raises(IndexError):
        try_decode(b"SCKT", decoders=[raises])
    with pytest.raises(AssertionError):
        try_decode(b"SCKT", decoders=[lambda *_a: ([{}], [b""], [(1, ["a"])])])
    with pytest.raises(AssertionError, match="the cores disagree"):
        try_decode(b"SCKT", decoders=[_core_py.decode_table, lambda *_a: ([], [], [])])


# --------------------------------------------------------------------- layout tables: damaged, missing or inconsistent


def _two_rank_buffers() -> tuple[nn.Module, torch.optim.Optimizer, list[dict[str, Any]]]:
    """A model whose AdamW state two 'ranks' saved as buffers, each holding half the rows of every
    parameter-shaped state (as FSDP would), in one dict each (``w2r0`` / ``w2r1`` keys)."""
    from sparse_ckpt import _backend as backend
    from sparse_ckpt._format.keys import BUFFERS_PREFIX, PACKED_PREFIX, seal
    from sparse_ckpt._layouts.bucketed import buffer_key, fill, layout_key
    from sparse_ckpt._load.completeness import without_items_record

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 6))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn(p.shape)
    opt.step()
    sd = sc.sparse_state_dict(model, opt, state_layout="buffers")
    # (the group table's item record names this save's own w1r0 buffers: the 'ranks' below replace them)
    base = {
        k: without_items_record(PACKED_PREFIX, k[len(PACKED_PREFIX) :], v) if k.startswith(PACKED_PREFIX) else v
        for k, v in sd.items()
        if not k.startswith(BUFFERS_PREFIX)
    }
    dicts = []
    for rank in range(2):
        entries, local = [], []
        for name, p in model.named_parameters():
            rows = p.shape[0]
            lo, hi = (0, rows // 2) if rank == 0 else (rows // 2, rows)
            for key in ("exp_avg", "exp_avg_sq"):
                t = opt.state[p][key]
                entries.append(
                    (name, key, "float32", 4, tuple(t.shape), (lo, *[0] * (t.ndim - 1)), (hi - lo, *t.shape[1:]))
                )
                local.append(t[lo:hi])
        layout, buckets = backend.core.encode_layout("optim", entries, 64)
        tag = f"w2r{rank}"
        d = {layout_key("optim", tag): seal(layout)}
        for i, buf in enumerate(fill(buckets, local)):
            d[buffer_key("optim", tag, i, "float32")] = buf.clone()
        dicts.append(d)
    return model, opt, [base, *dicts]


@ONCE
@hypothesis.settings(FUZZ, max_examples=150)
@given(seed=SEEDS)
def test_mutated_layout_tables_load_exactly_or_are_refused(seed: int) -> None:
    """A layout table mutated (and re-sealed, as an edit would be): the load through every core is
    refused with a SparseCheckpointError, the target untouched, or restores exactly what was saved."""
    from helpers import assert_optimizer_equal, snapshot_optimizer

    from sparse_ckpt import _backend as backend
    from sparse_ckpt._format.keys import check_table as open_layout
    from sparse_ckpt._format.keys import seal

    rnd = random.Random(seed)
    model, opt, (base, r0, r1) = _FIXTURE or _fixture()
    victim = rnd.choice([r0, r1])
    key = next(k for k in victim if ".L" in k)
    table = open_layout("state.__buffers__.", key[len("state.__buffers__.") :], victim[key])[1]
    bad = bytearray(table)
    for _ in range(rnd.randint(1, 2)):
        at = rnd.randrange(6, len(bad))
        bad[at] ^= rnd.randint(1, 255)
    edited = {**base, **r0, **r1, key: seal(bytes(bad))}
    for core in (_core_py, *([backend.core] if backend.NAME == "cpp" else [])):
        saved_core = backend.core
        backend.core = core
        try:
            target = torch.optim.AdamW(model.parameters(), lr=0.5)
            before = snapshot_optimizer(target)
            try:
                sc.load_sparse_state_dict(model, target, edited)
            except sc.SparseCheckpointError:
                assert_optimizer_equal(target, before)
                continue
            assert_optimizer_equal(target, opt, grads=False)
        finally:
            backend.core = saved_core


_FIXTURE: Any = None


def _fixture() -> Any:
    global _FIXTURE
    _FIXTURE = _two_rank_buffers()
    return _FIXTURE


def test_two_rank_buffers_fixture_loads_exactly() -> None:
    """The fuzz above starts from a checkpoint that loads (so its refusals come from the edits)."""
    from helpers import assert_optimizer_equal

    model, opt, (base, r0, r1) = _FIXTURE or _fixture()
    target = torch.optim.AdamW(model.parameters(), lr=0.5)
    sc.load_sparse_state_dict(model, target, {**base, **r0, **r1})
    assert_optimizer_equal(target, opt, grads=False)
    with pytest.raises(sc.CheckpointMismatchError, match="cover"):  # one rank's half alone is not enough
        sc.load_sparse_state_dict(model, torch.optim.AdamW(model.parameters()), {**base, **r0})
