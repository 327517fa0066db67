"""Export of buffered state (``state_layout="buffers"``, alone or next to per-item state): the
export is the same, file for file and byte for byte in its tensors, as the export of the same
state saved per item, in one process and from 2 FSDP2 ranks; buckets are read a batch at a time
(each once per batch that needs part of it); damaged buffers are refused as a load refuses them."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import _backends
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import MULTI_RANK, assert_snapshots_equal, build_fsdp, full_snapshot, run_ranks, trained_fsdp
from helpers import assert_optimizer_equal, make_moe
from legacy_checkpoints import drop_from_metadata
from test_export import EPNet, _ep_opt
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._format.keys import BUFFERS_PREFIX
from sparse_ckpt._layouts import bucketed
from sparse_ckpt._layouts.bucketed_view import FullTensors
from sparse_ckpt.export import MANIFEST_FILE, TENSORS_FILE, export_checkpoint, load_export
from sparse_ckpt.tools._export_order import tables_first

pytestmark = MULTI_RANK

LAYOUTS = ("per_tensor", "buffers")


def _model(seed: int) -> nn.Module:
    """A TinyMoE with bf16 experts 0 and 2 (two dtypes, so two buffers)."""
    model = make_moe(seed, n_experts=4)
    for i in (0, 2):
        model.experts[i].to(torch.bfloat16)
    return model


def _trained(name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """:func:`_model` with state for experts 2 and 0 (in that order: state order is not parameter
    order) and the dense parameters."""
    model = _model(0)
    make = {
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01),
        # 2-D parameters' row/col factors are not parameter-shaped (per item), 1-D ones' variance is
        "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    }[name]
    opt = make(model.parameters())
    gen = torch.Generator().manual_seed(0)
    for first in (True, False):  # expert 2 gets state first, then expert 0 and the dense parameters
        for fqn, p in model.named_parameters():
            steps = fqn.startswith("experts.2.") or (not first and not fqn.startswith(("experts.1.", "experts.3.")))
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) if steps else None
        opt.step()
    return model, opt


def _same_exports(a: Path, b: Path) -> None:
    """Two exports hold the same bytes: the safetensors file, and the manifest but for its source path."""
    assert (a / TENSORS_FILE).read_bytes() == (b / TENSORS_FILE).read_bytes()
    ma, mb = (json.loads((p / MANIFEST_FILE).read_text()) for p in (a, b))
    assert ma["source"].pop("checkpoint") != mb["source"].pop("checkpoint")
    assert ma == mb


@pytest.mark.parametrize("name", ["AdamW", "Adafactor"])
def test_buffers_export_equals_per_tensor_export(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process: small buckets (many of them, two dtypes) and batches of every size give the
    per-tensor checkpoint's export byte for byte; it loads back exactly."""
    model, opt = _trained(name)
    monkeypatch.setattr(bucketed, "BUCKET_BYTES", 300)
    for layout in LAYOUTS:
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path / layout)
    keys = dcp.FileSystemReader(str(tmp_path / "buffers")).read_metadata().state_dict_metadata
    buckets = [k for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}optim.B")]
    assert len(buckets) >= (5 if name == "AdamW" else 2) and {k.split("_")[-2] for k in buckets} == {
        "float32",
        "bfloat16",
    }
    per_item = [k for k in keys if k.startswith("optim.state.") and BUFFERS_PREFIX not in k and "__packed__" not in k]
    assert bool(per_item) == (name == "Adafactor")  # a mix: some state per item, some buffered

    reference = export_checkpoint(tmp_path / "per_tensor", tmp_path / "x_per_tensor")
    for batch_bytes in (1, 500, 1 << 30):
        out = tmp_path / f"x_buffers_{batch_bytes}"
        summary = export_checkpoint(tmp_path / "buffers", out, batch_bytes=batch_bytes)
        _same_exports(tmp_path / "x_per_tensor", out)
        assert (summary.tensors, summary.tensor_bytes) == (reference.tensors, reference.tensor_bytes)
        if batch_bytes == 1 << 30:  # one batch: each bucket read once
            assert summary.buffer_reads == len(buckets)
        else:  # each bucket once per batch that needs part of it
            assert len(buckets) < summary.buffer_reads
    model2 = _model(1)
    model2.load_state_dict(model.state_dict())
    opt2 = type(opt)(model2.parameters(), lr=0.5)
    load_export(model2, opt2, tmp_path / "x_buffers_1")
    assert_optimizer_equal(opt, opt2, grads=False, state_order=False)


def test_buffers_of_every_dtype_export_like_per_item_state(tmp_path: Path) -> None:
    """bf16, bool and fp32 buckets next to per-item tensors (0-d, empty) and JSON values."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.state[model.weight].update(
        {
            "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "note": "warm-up",
            "mask": torch.tensor([[True, False, True], [False, True, False]]),
            "empty": torch.zeros(0),
            "count": torch.tensor(7, dtype=torch.int64),
            "ratio": float("nan"),
        }
    )
    for layout in LAYOUTS:
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path / layout)
        export_checkpoint(tmp_path / layout, tmp_path / f"x_{layout}")
    keys = dcp.FileSystemReader(str(tmp_path / "buffers")).read_metadata().state_dict_metadata
    assert {k.split("_")[-2] for k in keys if ".B" in k} == {"float32", "bfloat16", "bool"}
    _same_exports(tmp_path / "x_per_tensor", tmp_path / "x_buffers")


def test_batches_read_each_bucket_once_per_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One tensor per batch, every tensor in one bucket (one rank): one bucket read per buffered tensor."""
    model, opt = _trained("AdamW")
    monkeypatch.setattr(bucketed, "BUCKET_BYTES", 300)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout="buffers")}, checkpoint_id=tmp_path / "c")
    summary = export_checkpoint(tmp_path / "c", tmp_path / "x", batch_bytes=1)
    buffered = sum(1 for st in opt.state.values() for k in st if k != "step")
    assert summary.buffer_reads == buffered


def test_buckets_are_read_in_their_order_whatever_the_state_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """State created in a shuffled parameter order: the buckets hold it in that order, the export
    writes it in parameter order. Reading in the export's order would need most buckets in every
    batch (quadratic in the state's size); read in the buckets' order, each is read once."""
    model = nn.ParameterDict({f"p{i:02d}": nn.Parameter(torch.randn(4, 4)) for i in range(16)})
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist():
        for j, p in enumerate(model.values()):
            p.grad = torch.ones(4, 4) * (i + 1) if j == i else None
        opt.step()
    monkeypatch.setattr(bucketed, "BUCKET_BYTES", 256)  # two parameters' exp_avg and exp_avg_sq
    for layout in LAYOUTS:
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path / layout)
    keys = dcp.FileSystemReader(str(tmp_path / "buffers")).read_metadata().state_dict_metadata
    buckets = [k for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}optim.B")]
    assert len(buckets) == 8
    export_checkpoint(tmp_path / "per_tensor", tmp_path / "x_per_tensor", batch_bytes=256)
    summary = export_checkpoint(tmp_path / "buffers", tmp_path / "x_buffers", batch_bytes=256)
    _same_exports(tmp_path / "x_per_tensor", tmp_path / "x_buffers")
    assert summary.buffer_reads == len(buckets)


def test_the_writer_places_tensors_by_its_layout(tmp_path: Path) -> None:
    """`write_safetensors`: tensors arriving in any order give the same file; one arriving twice, or
    one that never arrives, is refused."""
    from sparse_ckpt.tools._safetensors_io import write_safetensors

    tensors = {"a": torch.arange(3.0), "b": torch.empty(0), "c": torch.arange(4, dtype=torch.int64).reshape(2, 2)}
    layout = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    write_safetensors(str(tmp_path / "in_order"), layout, tensors.items(), {})
    write_safetensors(str(tmp_path / "reversed"), layout, reversed(tensors.items()), {})
    assert (tmp_path / "in_order").read_bytes() == (tmp_path / "reversed").read_bytes()
    with pytest.raises(sc.CheckpointFormatError, match="internal: tensor 'a' is not planned"):
        write_safetensors(str(tmp_path / "twice"), layout, [*tensors.items(), ("a", tensors["a"])], {})
    with pytest.raises(sc.CheckpointFormatError, match="fewer tensors written than planned"):
        write_safetensors(str(tmp_path / "short"), layout, list(tensors.items())[1:], {})


# --------------------------------------------------------------------------- two FSDP2 ranks


def _save_fsdp_layouts(rank: int, world_size: int, root: str, ref: str) -> None:
    """Save the same FSDP2 optimizer per tensor and buffered; one parameter also has ``extra``
    state (a plain tensor of the full shape, the same on both ranks: per item in both layouts)
    between ``step`` and its moments, so the buffers checkpoint mixes per-item and buffered state."""
    model, opt = trained_fsdp(sharded=True)
    body = opt["body"]
    p = next(iter(body.state))
    st = body.state[p]
    body.state[p] = {
        "step": st["step"],
        "extra": torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape),
        **{k: v for k, v in st.items() if k != "step"},
    }
    snap = full_snapshot(model, opt)
    for layout in LAYOUTS:
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=f"{root}/{layout}")
    if rank == 0:
        torch.save(snap, ref)


@_backends.ranks
def test_fsdp2_buffers_export_equals_per_tensor_export(tmp_path: Path) -> None:
    """Saved by 2 FSDP2 ranks per tensor and buffered (plus per-item state): the exports are equal
    byte for byte, whole tensors assembled from both ranks' buckets, and load exactly."""
    ref = tmp_path / "ref.pt"
    run_ranks(_save_fsdp_layouts, 2, str(tmp_path), str(ref))
    keys = dcp.FileSystemReader(str(tmp_path / "buffers")).read_metadata().state_dict_metadata
    assert {k.rpartition("_")[2] for k in keys if ".B0_" in k} == {"w2r0", "w2r1"}  # each rank's own buckets
    assert any(k.endswith(".extra") for k in keys)
    export_checkpoint(tmp_path / "per_tensor", tmp_path / "x_per_tensor")
    summary = export_checkpoint(tmp_path / "buffers", tmp_path / "x_buffers", batch_bytes=64)
    _same_exports(tmp_path / "x_per_tensor", tmp_path / "x_buffers")
    assert summary.buffer_reads > 2
    model, opt = build_fsdp(3, sharded=False)
    load_export(model, opt, tmp_path / "x_buffers")
    reference = torch.load(ref, weights_only=True)
    assert_snapshots_equal(full_snapshot(model, opt), reference, params=False)


def _save_ep_layouts(rank: int, world_size: int, root: str) -> None:
    """Expert parallelism: each rank its own experts (tables ``w2r0``, ``w2r1``), a shared layer
    (a table both write once; its state the same on both ranks, so the copy DCP keeps of a replicated
    item does not depend on which rank it picks), saved per tensor and buffered."""
    model = EPNet((2 * rank, 2 * rank + 1), seed=0)
    opt = _ep_opt(model)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model.experts[str(2 * rank)](torch.tanh(model.shared(x))).pow(2).mean().backward()
    for p in model.shared.parameters():  # replicated: its gradients averaged, as data parallelism does
        torch.distributed.all_reduce(p.grad)
        p.grad /= world_size
    opt["experts"].step()
    opt["shared"].step()
    for layout in LAYOUTS:
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=f"{root}/{layout}")


@_backends.ranks
def test_expert_parallel_buffers_export_equals_per_tensor_export(tmp_path: Path) -> None:
    run_ranks(_save_ep_layouts, 2, str(tmp_path))
    for layout in LAYOUTS:
        s = export_checkpoint(tmp_path / layout, tmp_path / f"x_{layout}")
        assert s.tables == 3 and s.leaves == ["experts", "shared"]
    _same_exports(tmp_path / "x_per_tensor", tmp_path / "x_buffers")


def test_tables_sort_by_leaf_then_first_rank() -> None:
    """Not by the order DCP lists them in (its de-duplication moves a table both ranks write)."""
    from sparse_ckpt._format.keys import PACKED_PREFIX

    keys = [f"{PACKED_PREFIX}{k}" for k in ("b.w2r0", "a.d0123456789abcdef", "a.w16r2", "a.w16r10", "a.w16r0-9")]
    values = {"state.x.exp_avg": 0, **dict.fromkeys(keys, b"")}
    assert list(tables_first(values)) == [
        *(f"{PACKED_PREFIX}{k}" for k in ("a.w16r0-9", "a.w16r2", "a.w16r10", "a.d0123456789abcdef", "b.w2r0")),
        "state.x.exp_avg",
    ]


# --------------------------------------------------------------------------- damaged buffers


def _checkpoint(tmp_path: Path, layout: str = "buffers") -> tuple[Path, str]:
    """A saved checkpoint and its first bucket's key (when buffered)."""
    model, opt = _trained("AdamW")
    path = tmp_path / "ckpt"
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=path)
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return path, next((k for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}optim.B")), "")


def _edit_metadata(path: Path, key: str, edit: Any) -> None:
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    edit(md, key)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _no_data(md: Any, key: str) -> None:
    md.state_dict_metadata[key].chunks.clear()


def _no_storage(md: Any, key: str) -> None:
    for index in [i for i in md.storage_data if i.fqn == key]:
        del md.storage_data[index]


def _empty(md: Any, key: str) -> None:
    item = md.state_dict_metadata[key]
    item.size = torch.Size([0])
    for chunk in item.chunks:
        chunk.sizes = torch.Size([0])


@pytest.mark.parametrize(
    ("damage", "error", "match"),
    [
        (_no_data, sc.CheckpointFormatError, "item '{key}' of .*: \\.metadata lists data for 0 of its"),
        (_no_storage, sc.CheckpointMismatchError, "checkpoint item '{key}' has no storage entry"),
        (
            _empty,
            sc.CheckpointFormatError,
            "buffer item '{inner}' is torch\\.\\w+ of shape \\(0,\\), its layout table says",
        ),
        (drop_from_metadata, sc.CheckpointMismatchError, "'{inner}'"),
    ],
    ids=["no data", "no storage record", "empty", "lost"],
)
def test_damaged_buffers_are_refused(damage: Any, error: type[Exception], match: str, tmp_path: Path) -> None:
    """The load's refusals: a bucket without data or without its storage record, of another
    length than its layout, or lost from ``.metadata``; no manifest is written."""
    path, key = _checkpoint(tmp_path)
    if damage is drop_from_metadata:
        damage(path, key)
    else:
        _edit_metadata(path, key, damage)
    inner = key.removeprefix("optim.")
    with pytest.raises(error, match=match.format(inner=inner.replace(".", r"\."), key=key.replace(".", r"\."))):
        export_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out" / MANIFEST_FILE).exists()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tools_refuse_an_item_without_data(layout: str, tmp_path: Path) -> None:
    """A state item (a bucket, or a per-item tensor) whose chunks ``.metadata`` no longer lists:
    DCP reads nothing for it, so a tool reading it would get uninitialized memory. verify reports
    it, convert and export refuse it (they wrote it before)."""
    from sparse_ckpt.tools import convert_checkpoint, verify_checkpoint

    path, key = _checkpoint(tmp_path, layout)
    if layout == "per_tensor":
        key = "optim.state.embed.weight.exp_avg"
    _edit_metadata(path, key, _no_data)
    report = verify_checkpoint(path)
    assert not report["ok"] and [p["key"] for p in report["problems"]] == [key]
    assert ".metadata lists data for 0 of its" in report["problems"][0]["problem"]
    with pytest.raises(sc.CheckpointFormatError, match=f"item '{key}' of .*: .metadata lists data for 0 of its"):
        convert_checkpoint(str(path), str(tmp_path / "converted"), "packed")
    with pytest.raises(sc.CheckpointFormatError, match="lists data for 0 of its"):
        export_checkpoint(path, tmp_path / "out")


def test_an_unreadable_bucket_is_refused(tmp_path: Path) -> None:
    """A bucket whose bytes are garbage (the rest of the checkpoint intact): refused naming it."""
    path, key = _checkpoint(tmp_path)
    md = dcp.FileSystemReader(str(path)).read_metadata()
    [info] = [info for index, info in md.storage_data.items() if index.fqn == key]
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(info.length))
    with pytest.raises(
        sc.CheckpointFormatError, match=f"checkpoint item '{key}' in file .*: its bytes are not a readable item"
    ):
        export_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out" / MANIFEST_FILE).exists()


def _layouts(*chunks: tuple[int, int]) -> dict[str, Any]:
    """Layout tables and buckets of rows ``[lo, hi)`` of a 10x2 ``exp_avg``, one rank each."""
    from sparse_ckpt import _backend
    from sparse_ckpt._format.keys import seal

    values: dict[str, Any] = {}
    for rank, (lo, hi) in enumerate(chunks):
        entry = ("p", "exp_avg", "float32", 4, (10, 2), (lo, 0), (hi - lo, 2))
        table, _buckets = _backend.core.encode_layout("optim", [entry], 1 << 20)
        values[bucketed.layout_key("optim", f"w{len(chunks)}r{rank}")] = seal(table)
        values[bucketed.buffer_key("optim", f"w{len(chunks)}r{rank}", 0, "float32")] = torch.arange(2.0 * lo, 2.0 * hi)
    return values


def test_full_tensors_plan_and_checks() -> None:
    """`FullTensors` (what the export reads buffered state with): whole tensors from two ranks'
    chunks; overlapping and gapped layouts refused like a load refuses them, and a bucket of
    another length than its layout says."""
    values = _layouts((0, 6), (6, 10))
    full = FullTensors(list(values), values)
    assert full.tensors == [("p", "exp_avg", torch.float32, (10, 2))]

    def read(keys: list[str], consume: Any) -> None:
        for k in keys:
            consume(k, values[k])

    [t] = full.read([0], read)
    assert torch.equal(t, torch.arange(20.0).reshape(10, 2)) and full.buffer_reads == 2
    with pytest.raises(
        sc.CheckpointMismatchError, match="leaf 'optim': state 'exp_avg' of 'p': the checkpoint's layouts overlap"
    ):
        FullTensors(list(_layouts((0, 6), (4, 8))), _layouts((0, 6), (4, 8)))
    with pytest.raises(sc.CheckpointMismatchError, match="'exp_avg' of 'p'"):
        FullTensors(list(_layouts((0, 6), (7, 10))), _layouts((0, 6), (7, 10)))

    def short(keys: list[str], consume: Any) -> None:
        for k in keys:
            consume(k, values[k][:-1])

    with pytest.raises(
        sc.CheckpointFormatError, match=r"buffer item '.*B0_float32_w2r0' is a float32 tensor of shape \(11,\)"
    ):
        full.read([0], short)

    def lost(keys: list[str], consume: Any) -> None:
        consume(keys[0], values[keys[0]])

    with pytest.raises(
        sc.CheckpointFormatError, match=r"buffer item '.*w2r1', which holds state 'exp_avg' of 'p'.*was not read"
    ):
        full.read([0], lost)
