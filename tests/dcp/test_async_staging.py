"""``dcp.async_save`` of a `SparseOptimizerState`: what its stager copies before the call returns.

The buckets a capture for ``dcp.async_save`` fills are copies made for that save: the stager's deep
copy shares them instead of copying them a second time, and copies every other tensor (the live
state) once, so the checkpoint holds the values as of the call whatever the optimizer does next.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, dcp_loaded_adamw, snapshot_optimizer
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import sparse_ckpt as sc
from sparse_ckpt._dcp.stateful import SparseStateDict
from sparse_ckpt._format.keys import BUFFERS_PREFIX
from sparse_ckpt._host_memory import HUGE_PAGE_BYTES, HostPool
from sparse_ckpt._layouts import AUTO_ASYNC_OWN_ITEM_BYTES, STATE_LAYOUTS
from sparse_ckpt._save.worker import STAGER_DEEP_COPIES  # (torch 2.13: True; the floor's 2.7: False)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _Mixed(nn.Module):
    """Small parameters (bucketed by ``auto``) and one whose state tensors are items of their own
    inside ``dcp.async_save``, large enough to be staged into huge-page buffers (`host_snapshot`)."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        rows = -(-max(AUTO_ASYNC_OWN_ITEM_BYTES, 2 * HUGE_PAGE_BYTES) // (4 * 64))
        self.big = nn.Parameter(torch.zeros(rows, 64))


def _trained(seed: int) -> tuple[_Mixed, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Mixed()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


@pytest.mark.parametrize("layout", STATE_LAYOUTS)
def test_async_save_holds_the_values_of_the_call(tmp_path: Path, layout: str) -> None:
    """Every state tensor changed in place right after ``dcp.async_save`` returns: the checkpoint
    still holds the values as of the call, in every layout."""
    model, opt = _trained(seed=0)
    at_save = snapshot_optimizer(opt)
    future = dcp.async_save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path)
    for state in opt.state.values():
        for v in state.values():
            v.add_(1)
    future.result()
    assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path, model), grads=False)


@pytest.mark.parametrize("layout", ["auto", "buffers"])
def test_async_save_copies_the_buckets_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """The stager's copy shares the buckets the capture filled (each is the same tensor in the
    staged dict, and no tensor copy touches it) and copies every other tensor, so none of the staged
    tensors is a live state tensor; the checkpoint restores exactly."""
    captured: list[tuple[SparseStateDict, dict[str, Any]]] = []
    copied: list[torch.Tensor] = []
    deepcopy_dict, deepcopy_tensor = SparseStateDict.__deepcopy__, torch.Tensor.__deepcopy__

    def spy_dict(self: SparseStateDict, memo: dict[int, Any]) -> dict[str, Any]:
        out = deepcopy_dict(self, memo)
        captured.append((self, out))
        return out

    def spy_tensor(self: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        copied.append(self)
        return deepcopy_tensor(self, memo)

    monkeypatch.setattr(SparseStateDict, "__deepcopy__", spy_dict)
    monkeypatch.setattr(torch.Tensor, "__deepcopy__", spy_tensor)
    model, opt = _trained(seed=0)
    at_save = snapshot_optimizer(opt)
    dcp.async_save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path).result()
    if not captured:
        pytest.skip("this torch's dcp.async_save stages the state dict without deep-copying it")
    ((sd, staged),) = captured
    assert sd.snapshots, "the capture for dcp.async_save filled no bucket"
    own = {id(o) for o, c in sd.snapshots if o is c}  # the buckets: their own copies
    buckets = {k for k, v in sd.items() if k.startswith(BUFFERS_PREFIX) and id(v) in own}
    assert buckets and all(staged[k] is sd[k] for k in buckets)
    assert not any(t is o for t in copied for o, _c in sd.snapshots)
    live = {v.untyped_storage().data_ptr() for state in opt.state.values() for v in state.values() if v.numel()}
    assert not [k for k, v in staged.items() if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in live]
    assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path, model), grads=False)


def test_a_plain_deep_copy_shares_no_tensor() -> None:
    """Outside ``dcp.async_save`` (a dict from ``state_dict()`` called by the user) a deep copy
    copies every tensor, the buckets included."""
    model, opt = _trained(seed=0)
    sd = sc.SparseOptimizerState(model, opt, state_layout="buffers").state_dict()
    assert sd.snapshots is None
    out = copy.deepcopy(sd)
    tensors = [v for v in sd.values() if isinstance(v, torch.Tensor)]
    assert tensors and not any(out[k] is v for k, v in sd.items() if isinstance(v, torch.Tensor))


def _staged_save(path: Path, state: sc.SparseOptimizerState, **kwargs: Any) -> Any:
    return dcp.async_save({"optim": state}, checkpoint_id=path, **kwargs)


@pytest.mark.parametrize("layout", ["auto", "buffers", "per_tensor"])
def test_a_second_save_allocates_no_staging_buffer(tmp_path: Path, layout: str) -> None:
    """The host buffers a ``dcp.async_save`` capture copies into come back to the state's pool once
    DCP is done with them: the next save of the same `SparseOptimizerState` allocates none."""
    model, opt = _trained(seed=0)
    state = sc.SparseOptimizerState(model, opt, state_layout=layout)
    _staged_save(tmp_path / "a", state).result()
    first = state.host_pool.allocated
    if layout == "per_tensor" and not STAGER_DEEP_COPIES:
        assert first == 0  # no bucket, and the writer stages the state tensors in buffers of its own
    else:
        assert first > 0, "nothing was staged into the pool"
    for name in ("b", "c"):
        for v in opt.state[model.big].values():
            v.add_(1)
        at_save = snapshot_optimizer(opt)
        _staged_save(tmp_path / name, state).result()
        assert state.host_pool.allocated == first
        assert len(state.host_pool) == first
        assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / name, model), grads=False)


@pytest.mark.parametrize("layout", ["auto", "buffers"])
def test_two_saves_in_flight_hold_their_own_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """A pooled buffer DCP may still read is never handed out again: the second of two saves in
    flight (their writes held until both calls returned) stages into new buffers, and each
    checkpoint holds the values as of its call."""
    release = threading.Event()
    write_data = FileSystemWriter.write_data

    def held(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        assert release.wait(timeout=120)
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    model, opt = _trained(seed=0)
    state = sc.SparseOptimizerState(model, opt, state_layout=layout)
    expected, futures, allocated = [], [], []
    try:
        for i in range(2):
            expected.append(snapshot_optimizer(opt))
            futures.append(_staged_save(tmp_path / f"s{i}", state))
            allocated.append(state.host_pool.allocated)
            for st in opt.state.values():
                for v in st.values():
                    v.add_(1)
    finally:
        release.set()
    for i, future in enumerate(futures):
        future.result()
        assert_optimizer_equal(expected[i], dcp_loaded_adamw(tmp_path / f"s{i}", model), grads=False)
    # With the deep-copying stager DCP writes from the pooled buffers, so the second save needs its own;
    # older torch's writer copied them into its own before the first call returned, released them, and
    # the second save may reuse them.
    assert allocated[0] > 0 and allocated[1] == (2 if STAGER_DEEP_COPIES else 1) * allocated[0]


def test_the_pool_reuses_only_released_buffers() -> None:
    """`HostPool.take` hands out a buffer again only once everything handed out over it (views
    DCP derives from it included) is gone, and `HostPool.begin` drops the free buffers the previous
    capture did not use."""
    pool = HostPool()
    pool.begin()
    a = pool.take((4, 8), torch.float32)
    view = a.narrow(0, 1, 2)
    del a
    b = pool.take((32,), torch.float32)
    assert pool.allocated == 2 and b.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    del view
    c = pool.take((2, 16), torch.float32)
    assert pool.allocated == 2 and c.shape == (2, 16)
    del b, c
    pool.begin()
    pool.take((32,), torch.float32)
    pool.begin()
    assert len(pool) == 1
    assert len(copy.deepcopy(pool)) == 0


@pytest.mark.parametrize("save", ["save", "async_save"])
def test_buckets_filled_in_halves_load_and_pass_their_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save: str
) -> None:
    """With every bucket filled in two halves on two threads (``SPLIT_BYTES`` lowered to one byte), the
    checkpoint loads the values as of the call, its bucket CRCs (combined from the halves) checked."""
    from sparse_ckpt._layouts import bucketed

    monkeypatch.setattr(bucketed, "SPLIT_BYTES", 1)
    model, opt = _trained(seed=1)
    at_save = snapshot_optimizer(opt)
    state = sc.SparseOptimizerState(model, opt, state_layout="buffers")
    if save == "save":
        dcp.save({"optim": state}, checkpoint_id=tmp_path)
    else:
        future = dcp.async_save({"optim": state}, checkpoint_id=tmp_path)
        for st in opt.state.values():
            for v in st.values():
                v.add_(1)
        future.result()
    assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path, model), grads=False)
