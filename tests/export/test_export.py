"""Pickle-free export (``sparse_ckpt.export``): safetensors + JSON written from a DCP checkpoint,
restored by FQN into any layout, on one rank and on two (FSDP2 DTensors, expert parallelism)."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import pickletools
import struct
from pathlib import Path
from typing import Any

import _backends
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import (
    HEAD_LR,
    MULTI_RANK,
    assert_snapshots_equal,
    assert_state_placed_like_params,
    build_fsdp,
    full_snapshot,
    run_ranks,
    train_body,
    trained_fsdp,
)
from helpers import assert_deep_equal, assert_optimizer_equal, make_moe, moe_with_leaves, snapshot_optimizer, train
from torch import nn
from torch.distributed.tensor import DTensor

import sparse_ckpt as sc
from sparse_ckpt.errors import UsageError
from sparse_ckpt.export import MANIFEST_FILE, TENSORS_FILE, export_checkpoint, load_export, read_export
from sparse_ckpt.tools import verify_checkpoint
from sparse_ckpt.tools._export_format import FIRST_FQNS, manifest_text
from sparse_ckpt.tools._reader import open_checkpoint, read_entries

pytestmark = MULTI_RANK

IDLE_LR = 0.0025


# --------------------------------------------------------------------------- fixtures


build = moe_with_leaves
"""TinyMoE with leaves dense / experts (one group per expert) / idle (expert 3, never steps)."""


def trained() -> tuple[nn.Module, sc.MultiOptimizer]:
    model, opt = build(0)
    train(model, opt, 2, only_experts=[0, 1])  # expert 2 and the idle leaf stay stateless
    for group in opt["idle"].param_groups:
        group["lr"] = IDLE_LR
    return model, opt


def save(path: Path, model: nn.Module, opt: Any, fmt: str = "packed", state_layout: str | None = None) -> None:
    layout = {} if state_layout is None else {"state_layout": state_layout}
    dcp.save(
        {"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt, format=fmt, **layout)},
        checkpoint_id=path,
    )


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Path, Path, nn.Module, sc.MultiOptimizer]:
    model, opt = trained()
    save(tmp_path / "ckpt", model, opt)
    summary = export_checkpoint(tmp_path / "ckpt", tmp_path / "export")
    assert (summary.key, summary.source_format, summary.leaves) == ("optim", "packed", ["dense", "experts", "idle"])
    assert summary.tensors == sum(len(st) for _l, o in opt.leaves() for st in o.state.values())
    return tmp_path / "ckpt", tmp_path / "export", model, opt


# --------------------------------------------------------------------------- one rank


def test_round_trip_same_and_other_layout(exported: tuple[Path, Path, nn.Module, sc.MultiOptimizer]) -> None:
    _ckpt, out, model, opt = exported
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_FILE, TENSORS_FILE]

    saved = full_snapshot(model, opt)
    params = model.state_dict()
    model2, opt2 = build(seed=1)
    model2.load_state_dict(params)
    load_export(model2, opt2, out)
    assert_optimizer_equal(opt, opt2, grads=False)
    assert not opt2["idle"].state and opt2["idle"].param_groups[0]["lr"] == IDLE_LR
    train(model, opt, 1, seed=7)
    train(model2, opt2, 1, seed=7)
    assert_optimizer_equal(opt, opt2, grads=False)  # the next step is bit-identical

    # Another layout: one optimizer (leaf 'optim'), two groups, parameters in another order.
    model3 = make_moe(2)
    model3.load_state_dict(params)
    idle = list(model3.experts[3].parameters())
    rest = [p for p in reversed(list(model3.parameters())) if all(p is not q for q in idle)]
    opt3 = torch.optim.AdamW([{"params": rest}, {"params": idle}], lr=0.5)
    load_export(model3, opt3, out)
    assert_snapshots_equal(saved, full_snapshot(model3, opt3), "other layout", layout=False, params=False)
    assert [g["lr"] for g in opt3.param_groups] == [0.01, IDLE_LR]


def test_flat_checkpoint_and_streamed_batches(tmp_path: Path) -> None:
    """A flat (DSD-layout) checkpoint exports as one packed table; batch size does not change a byte."""
    model, opt = trained()
    save(tmp_path / "flat", model, opt, fmt="flat")
    a = export_checkpoint(tmp_path / "flat", tmp_path / "a")
    export_checkpoint(tmp_path / "flat", tmp_path / "b", batch_bytes=1)  # one tensor per dcp.load
    assert a.source_format == "flat" and a.leaves == ["optim"] and a.tables == 1
    assert (tmp_path / "a" / TENSORS_FILE).read_bytes() == (tmp_path / "b" / TENSORS_FILE).read_bytes()
    model2, opt2 = build(seed=1)
    load_export(model2, opt2, tmp_path / "b")
    assert_snapshots_equal(full_snapshot(model, opt), full_snapshot(model2, opt2), params=False)


def test_dtypes_and_json_values_round_trip_exactly(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    st = opt.state[model.weight]
    st.update(
        {
            "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "mask": torch.tensor([[True, False, True], [False, True, False]]),
            "empty": torch.zeros(0),
            "count": torch.tensor(7, dtype=torch.int64),
            "note": "warm-up",
            "n": 3,
            "ratio": float("nan"),
            "pair": (1, 2.5),
            "items": [1, None, True, "x", float("-inf")],
            "ema.decay": 0.99,  # an escaped key part
        }
    )
    # per item: the reference below reads the checkpoint's state items (buffered state, the same
    # export: tests/export/test_export_buffers.py)
    save(tmp_path / "ckpt", model, opt, state_layout="per_tensor")
    s = export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert s.values == 6 and s.tensors == 6
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_text())
    assert manifest["values"]["state.weight.pair"] == {"tuple": [1, 2.5]}

    # read_export gives exactly what DCP reads (dtypes kept: no cast without a target optimizer)
    sd = read_export(tmp_path / "out")
    md = open_checkpoint(tmp_path / "ckpt")
    keys = [k for k in md.state_dict_metadata if k.startswith("optim.state.") and "__packed__" not in k]
    ref = read_entries(tmp_path / "ckpt", md, keys)
    assert sorted(sd_k for sd_k in sd if sd_k.startswith("state.")) == sorted(k.removeprefix("optim.") for k in keys)
    for k in keys:
        v, w = ref[k], sd[k.removeprefix("optim.")]
        if isinstance(v, torch.Tensor):
            assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), k
        else:
            assert type(v) is type(w) and repr(v) == repr(w), k

    model2 = nn.Linear(3, 2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    load_export(model2, opt2, tmp_path / "out")
    st2 = opt2.state[model2.weight]
    assert st2["half"].dtype == torch.float32  # floating state follows the param's dtype, as in torch
    assert st2["pair"] == (1, 2.5) and type(st2["pair"]) is tuple and st2["note"] == "warm-up"
    assert math.isnan(st2["ratio"]) and st2["items"][:4] == [1, None, True, "x"] and st2["items"][4] == float("-inf")
    assert st2["ema.decay"] == 0.99 and torch.equal(st2["mask"], st["mask"]) and st2["empty"].shape == (0,)


# --------------------------------------------------------------------------- manifest: group settings as JSON


def unrender(value: Any) -> Any:
    """The settings value a manifest's ``param_groups`` rendering documents (README, Export):
    tuples and non-finite floats tagged as for state values, tensors as dtype/shape/values."""
    if isinstance(value, list):
        return [unrender(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"tuple"}:
            return tuple(unrender(v) for v in value["tuple"])
        if set(value) == {"float"}:
            return float(value["float"])
        if set(value) == {"bytes_hex"}:
            return bytes.fromhex(value["bytes_hex"])
        if set(value) == {"tensor", "shape", "values"}:
            items = [
                complex(*v["complex"]) if isinstance(v, dict) and "complex" in v else unrender(v)
                for v in value["values"]
            ]
            return torch.tensor(items, dtype=getattr(torch, value["tensor"])).reshape(value["shape"])
        raise AssertionError(f"unknown tagged value {value!r}")
    return value


def strict_json(path: Path) -> Any:
    """``path`` parsed as strict JSON (NaN/Infinity refused), and equal to the manifest writer's
    rendering of what it parsed (the text round-trips)."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {name}")

    text = path.read_text(encoding="utf-8")
    data = json.loads(text, parse_constant=refuse)
    assert json.loads(manifest_text(data)) == data
    return data


def rendered_groups(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {leaf["name"]: leaf["param_groups"] for leaf in manifest["leaves"]}


def settings_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def assert_rendering_matches(rendering: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Per group, the rendered settings are exactly the optimizer's (values, types, key order)."""
    assert [g["index"] for g in rendering["groups"]] == list(range(len(optimizer.param_groups)))
    for group, want in zip(rendering["groups"], settings_of(optimizer)):
        got = {k: unrender(v) for k, v in rendering["settings"][group["settings"]].items()}
        assert_deep_equal(got, want, f"group {group['index']}", nan_equal="floats")


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_manifest_renders_group_settings_one_leaf(tmp_path: Path, fmt: str) -> None:
    """Every group's settings are in manifest.json as JSON values: a scheduler-moved lr, a betas
    tuple, a tensor lr, a non-finite float; plus counts and first FQNs. Valid strict JSON."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters()},
            {"params": model[1].parameters(), "lr": torch.tensor(0.5), "foreach": False, "weight_decay": float("inf")},
            {"params": model[2].parameters(), "betas": (0.5, 0.75)},
        ],
        lr=0.01,
        betas=(0.8, 0.9),
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    model[0](torch.ones(2, 3)).sum().backward()  # only the first group gets state
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0025
    save(tmp_path / "ckpt", model, opt, fmt=fmt)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out")

    manifest = strict_json(tmp_path / "out" / MANIFEST_FILE)
    rendering = rendered_groups(manifest)["optim"]
    assert_rendering_matches(rendering, opt)
    first = rendering["settings"][rendering["groups"][0]["settings"]]
    assert first["lr"] == 0.0025 and first["betas"] == {"tuple": [0.8, 0.9]}
    second = rendering["settings"][rendering["groups"][1]["settings"]]
    assert second["lr"] == {"tensor": "float32", "shape": [], "values": [0.125]}
    assert second["weight_decay"] == {"float": "inf"}
    assert [{k: g[k] for k in ("params", "with_state", "first_fqns")} for g in rendering["groups"]] == [
        {"params": 2, "with_state": 2, "first_fqns": ["0.weight", "0.bias"]},
        {"params": 2, "with_state": 0, "first_fqns": ["1.weight", "1.bias"]},
        {"params": 2, "with_state": 0, "first_fqns": ["2.weight", "2.bias"]},
    ]
    assert len(rendering["settings"]) == 3  # each distinct settings once


def _two_leaves(seed: int) -> tuple[nn.Module, sc.MultiOptimizer]:
    """README's toy MoE: 4 experts (one group) and a dense layer, one AdamW leaf each."""
    torch.manual_seed(seed)
    model = nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(4, 4) for _ in range(4)), "dense": nn.Linear(4, 4)})
    opt = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(model["experts"].parameters(), lr=0.01),
            "dense": torch.optim.AdamW(model["dense"].parameters(), lr=0.01, betas=(0.8, 0.95)),
        },
    )
    return model, opt


def test_manifest_renders_group_settings_two_leaves(tmp_path: Path) -> None:
    """A MultiOptimizer's leaves each get their rendering; it is informational: load_export reads
    the binary tables, so an edited rendering changes nothing that is loaded."""
    model, opt = _two_leaves(0)
    sched = torch.optim.lr_scheduler.StepLR(opt["dense"], step_size=1, gamma=0.25)
    opt.zero_grad()
    model["experts"][0](model["dense"](torch.randn(8, 4))).pow(2).mean().backward()  # only expert 0 routed
    opt.step()
    sched.step()
    save(tmp_path / "ckpt", model, opt)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out")

    manifest = strict_json(tmp_path / "out" / MANIFEST_FILE)
    rendering = rendered_groups(manifest)
    assert sorted(rendering) == ["dense", "experts"]
    for name in rendering:
        assert_rendering_matches(rendering[name], opt[name])
    dense = rendering["dense"]
    assert dense["settings"][0]["lr"] == 0.0025 and dense["settings"][0]["betas"] == {"tuple": [0.8, 0.95]}
    assert dense["groups"] == [
        {"index": 0, "settings": 0, "params": 2, "with_state": 2, "first_fqns": ["dense.weight", "dense.bias"]}
    ]
    experts = rendering["experts"]
    assert experts["settings"][0]["lr"] == 0.01 and experts["settings"][0]["betas"] == {"tuple": [0.9, 0.999]}
    assert experts["groups"] == [
        {
            "index": 0,
            "settings": 0,
            "params": 8,
            "with_state": 2,
            "first_fqns": ["experts.0.weight", "experts.0.bias", "experts.1.weight"][:FIRST_FQNS],
        }
    ]

    # Edit the rendering: what load_export installs still comes from the binary tables.
    path = tmp_path / "out" / MANIFEST_FILE
    edited = json.loads(path.read_text())
    for leaf in edited["leaves"]:
        for settings in leaf["param_groups"]["settings"]:
            settings["lr"] = 99.0
    path.write_text(json.dumps(edited))
    model2, opt2 = _two_leaves(1)
    model2.load_state_dict(model.state_dict())
    load_export(model2, opt2, tmp_path / "out")
    assert opt2["dense"].param_groups[0]["lr"] == 0.0025 and opt2["experts"].param_groups[0]["lr"] == 0.01
    assert_optimizer_equal(opt, opt2, grads=False)


def test_refuses_values_that_need_pickle(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["blob"] = b"\x00\x01"
    save(tmp_path / "ckpt", model, opt)
    with pytest.raises(sc.CheckpointFormatError, match=r"state value 'state\.weight\.blob' is a bytes"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # validated before anything is written


def test_strict_missing_extra_and_transactional(exported: tuple[Path, Path, nn.Module, sc.MultiOptimizer]) -> None:
    _ckpt, out, _model, _opt = exported

    # missing: the target has a parameter the export lacks
    model2, opt2 = build(seed=1)
    model2.extra = nn.Linear(2, 2)
    opt2["dense"].add_param_group({"params": list(model2.extra.parameters())})
    train(model2, opt2, 1)  # the target has state of its own
    before = snapshot_optimizer(opt2)
    with pytest.raises(sc.CheckpointMismatchError, match=r"no saved param-group settings: 'extra\.weight'"):
        load_export(model2, opt2, out)
    assert_optimizer_equal(before, opt2)

    # extra: the export has parameters the target lacks (expert 3)
    model3 = make_moe(1)
    model3.experts = model3.experts[:3]
    opt3 = torch.optim.AdamW(model3.parameters(), lr=0.01)
    with pytest.raises(sc.CheckpointMismatchError, match=r"are in no target optimizer group.*experts\.3\."):
        load_export(model3, opt3, out)
    assert not opt3.state
    load_export(model3, opt3, out, strict=False)
    assert len(opt3.state) == sum(len(o.state) for _l, o in exported[3].leaves())

    # a failure after the first leaf was installed (a post-hook) rolls every leaf back
    model4, opt4 = build(seed=1)
    train(model4, opt4, 1)
    before = snapshot_optimizer(opt4)

    def boom(_optimizer: torch.optim.Optimizer) -> None:
        raise RuntimeError("post-hook failed")

    opt4["idle"].register_load_state_dict_post_hook(boom)
    with pytest.raises(RuntimeError, match="post-hook failed"):
        load_export(model4, opt4, out)
    assert_optimizer_equal(before, opt4)


def test_bad_exports_are_refused(exported: tuple[Path, Path, nn.Module, sc.MultiOptimizer], tmp_path: Path) -> None:
    ckpt, out, _model, _opt = exported
    model, opt = build(seed=1)
    st_path, man_path = out / TENSORS_FILE, out / MANIFEST_FILE
    good_st, good_man = st_path.read_bytes(), man_path.read_text()

    def refused(match: str) -> None:
        with pytest.raises(sc.CheckpointFormatError, match=match):
            load_export(model, opt, out)
        assert not any(o.state for _l, o in opt.leaves())

    st_path.write_bytes(good_st[:-100])
    refused("truncated or modified export")
    man = json.loads(good_man)
    man["tensors"]["bytes"] -= 100
    man_path.write_text(json.dumps(man))
    refused("not a readable safetensors file")  # the safetensors reader sees the short file too
    st_path.write_bytes(good_st)
    man["tensors"]["bytes"] += 100
    man["version"] = 2
    man_path.write_text(json.dumps(man))
    refused("export version 2 is not supported")
    man_path.write_text("{not json")
    refused("not valid JSON")
    man_path.unlink()
    refused("has no manifest.json: incomplete or not a sparse_ckpt export")
    man_path.write_text(good_man)

    # a table byte flipped inside the safetensors data: its digest no longer matches
    (n,) = struct.unpack("<Q", good_st[:8])
    header = json.loads(good_st[8 : 8 + n])
    table = next(k for k in header if "__packed__" in k)
    at = 8 + n + header[table]["data_offsets"][0] + 10
    st_path.write_bytes(good_st[:at] + bytes([good_st[at] ^ 0xFF]) + good_st[at + 1 :])
    refused("does not match its sealed digest")
    st_path.write_bytes(good_st)

    with pytest.raises(UsageError, match="is not an empty directory"):
        export_checkpoint(ckpt, out)


class _Forbidden(Exception):
    pass


_PICKLE_HEADERS = tuple(bytes([0x80, protocol]) for protocol in range(2, 6))  # PROTO 2..5 at offset 0
_TORCH_ZIP = b"PK\x03\x04"  # torch.save's zip archive (which holds a pickle)


def _pickle_or_torch_zip(data: bytes) -> str | None:
    """What makes ``data`` a pickle or a ``torch.save`` file, or ``None``: a protocol 2-5 header,
    the zip magic, or a complete pickle stream from offset 0 (``pickletools.genops`` reaches STOP,
    which also catches the header-less protocols 0 and 1)."""
    if data.startswith(_PICKLE_HEADERS):
        return f"pickle protocol {data[1]} header"
    if data.startswith(_TORCH_ZIP):
        return "torch.save zip magic"
    try:
        for opcode, _arg, pos in pickletools.genops(data):
            if opcode.name == "STOP":
                return f"a complete pickle stream ({pos + 1} bytes)"
    except Exception:  # noqa: BLE001 - any opcode/argument error: not a pickle stream
        return None
    return None


def test_pickle_detector_finds_pickles(tmp_path: Path) -> None:
    """The scan of the next test can fail: every pickle protocol and torch.save's file are found."""
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert _pickle_or_torch_zip(pickle.dumps({"lr": (0.9, 0.999)}, protocol=protocol)), protocol
    torch.save({"lr": torch.ones(2)}, tmp_path / "t.pt")
    assert _pickle_or_torch_zip((tmp_path / "t.pt").read_bytes()) == "torch.save zip magic"
    assert _pickle_or_torch_zip(b'{"format": "sparse_ckpt.export"}') is None


def test_export_holds_no_pickle_and_loading_never_unpickles(
    exported: tuple[Path, Path, nn.Module, sc.MultiOptimizer],
) -> None:
    _ckpt, out, model, opt = exported
    files = [Path(root, name) for root, _dirs, names in os.walk(out) for name in names]
    assert sorted(p.name for p in files) == [MANIFEST_FILE, TENSORS_FILE]  # no temporary or extra file
    for path in files:
        data = path.read_bytes()
        found = _pickle_or_torch_zip(data)
        assert found is None, f"{path.name} is a pickle / torch.save file: {found}"
        assert not data.startswith((b"\x80", b"PK\x03\x04")), f"{path.name} looks like a pickle / torch.save file"
        if path.name == MANIFEST_FILE:
            json.loads(data)
            continue
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        assert b"\x80\x02" not in data[: 8 + n] and b"\x80\x04" not in data[: 8 + n]
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        assert 8 + n + end == len(data)  # header + raw tensor bytes, nothing else
        with pytest.raises(Exception):  # noqa: B017 - any refusal: it is no pickle stream
            pickle.loads(data)

    def forbid(*_args: Any, **_kwargs: Any) -> Any:
        raise _Forbidden("unpickling while reading an export")

    import _pickle

    model2, opt2 = build(seed=1)
    model2.load_state_dict(model.state_dict())
    with pytest.MonkeyPatch.context() as mp:
        for mod, attr in [
            (pickle, "load"),
            (pickle, "loads"),
            (pickle, "Unpickler"),
            (_pickle, "load"),
            (_pickle, "loads"),
            (_pickle, "Unpickler"),
            (torch, "load"),
            (torch.serialization, "load"),
        ]:
            mp.setattr(mod, attr, forbid)
        with pytest.raises(_Forbidden):
            torch.load(io.BytesIO(b""))  # the patch is effective
        read_export(out)
        load_export(model2, opt2, out)
    assert_optimizer_equal(opt, opt2, grads=False)


def test_several_optimizers_need_a_key(tmp_path: Path) -> None:
    model, opt = trained()
    st = sc.SparseOptimizerState(model, opt)
    dcp.save({"a": st, "b": sc.SparseOptimizerState(model, opt["dense"])}, checkpoint_id=tmp_path / "ckpt")
    with pytest.raises(UsageError, match=r"holds 2 optimizers \('a', 'b'\): pass --key"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert export_checkpoint(tmp_path / "ckpt", tmp_path / "out", key="b").leaves == ["optim"]


# --------------------------------------------------------------------------- two ranks (FSDP2 model: tests/_dist.py)


def _save_fsdp(rank: int, world_size: int, ckpt: str, ref: str) -> None:
    model, opt = trained_fsdp(sharded=True)
    snap = full_snapshot(model, opt)
    dcp.save({"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=ckpt)
    if rank == 0:
        torch.save(snap, ref)


def _load_fsdp(rank: int, world_size: int, ckpt: str, out: str, ref: str) -> None:
    reference = torch.load(ref, weights_only=True)
    via_export, via_dcp = build_fsdp(5, sharded=True), build_fsdp(6, sharded=True)
    for model, opt in (via_export, via_dcp):
        msd = model.state_dict()
        dcp.load({"model": msd}, checkpoint_id=ckpt)
        model.load_state_dict(msd)
    load_export(*via_export, out)
    model, opt = via_dcp
    dcp.load({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=ckpt, planner=sc.SparseLoadPlanner())

    model, opt = via_export
    assert not opt["head"].state and [g["lr"] for g in opt["head"].param_groups] == [HEAD_LR]
    assert_state_placed_like_params(model, opt)
    for p, st in opt["body"].state.items():
        assert isinstance(p, DTensor)
        for k, v in st.items():
            if k != "step":
                local = v.to_local()
                assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), "keeps the full tensor"
    assert_snapshots_equal(
        full_snapshot(*via_export), reference, f"rank {rank}: loaded", params=False, state_key_order=False
    )
    for m, o in (via_export, via_dcp):
        train_body(m, o, 1, seed=100)
    a, b = full_snapshot(*via_export), full_snapshot(*via_dcp)
    assert_snapshots_equal(a, b, f"rank {rank}: next step")


@_backends.ranks
def test_fsdp2_two_rank_checkpoint(tmp_path: Path) -> None:
    """Saved by 2 FSDP2 ranks; exported in one process; loaded unsharded here and sharded on 2 ranks
    (state becomes DTensors placed like the params; the next step equals a DCP-loaded twin)."""
    ckpt, out, ref = tmp_path / "ckpt", tmp_path / "export", tmp_path / "ref.pt"
    run_ranks(_save_fsdp, 2, str(ckpt), str(ref))
    report = verify_checkpoint(ckpt)  # sharded items: one storage record per chunk
    assert report["ok"] and report["read"] == report["items"], report["problems"]
    export_checkpoint(ckpt, out)
    model, opt = build_fsdp(3, sharded=False)
    load_export(model, opt, out)
    reference = torch.load(ref, weights_only=True)
    assert_snapshots_equal(full_snapshot(model, opt), reference, params=False, state_key_order=False)
    run_ranks(_load_fsdp, 2, str(ckpt), str(out), str(ref))


class EPNet(nn.Module):
    """A shared layer and this rank's experts ``experts.{2r}`` (steps) and ``experts.{2r+1}`` (idle)."""

    def __init__(self, experts: tuple[int, ...], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shared = nn.Linear(4, 4)  # the same on every rank (never steps here)
        torch.manual_seed(seed * 100 + experts[0])
        self.experts = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in experts})


def _ep_opt(model: EPNet) -> sc.MultiOptimizer:
    return sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(model.experts.parameters(), lr=0.5),
            "shared": torch.optim.AdamW(model.shared.parameters(), lr=0.5),
        },
    )


def _save_ep(rank: int, world_size: int, ckpt: str) -> None:
    model = EPNet((2 * rank, 2 * rank + 1), seed=0)
    opt = _ep_opt(model)
    for group in opt["experts"].param_groups:
        group["lr"] = 0.001 * (rank + 1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    model.experts[str(2 * rank)](torch.tanh(model.shared(x))).pow(2).mean().backward()
    opt["experts"].step()
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=ckpt)
    torch.save(full_snapshot(model, opt), f"{ckpt}.rank{rank}.pt")


def _load_ep(rank: int, world_size: int, ckpt: str, out: str) -> None:
    model = EPNet((2 * rank, 2 * rank + 1), seed=9)
    opt = _ep_opt(model)
    load_export(model, opt, out)  # the other rank's experts are not "extra"
    saved = torch.load(f"{ckpt}.rank{rank}.pt", weights_only=True)
    assert_snapshots_equal(full_snapshot(model, opt), saved, f"rank {rank}", params=False, state_key_order=False)
    # a local parameter the export lacks still fails (strict)
    model2 = EPNet((2 * rank, 2 * rank + 1, 8 + rank), seed=9)
    opt2 = _ep_opt(model2)
    with pytest.raises(sc.CheckpointMismatchError, match=rf"experts\.{8 + rank}\.weight"):
        load_export(model2, opt2, out)
    assert not any(o.state for _l, o in opt2.leaves())
    dist.barrier()


@_backends.ranks
def test_expert_parallel_two_rank_checkpoint(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ep", tmp_path / "export"
    run_ranks(_save_ep, 2, str(ckpt))
    s = export_checkpoint(ckpt, out)
    assert s.tables == 3 and s.leaves == ["experts", "shared"]  # both ranks' expert tables, one shared table
    run_ranks(_load_ep, 2, str(ckpt), str(out))
