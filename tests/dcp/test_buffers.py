"""``state_layout="buffers"`` in one process: exact round trips, dtypes, buckets, item counts,
bounded reads, and refusals of damaged buffers and layouts.

Multi-rank resharding drills (2 -> 2, 2 -> 1, 2 -> 4, an expert-parallel degree change) are in
tests/dcp/test_buffers_multirank.py; plan caching and the keys in tests/dcp/test_stable_keys.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, clone_state_dict, make_moe, snapshot_optimizer, train
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import export, tools
from sparse_ckpt._format.keys import BUFFERS_PREFIX, SCALARS_PREFIX
from sparse_ckpt._layouts import bucketed as buffers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _optimizers() -> dict[str, Any]:
    return {
        "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "Adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01),
        "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
        "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
        "Adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
        "NAdam": lambda ps: torch.optim.NAdam(ps, lr=0.01),
        "RAdam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
        "Adadelta": lambda ps: torch.optim.Adadelta(ps),
        "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.01),
        "Rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
        "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    }


OPTIMIZERS = _optimizers()


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 0) -> None:
    """``n`` steps with seeded gradients (of the parameters' dtype) for every parameter except
    experts 1 and 3 (they never get state)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for name, p in model.named_parameters():
            idle = name.startswith(("experts.1.", "experts.3."))
            p.grad = None if idle else torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _trained(name: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_moe(0, n_experts=4).to(dtype)
    opt = OPTIMIZERS[name](model.parameters())
    _steps(model, opt, 2)
    return model, opt


def _fresh(model: nn.Module, name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model2 = make_moe(1, n_experts=4).to(next(model.parameters()).dtype)
    model2.load_state_dict(model.state_dict())
    return model2, OPTIMIZERS[name](model2.parameters())


def _state_keys_by_fqn(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[Any]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: list(st) for p, st in opt.state.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_round_trip_equals_per_tensor(name: str, dtype: torch.dtype) -> None:
    """Loading a buffers dict gives exactly what loading the per-tensor dict gives, and the next
    step of both is bit-identical; parameter-shaped tensors left the per-item entries."""
    model, src = _trained(name, dtype)
    per_tensor = sc.sparse_state_dict(model, src)
    buffered = sc.sparse_state_dict(model, src, state_layout="buffers")
    per_item = [k for k in buffered if k.startswith("state.") and not k.startswith((SCALARS_PREFIX, BUFFERS_PREFIX))]
    shaped = {n: p.shape for n, p in model.named_parameters()}
    assert not [
        k
        for k in per_item
        if isinstance(buffered[k], torch.Tensor)
        and any(k.startswith(f"state.{n}.") and buffered[k].shape == s for n, s in shaped.items())
    ], per_item
    assert [k for k in buffered if k.startswith(BUFFERS_PREFIX)]
    loaded = {}
    for label, sd in (("per_tensor", per_tensor), ("buffers", buffered)):
        model2, dst = _fresh(model, name)
        sc.load_sparse_state_dict(model2, dst, clone_state_dict(sd))  # loads may alias the dict's tensors
        assert_optimizer_equal(dst, src, grads=False, state_order=False) if dtype == torch.float32 else None
        assert _state_keys_by_fqn(model2, dst) == _state_keys_by_fqn(model, src), label
        loaded[label] = (model2, dst)
    # (torch's cast policy applies to both: NAdam's float32 mu_product follows a bf16 parameter)
    assert_optimizer_equal(loaded["buffers"][1], loaded["per_tensor"][1], grads=False, state_order=False)
    for model2, dst in loaded.values():
        _steps(model2, dst, 1, seed=7)
    assert_optimizer_equal(loaded["buffers"][1], loaded["per_tensor"][1], grads=False, state_order=False)


class _Everything(torch.optim.Optimizer):
    """Parameter-shaped state of many dtypes: float64/16, bf16, int32/64, uint8, bool (complex
    state needs a complex parameter: the load refuses it on a real one)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0, dtype=torch.int64)
                    st["f64"] = torch.zeros_like(p, dtype=torch.float64)
                    st["f16"] = torch.zeros_like(p, dtype=torch.float16)
                    st["bf16"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    st["i32"] = torch.zeros_like(p, dtype=torch.int32)
                    st["i64"] = torch.zeros_like(p, dtype=torch.int64)
                    st["u8"] = torch.zeros_like(p, dtype=torch.uint8)
                    st["mask"] = torch.zeros_like(p, dtype=torch.bool)
                    st["count"] = 0
                st["step"] += 1
                g = p.grad if p.grad is not None else torch.ones_like(p)
                st["f64"] += g.double()
                st["f16"] += g.half()
                st["bf16"] += g.bfloat16()
                st["i32"] += (g * 7).int()
                st["i64"] += (g * 1e6).long()
                st["u8"] += 3
                st["mask"] ^= g > 0
                st["count"] += 1


def test_every_dtype_round_trips_in_its_own_buffer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = _Everything(model.parameters())
    for _ in range(2):
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
    sd = sc.sparse_state_dict(model, opt, state_layout="buffers")
    bufs = [v for k, v in sd.items() if k.startswith(BUFFERS_PREFIX) and isinstance(v, torch.Tensor)]
    assert sorted(str(b.dtype) for b in bufs) == sorted(
        f"torch.{d}" for d in ("float64", "float16", "bfloat16", "int32", "int64", "uint8", "bool")
    )
    assert all(b.ndim == 1 for b in bufs)
    loaded = []
    for sd_ in (sc.sparse_state_dict(model, opt), sd):
        model2 = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        model2.load_state_dict(model.state_dict())
        opt2 = _Everything(model2.parameters())
        sc.load_sparse_state_dict(model2, opt2, sd_)
        loaded.append(opt2)
    assert_optimizer_equal(loaded[1], loaded[0], grads=False)  # key order included
    assert [type(st["count"]) for st in loaded[1].state.values()] == [int] * 4


class _MixedPrecisionAdam(torch.optim.Optimizer):
    """Adam-like state of two dtypes, all parameter-shaped (as low-precision optimizers keep it), the
    low-precision one the first moment of some parameters and the second of others: one bucket per
    dtype, so for half of the parameters the buckets hold their keys in another order."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                st = self.state[p]
                if not st:
                    low = (torch.float32, torch.bfloat16)[i % 2]
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, dtype=low)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=(torch.bfloat16, torch.float32)[i % 2])
                st["step"] += 1
                st["exp_avg"].add_(p.grad.to(st["exp_avg"].dtype))
                st["exp_avg_sq"].add_((p.grad * p.grad).to(st["exp_avg_sq"].dtype))


@pytest.mark.parametrize("via", ["memory", "dcp"])
def test_state_of_two_dtypes_keeps_its_key_order(tmp_path: Path, via: str) -> None:
    """A parameter whose buffered state has two dtypes (two buckets) gets its state keys back in the
    saved order, not in bucket order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = _MixedPrecisionAdam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    model2 = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model2.load_state_dict(model.state_dict())
    opt2 = _MixedPrecisionAdam(model2.parameters())
    if via == "memory":
        sc.load_sparse_state_dict(model2, opt2, sc.sparse_state_dict(model, opt, state_layout="buffers"))
    else:
        dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path)
        dcp.load(
            {"optim": sc.SparseOptimizerState(model2, opt2)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner()
        )
    assert [list(st) for st in opt2.state.values()] == [["step", "exp_avg", "exp_avg_sq"]] * 4
    # (values: torch's load policy casts floating state to the parameter's dtype, as for any optimizer)
    for st, st2 in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(v.to(st2[k].dtype), st2[k]) for k, v in st.items())


def test_buckets_split_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small buckets: several buffers per dtype, none larger than the limit unless one chunk is."""
    model, src = _trained("AdamW")
    monkeypatch.setattr(buffers, "BUCKET_BYTES", 200)
    sd = sc.sparse_state_dict(model, src, state_layout="buffers")
    bufs = [v for k, v in sd.items() if k.startswith(BUFFERS_PREFIX) and isinstance(v, torch.Tensor)]
    largest = max(p.numel() * 4 for p in model.parameters())
    assert len(bufs) > 3 and all(b.numel() * 4 <= max(200, largest) for b in bufs)
    model2, dst = _fresh(model, "AdamW")
    sc.load_sparse_state_dict(model2, dst, sd)
    assert_optimizer_equal(dst, src, grads=False, state_order=False)


def _dcp_items(path: Path) -> list[str]:
    return list(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def test_dcp_items_per_leaf_and_dtype(tmp_path: Path) -> None:
    """An MoE's DCP checkpoint: per-tensor, one item per state tensor; buffers, one per leaf and
    dtype (one bucket each here) plus one layout table per leaf."""
    model = make_moe(0, n_experts=8)
    opt = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(model.expert_params(), lr=0.01),
            "dense": torch.optim.AdamW(model.dense_params(), lr=0.01),
        },
    )
    train(model, opt, 2, only_experts=[0, 3, 5])
    tensors = sum(
        isinstance(v, torch.Tensor) and v.ndim > 0
        for o in opt._optimizers.values()
        for st in o.state.values()
        for v in st.values()
    )
    counts = {}
    for layout in ("per_tensor", "buffers"):
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path / layout)
        counts[layout] = [k for k in _dcp_items(tmp_path / layout) if "load_with" not in k]
    tables = 2 * 2  # a group and a scalar table per leaf
    guards = 2 + 1  # foreign-loader guards: one per leaf, one for DSD's nested layout
    assert len(counts["per_tensor"]) == tensors + tables + guards
    assert len(counts["buffers"]) == 2 * (1 + 1) + tables + guards  # per leaf: a layout and one float32 buffer
    model2 = make_moe(1, n_experts=8)
    model2.load_state_dict(model.state_dict())
    opt2 = sc.MultiOptimizer(
        model2,
        {
            "experts": torch.optim.AdamW(model2.expert_params(), lr=0.5),
            "dense": torch.optim.AdamW(model2.dense_params(), lr=0.5),
        },
    )
    dcp.load({"optim": opt2}, checkpoint_id=tmp_path / "buffers", planner=sc.SparseLoadPlanner())
    for leaf in ("experts", "dense"):
        assert_optimizer_equal(opt2[leaf], opt[leaf], grads=False)


def test_dcp_load_reads_one_bucket_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffers of a DCP load are read one item at a time into a buffer that is dropped after
    its chunks are copied out: at most one is alive, and none is larger than a bucket (or than
    the largest single chunk)."""
    from sparse_ckpt._dcp import items as sc_dcp

    model, src = _trained("AdamW")
    monkeypatch.setattr(buffers, "BUCKET_BYTES", 300)
    dcp.save({"optim": sc.SparseOptimizerState(model, src, state_layout="buffers")}, checkpoint_id=tmp_path)
    alive: list[int] = []
    peak = [0, 0]  # buffers alive at once, largest bytes
    original = sc_dcp.ItemPlanner.resolve_tensor

    def tracked(self: Any, read_item: Any) -> torch.Tensor:
        t = original(self, read_item)
        alive.append(t.data_ptr())  # DCP copies into a detached view of it: same storage
        peak[0] = max(peak[0], len(alive))
        peak[1] = max(peak[1], t.numel() * t.element_size())
        return t

    def committed(self: Any, read_item: Any, tensor: torch.Tensor) -> None:
        self._consume(read_item.dest_index.fqn, tensor)
        alive.remove(tensor.data_ptr())

    largest = max(p.numel() * 4 for p in model.parameters())
    n_buckets = len([k for k in dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata if ".B" in k])
    # Straight from the files (a FileSystemReader): each bucket is loaded into its own tensor and
    # handed over before the next one is read.
    sizes: list[int] = []
    handed = sc_dcp.ItemPlanner.commit_tensor

    def counted(self: Any, read_item: Any, tensor: torch.Tensor) -> None:
        sizes.append(tensor.numel() * tensor.element_size())
        handed(self, read_item, tensor)

    monkeypatch.setattr(sc_dcp.ItemPlanner, "commit_tensor", counted)
    model2, dst = _fresh(model, "AdamW")
    dcp.load({"optim": sc.SparseOptimizerState(model2, dst)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    assert len(sizes) == n_buckets > 1 and 0 < max(sizes) <= max(300, largest)
    assert_optimizer_equal(dst, src, grads=False)

    # Through the storage reader's read_data (any other reader).
    monkeypatch.setattr(sc_dcp, "file_item_location", lambda reader, info: None)
    monkeypatch.setattr(sc_dcp.ItemPlanner, "resolve_tensor", tracked)
    monkeypatch.setattr(sc_dcp.ItemPlanner, "commit_tensor", committed)
    model2, dst = _fresh(model, "AdamW")
    dcp.load({"optim": sc.SparseOptimizerState(model2, dst)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    assert peak[0] == 1 and 0 < peak[1] <= max(300, largest)
    assert_optimizer_equal(dst, src, grads=False)


# --------------------------------------------------------------------------- refusals


def _buffered() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, src = _trained("AdamW")
    return model, src, sc.sparse_state_dict(model, src, state_layout="buffers")


def _refused(model: nn.Module, sd: dict[str, Any], error: type[Exception], match: str, strict: bool = True) -> None:
    model2, dst = _fresh(model, "AdamW")
    _steps(model2, dst, 1, seed=3)  # a target with state: a failed load must leave it as it was
    before = snapshot_optimizer(dst)
    with pytest.raises(error, match=match):
        sc.load_sparse_state_dict(model2, dst, sd, strict=strict)
    assert_optimizer_equal(dst, before)


def _one(sd: dict[str, Any], kind: str) -> str:
    return next(k for k, v in sd.items() if k.startswith(BUFFERS_PREFIX) and (kind == "L") == isinstance(v, bytes))


@pytest.mark.parametrize("strict", [True, False])
def test_missing_buffer_is_refused(strict: bool) -> None:
    model, _src, sd = _buffered()
    key = _one(sd, "B")
    del sd[key]
    _refused(
        model,
        sd,
        sc.CheckpointMismatchError,
        rf"leaf 'optim': buffer item '{key}', which holds state 'exp_avg' "
        r"of '.*' \(and maybe more\), is missing from the checkpoint",
        strict,
    )


@pytest.mark.parametrize("strict", [True, False])
def test_missing_layout_is_refused(strict: bool) -> None:
    """Without its layout table the buffered state is missing: the recorded state keys refuse it."""
    model, _src, sd = _buffered()
    del sd[_one(sd, "L")]
    _refused(
        model, sd, sc.CheckpointMismatchError, r"leaf 'optim': parameter '.*' has no saved state 'exp_avg'", strict
    )


@pytest.mark.parametrize("damage", ["truncated", "longer", "dtype", "2-d", "not a tensor"])
def test_buffer_that_disagrees_with_its_layout_is_refused(damage: str) -> None:
    model, _src, sd = _buffered()
    key = _one(sd, "B")
    buf = sd[key]
    sd[key] = {
        "truncated": buf[:-1],
        "longer": torch.cat([buf, buf[:1]]),
        "dtype": buf.double(),
        "2-d": buf.reshape(1, -1),
        "not a tensor": buf.tolist(),
    }[damage]
    _refused(model, sd, sc.CheckpointFormatError, rf"leaf 'optim': buffer item '{key}' is a ")


def test_tampered_layout_is_refused() -> None:
    model, _src, sd = _buffered()
    key = _one(sd, "L")
    sd[key] = sd[key][:-1] + bytes([sd[key][-1] ^ 1])
    _refused(model, sd, sc.CheckpointFormatError, r"layout table .* does not match its sealed digest")


def test_layout_of_another_shape_is_refused() -> None:
    """A layout whose global shape is not the parameter's: refused before anything is copied."""
    from sparse_ckpt import _backend
    from sparse_ckpt._format.keys import seal

    model, _src, sd = _buffered()
    key = _one(sd, "L")
    fqn = next(n for n, p in model.named_parameters() if p.ndim == 2)
    entries = [(fqn, "exp_avg", "float32", 4, (99, 99), (0, 0), (1, 1))]
    table, _buckets = _backend.core.encode_layout("optim", entries, 1 << 20)
    sd[key] = seal(table)
    _refused(
        model, sd, sc.CheckpointMismatchError, rf"state 'exp_avg' of '{fqn}' has shape \(99, 99\) in the checkpoint"
    )


def test_flat_format_has_no_buffers() -> None:
    model, src = _trained("AdamW")
    with pytest.raises(ValueError, match="state_layout='buffers' needs format='packed'"):
        sc.sparse_state_dict(model, src, format="flat", state_layout="buffers")
    with pytest.raises(ValueError, match="state_layout must be one of"):
        sc.SparseOptimizerState(model, src, state_layout="rows")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="state_layout must be one of"):
        sc.MultiOptimizer(model, {"o": src}, state_layout="rows")  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = sc.SparseOptimizerState(model, src, format="flat")
        assert flat.state_layout == "auto"  # the default; in the flat format: one item per value
        assert not [k for k in flat.state_dict() if "__buffers__" in k]


# --------------------------------------------------------------------------- checkpoint tools


def test_tools_understand_buffers(tmp_path: Path) -> None:
    """inspect and diff see buffered state as they see per-item state; verify reads and checks the
    buffers against their layouts; convert writes per-item state; export writes what it writes
    for the per-tensor checkpoint, byte for byte."""
    from sparse_ckpt.tools import inspect_checkpoint, verify_checkpoint

    model, src = _trained("AdamW")
    for layout in ("per_tensor", "buffers"):
        dcp.save({"optim": sc.SparseOptimizerState(model, src, state_layout=layout)}, checkpoint_id=tmp_path / layout)
    reports = {layout: inspect_checkpoint(tmp_path / layout)["optimizers"][0] for layout in ("per_tensor", "buffers")}
    for r in reports.values():
        for field in ("items", "table_bytes", "disk_bytes"):
            r.pop(field)
    assert reports["buffers"] == reports["per_tensor"]
    assert reports["buffers"]["leaves"][0]["state_keys"]["exp_avg"]["count"] == len(src.state)
    assert tools.diff_checkpoints(tmp_path / "per_tensor", tmp_path / "buffers")["differences"] == 0
    assert verify_checkpoint(tmp_path / "buffers")["ok"]

    tools.convert_checkpoint(str(tmp_path / "buffers"), str(tmp_path / "converted"), "packed")
    keys = _dcp_items(tmp_path / "converted")
    assert not [k for k in keys if BUFFERS_PREFIX in k] and "optim.state.embed.weight.exp_avg" in keys
    model2, dst = _fresh(model, "AdamW")
    dcp.load(
        {"optim": sc.SparseOptimizerState(model2, dst)},
        checkpoint_id=tmp_path / "converted",
        planner=sc.SparseLoadPlanner(),
    )
    assert_optimizer_equal(dst, src, grads=False, state_order=False)
    for layout in ("per_tensor", "buffers"):
        export.export_checkpoint(tmp_path / layout, tmp_path / f"export_{layout}")
    assert (tmp_path / "export_buffers" / export.TENSORS_FILE).read_bytes() == (
        tmp_path / "export_per_tensor" / export.TENSORS_FILE
    ).read_bytes()


@pytest.mark.parametrize("layout", ["per_tensor", "buffers"])
def test_verify_reports_an_incomplete_checkpoint(tmp_path: Path, layout: str) -> None:
    from legacy_checkpoints import drop_from_metadata

    from sparse_ckpt.tools import verify_checkpoint

    model, src = _trained("AdamW")
    dcp.save({"optim": sc.SparseOptimizerState(model, src, state_layout=layout)}, checkpoint_id=tmp_path)
    keys = _dcp_items(tmp_path)
    lost = (
        "optim.state.embed.weight.exp_avg_sq"
        if layout == "per_tensor"
        else next(k for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}") and ".B" in k)
    )
    drop_from_metadata(tmp_path, lost)
    report = verify_checkpoint(tmp_path)
    assert not report["ok"]
    assert ("has no saved state 'exp_avg_sq'" if layout == "per_tensor" else "is missing") in report["problems"][0][
        "problem"
    ]


def test_planner_reads_layout_tables_weights_only_as_bytes(tmp_path: Path) -> None:
    """A layout item that is no ``bytes`` is refused while DCP reads it (``weights_only``)."""
    from torch.distributed.checkpoint import CheckpointException

    model, _src, sd = _buffered()
    key = _one(sd, "L")
    dcp.save({"optim": {**sd, key: [1, 2]}}, checkpoint_id=str(tmp_path), no_dist=True)
    model2, dst = _fresh(model, "AdamW")
    with pytest.raises(
        CheckpointException, match=r"layout table 'optim\.state\.__buffers__\.optim\.Lw1r0' holds a list"
    ):
        dcp.load(
            {"optim": sc.SparseOptimizerState(model2, dst)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner()
        )
    assert not dst.state


def test_dcp_load_views_each_bucket_without_a_copy(tmp_path: Path) -> None:
    """A whole saved chunk of a CPU parameter comes back as a view of its bucket: the loaded state
    tensors of a leaf share one storage per bucket, hold exactly the saved values, and each is
    contiguous with its parameter's shape (runs of one shape are unbound from one span, other
    shapes in between included)."""
    model, src = _trained("AdamW")
    shapes = {tuple(st["exp_avg"].shape) for st in src.state.values()}
    assert len(shapes) > 2  # several shapes, so the bucket holds several runs
    dcp.save({"optim": sc.SparseOptimizerState(model, src, state_layout="buffers")}, checkpoint_id=tmp_path)
    n_buckets = len([k for k in dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata if ".B" in k])
    model2, dst = _fresh(model, "AdamW")
    dcp.load({"optim": sc.SparseOptimizerState(model2, dst)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    assert_optimizer_equal(dst, src, grads=False)
    loaded = [v for st in dst.state.values() for k, v in st.items() if k != "step"]
    assert len({t.untyped_storage().data_ptr() for t in loaded}) == n_buckets == 1
    for p, st in dst.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].shape == p.shape and st[key].is_contiguous()
    # views of one storage, laid end to end without overlap: the bucket holds each chunk once
    spans = sorted((t.storage_offset(), t.numel()) for t in loaded)
    assert all(a + n <= b for (a, n), (b, _m) in zip(spans, spans[1:]))
