"""The speculative bucket fill of ``dcp.async_save`` captures (`sparse_ckpt._save.fill_plan`).

A capture starts copying the previous capture's buckets at once and uses the copy only where its own
layout and state tensors turn out the same. These tests check that the copy is used when nothing but
the values changed, that every change a trainer (or a careless user) can make between two saves
makes the capture fill anew, and that either way the checkpoint restores the state as of the call.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, dcp_loaded_adamw, snapshot_optimizer
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._save import fill_plan
from sparse_ckpt._save import worker as worker_module
from sparse_ckpt._save.fill_plan import FillPlans

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _Net(nn.Module):
    """Square and flat parameters (all bucketed by ``auto``) and one that gets no gradient at first."""

    def __init__(self) -> None:
        super().__init__()
        self.square = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
        self.late = nn.Linear(8, 4)


def _step(model: _Net, opt: torch.optim.Optimizer, *, late: bool = False) -> None:
    for name, p in model.named_parameters():
        p.grad = torch.randn_like(p) if late or not name.startswith("late.") else None
    opt.step()


def _trained(seed: int = 0) -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    return model, opt


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many copies each capture started."""
    seen: list[int] = []
    real = FillPlans.start

    def spy(self: FillPlans, *args: Any) -> None:
        real(self, *args)
        seen.append(len(self._copies))

    monkeypatch.setattr(FillPlans, "start", spy)
    return seen


def _save(path: Path, state: sc.SparseOptimizerState) -> None:
    dcp.async_save({"optim": state}, checkpoint_id=path).result()


def _saves_restore_exactly(
    tmp_path: Path, model: nn.Module, opt: torch.optim.Optimizer, state: sc.SparseOptimizerState, step: Callable
) -> None:
    """Save ``state`` three times (``a``, ``b``, ``c``), ``step(model, opt)`` after each: each checkpoint
    restores the state as of its call."""
    for name in ("a", "b", "c"):
        at_save = snapshot_optimizer(opt)
        _save(tmp_path / name, state)
        assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / name, model), grads=False)
        step(model, opt)


@pytest.mark.parametrize("layout", ["auto", "buffers"])
def test_a_second_save_uses_the_copy_and_restores_exactly(tmp_path: Path, takes: list[bool], layout: str) -> None:
    """Only the values changed between saves: the second and third captures use the copy they started,
    and each checkpoint restores the state as of its call."""
    model, opt = _trained()
    _saves_restore_exactly(tmp_path, model, opt, sc.SparseOptimizerState(model, opt, state_layout=layout), _step)
    assert takes == [False, True, True]


def _replace_a_tensor(model: _Net, opt: torch.optim.Optimizer) -> None:
    st = opt.state[model.square[1].weight]
    model.kept = st["exp_avg"]  # (alive at its address: the capture starts its copy, then finds another object)
    st["exp_avg"] = st["exp_avg"] + 1  # another object, the same layout


def _swap_data(model: _Net, opt: torch.optim.Optimizer) -> None:
    v = opt.state[model.square[2].weight]["exp_avg_sq"]
    v.data = v.data + 1  # the same object over another storage


def _transpose_in_place(model: _Net, opt: torch.optim.Optimizer) -> None:
    opt.state[model.square[3].weight]["exp_avg"].t_()  # the same object and address, not contiguous


def _rename_a_key(model: _Net, opt: torch.optim.Optimizer) -> None:
    st = opt.state[model.square[1].bias]
    st["renamed"] = st.pop("exp_avg_sq")  # the same objects in the same order, another layout entry


def _new_state(model: _Net, opt: torch.optim.Optimizer) -> None:
    _step(model, opt, late=True)  # state for parameters that had none: another layout


def _drop_state(model: _Net, opt: torch.optim.Optimizer) -> None:
    del opt.state[model.square[4].weight]


CHANGES: dict[str, Callable[[_Net, torch.optim.Optimizer], None]] = {
    "replaced": _replace_a_tensor,
    "data_swapped": _swap_data,
    "transposed": _transpose_in_place,
    "new_state": _new_state,
    "renamed_key": _rename_a_key,
    "dropped_state": _drop_state,
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_state_is_filled_anew(tmp_path: Path, takes: list[bool], starts: list[int], change: str) -> None:
    """Each change between two saves makes the second capture drop its copy (or start none) and fill
    the buckets anew; the checkpoint restores the changed state exactly, and the save after it (nothing
    changed but the values) uses its copy again. (A state tensor's dtype changed in place changes the
    layout entries likewise; a load casts it to the parameter's, so it is not compared here.)"""
    model, opt = _trained()
    state = sc.SparseOptimizerState(model, opt)
    _save(tmp_path / "a", state)
    CHANGES[change](model, opt)
    for name in ("b", "c"):
        at_save = snapshot_optimizer(opt)
        _save(tmp_path / name, state)
        assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / name, model), grads=False)
        for st in opt.state.values():
            st["exp_avg"].add_(1)
    # the second capture fills anew; the third uses its copy, but where a tensor is not contiguous
    # (then no capture plans a copy)
    assert takes == [False, False, change != "transposed"]
    # a tensor freed drops the plan (no copy started); one over another storage is copied from the old
    # storage, which the plan holds, and the copy is not used
    assert starts[1] == (0 if change == "dropped_state" else 1)
    assert not state.fill_plans._copies


def test_a_failed_capture_drops_its_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, takes: list[bool]) -> None:
    """A capture that fails after its copy started leaves no copy behind; the next save works."""
    model, opt = _trained()
    state = sc.SparseOptimizerState(model, opt)
    _save(tmp_path / "a", state)
    with monkeypatch.context() as m:
        m.setattr(fill_plan.FillPlans, "take", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            _save(tmp_path / "b", state)
    assert not state.fill_plans._copies
    at_save = snapshot_optimizer(opt)
    _save(tmp_path / "c", state)
    assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / "c", model), grads=False)


def test_a_plan_keeps_no_state_alive(tmp_path: Path, takes: list[bool]) -> None:
    """The plan refers to the state tensors weakly: state the optimizer dropped is freed, and the next
    capture starts no copy of it."""
    model, opt = _trained()
    state = sc.SparseOptimizerState(model, opt)
    _save(tmp_path / "a", state)
    old = weakref.ref(opt.state[model.square[0].weight]["exp_avg"])
    opt.state.clear()
    gc.collect()
    assert old() is None
    assert not state.fill_plans._plans  # (dropped with the storages it held when the tensor was freed)
    _step(model, opt)
    at_save = snapshot_optimizer(opt)
    _save(tmp_path / "b", state)
    assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / "b", model), grads=False)
    assert takes == [False, False]


def test_a_swapped_storage_is_held_until_the_next_capture(tmp_path: Path, takes: list[bool]) -> None:
    """A state tensor given another storage between saves: the plan holds the old one (the copy started
    from its recorded address reads memory still allocated) until the next capture drops the plan; that
    capture fills anew and restores the new values."""
    model, opt = _trained()
    state = sc.SparseOptimizerState(model, opt)
    _save(tmp_path / "a", state)
    v = opt.state[model.square[2].weight]["exp_avg_sq"]
    held = {s.data_ptr() for s in state.fill_plans._plans["optim"].storages}
    assert v.data_ptr() in held
    v.data = v.data + 1
    assert v.data_ptr() not in held
    at_save = snapshot_optimizer(opt)
    _save(tmp_path / "b", state)
    assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / "b", model), grads=False)
    assert takes == [False, False]
    assert v.data_ptr() in {s.data_ptr() for s in state.fill_plans._plans["optim"].storages}


class _Hooked(torch.optim.AdamW):
    pass


@pytest.mark.parametrize("code", ["pre_hook", "post_hook", "adapter"])
def test_no_copy_beside_code_of_the_users(tmp_path: Path, takes: list[bool], starts: list[int], code: str) -> None:
    """Where the capture calls code of the user's (a ``state_dict`` hook, a registered adapter), which
    could change the state while a copy reads it (the hooks here double a moment in place: the same
    objects at the same addresses), no copy is started, and each checkpoint holds the state as the
    hooks left it."""
    torch.manual_seed(0)
    model = _Net()
    opt = _Hooked(model.parameters(), lr=0.01)
    _step(model, opt)
    state = sc.SparseOptimizerState(model, opt)
    _save(tmp_path / "a", state)  # (plans the next capture's copy)
    calls: list[str] = []

    def double(optimizer: Any, *_: Any) -> None:
        calls.append(code)
        for st in optimizer.state.values():
            st["exp_avg"].mul_(2)

    handle: Any
    if code == "pre_hook":
        handle = opt.register_state_dict_pre_hook(double)
    elif code == "post_hook":
        handle = opt.register_state_dict_post_hook(double)
    else:
        handle = sc.register_state_dict_adapter(
            _Hooked, lambda o: (calls.append(code), torch.optim.Optimizer.state_dict(o))[1]
        )
    try:
        for name in ("b", "c"):
            _save(tmp_path / name, state)
            assert_optimizer_equal(snapshot_optimizer(opt), dcp_loaded_adamw(tmp_path / name, model), grads=False)
    finally:
        handle.remove()
    assert calls == [code, code]
    assert starts[1:] == [0, 0]
    assert takes == [False, False, False]


class _WithLarge(nn.Module):
    """Small parameters (bucketed) beside one whose state tensors are items of their own inside
    ``dcp.async_save`` (copied into the pool: the staged copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.large = nn.Linear(512, 512, bias=False)


def test_a_capture_waiting_for_its_copy_makes_the_staged_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, takes: list[bool]
) -> None:
    """Where the bucket copy is not finished when the layout is known, the capture makes the large
    tensors' staged copies itself meanwhile (`CaptureWorker.help`); every checkpoint restores exactly."""
    from sparse_ckpt._save.worker import CaptureWorker

    monkeypatch.setattr(FillPlans, "busy", lambda self, leaf: leaf in self._copies)  # (as if never finished)
    helped: list[int] = []
    real_help = CaptureWorker.help
    monkeypatch.setattr(CaptureWorker, "help", lambda self: (helped.append(len(self._copies)), real_help(self))[1])
    torch.manual_seed(0)
    model = _WithLarge()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = sc.SparseOptimizerState(model, opt)
    for name in ("a", "b", "c"):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        at_save = snapshot_optimizer(opt)
        _save(tmp_path / name, state)
        assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / name, model), grads=False)
    assert takes == [False, True, True]
    # the large weight's two moments, staged before the help (a torch whose stager does not deep-copy
    # stages nothing: `sparse_ckpt._save.worker.STAGER_DEEP_COPIES`)
    assert helped == ([2, 2] if worker_module.STAGER_DEEP_COPIES else [0, 0])


def test_a_hook_of_another_leaf_stops_every_copy(tmp_path: Path, takes: list[bool], starts: list[int]) -> None:
    """A `MultiOptimizer` whose first leaf has a ``state_dict`` pre-hook that changes the second leaf's
    state in place (before the second leaf is captured): no copy is started for either leaf, and the
    checkpoint holds the second leaf's state as the hook left it."""
    torch.manual_seed(0)
    model = _Net()

    def leaves(lr: float) -> dict[str, torch.optim.Optimizer]:
        return {
            "a": torch.optim.AdamW(model.square.parameters(), lr=lr),
            "b": torch.optim.AdamW(model.late.parameters(), lr=lr),
        }

    optimizers = leaves(0.01)
    multi = sc.MultiOptimizer(model, optimizers)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for opt in optimizers.values():
        opt.step()
    dcp.async_save({"optim": multi}, checkpoint_id=tmp_path / "a").result()
    second = optimizers["b"]
    optimizers["a"].register_state_dict_pre_hook(lambda _o: [st["exp_avg"].mul_(2) for st in second.state.values()])
    dcp.async_save({"optim": multi}, checkpoint_id=tmp_path / "b").result()
    expected = snapshot_optimizer(second)
    target = leaves(0.5)
    dcp.load({"optim": sc.MultiOptimizer(model, target)}, checkpoint_id=tmp_path / "b", planner=sc.SparseLoadPlanner())
    assert_optimizer_equal(expected, target["b"], grads=False)
    assert starts == [0, 0] and not any(takes)


# --------------------------------------------------------------------------- planned staged copies

STAGES = worker_module.STAGER_DEEP_COPIES
"""Whether this torch's ``dcp.async_save`` gets staged copies at all (`sparse_ckpt._save.worker`)."""


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Per capture, how many large tensors it staged from the copy it started (`FillPlans.staged_copy`)."""
    seen: list[int] = []
    real_start, real_copy = FillPlans.start, FillPlans.staged_copy

    def start(self: FillPlans, *args: Any) -> None:
        seen.append(0)
        real_start(self, *args)

    def staged_copy(self: FillPlans, leaf: str, t: torch.Tensor) -> Any:
        out = real_copy(self, leaf, t)
        seen[-1] += out is not None
        return out

    monkeypatch.setattr(FillPlans, "start", start)
    monkeypatch.setattr(FillPlans, "staged_copy", staged_copy)
    return seen


def _large_trained() -> tuple[_WithLarge, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _WithLarge()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step_all(model, opt)
    return model, opt


def _step_all(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


def test_large_tensors_are_copied_from_the_start(tmp_path: Path, takes: list[bool], planned: list[int]) -> None:
    """The large tensors' staged copies are planned like the buckets: the second and third captures copy
    both moments of the large weight from the start (with the buckets, in one call) and use those copies;
    each checkpoint restores the state as of its call."""
    model, opt = _large_trained()
    _saves_restore_exactly(tmp_path, model, opt, sc.SparseOptimizerState(model, opt), _step_all)
    assert takes == [False, True, True]
    assert planned == ([0, 2, 2] if STAGES else [0, 0, 0])


def _replace_large(model: _WithLarge, opt: torch.optim.Optimizer) -> None:
    st = opt.state[model.large.weight]
    model.kept = st["exp_avg"]  # (alive at its address: its copy starts, then the capture finds another object)
    st["exp_avg"] = st["exp_avg"] + 1


def _swap_large_data(model: _WithLarge, opt: torch.optim.Optimizer) -> None:
    v = opt.state[model.large.weight]["exp_avg"]
    v.data = v.data + 1  # the same object over another storage: another address


def _resize_large(model: _WithLarge, opt: torch.optim.Optimizer) -> None:
    opt.state[model.large.weight]["exp_avg"].resize_(256, 512)  # the same object and address, another shape


def _drop_large_state(model: _WithLarge, opt: torch.optim.Optimizer) -> None:
    del opt.state[model.large.weight]


LARGE_CHANGES: dict[str, tuple[Callable[[_WithLarge, torch.optim.Optimizer], None], int, int]] = {
    "replaced": (_replace_large, 1, 2),
    "data_swapped": (_swap_large_data, 1, 2),
    "resized": (_resize_large, 1, 1),  # (then a part of its storage: not staged, `HostPool.takes`)
    "dropped_state": (_drop_large_state, 0, 0),
}
"""Each change to the large weight's state between two saves, and how many of its two moments the next
capture and the one after it take from the copy they started (the others are copied as usual)."""


@pytest.mark.skipif(not STAGES, reason="this torch's dcp.async_save stages no copies (STAGER_DEEP_COPIES)")
@pytest.mark.parametrize("change", sorted(LARGE_CHANGES))
def test_a_changed_large_tensor_is_copied_anew(tmp_path: Path, planned: list[int], change: str) -> None:
    """A large state tensor replaced, set to another storage or resized in place is not taken from the
    copy the capture started (it is copied as usual), its freed state drops its plan; the checkpoint
    holds the changed state (restores it exactly; a resized moment: the item has its new shape), and the
    next save takes the copies of what it staged the time before."""
    model, opt = _large_trained()
    state = sc.SparseOptimizerState(model, opt)
    _save(tmp_path / "a", state)
    change_state, taken_next, taken_after = LARGE_CHANGES[change]
    change_state(model, opt)
    at_save = snapshot_optimizer(opt)
    _save(tmp_path / "b", state)
    if change == "resized":  # (a load refuses a moment shaped unlike its parameter: the item's shape is checked)
        saved = dcp.FileSystemReader(tmp_path / "b").read_metadata().state_dict_metadata
        assert saved["optim.state.large.weight.exp_avg"].size == torch.Size([256, 512])
    else:
        assert_optimizer_equal(at_save, dcp_loaded_adamw(tmp_path / "b", model), grads=False)
    _save(tmp_path / "c", state)
    assert planned == [0, taken_next, taken_after]


@pytest.mark.skipif(not STAGES, reason="this torch's dcp.async_save stages no copies (STAGER_DEEP_COPIES)")
def test_a_staged_plan_keeps_no_state_alive(tmp_path: Path) -> None:
    """The plan of the staged copies refers to the large tensors weakly: state the optimizer dropped is
    freed with the storage the plan held."""
    model, opt = _large_trained()
    state = sc.SparseOptimizerState(model, opt)
    _save(tmp_path / "a", state)
    assert [len(p.entries) for p in state.fill_plans._staged.values()] == [2]
    old = weakref.ref(opt.state[model.large.weight]["exp_avg"])
    storage = weakref.ref(old().untyped_storage())  # type: ignore[union-attr]
    opt.state.clear()
    gc.collect()
    assert old() is None and not state.fill_plans._staged
    assert storage() is None or storage().nbytes() == 0  # type: ignore[union-attr]


def test_the_capture_copies_the_pieces_the_worker_has_not_claimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, takes: list[bool], planned: list[int]
) -> None:
    """A copy is shared out in pieces of at most `fill_plan.PIECE_BYTES` (here 1000 bytes: chunks of 256
    split over two pieces, two pieces for the bucket, 1 049 per large tensor): where the worker has not
    begun when the layout is known, the capture copies every piece itself (`FillPlans.help`, from the last
    back) and the worker's call finds none left; the bucket CRC-32C combined from the pieces' is the
    bucket's (a load checks it), and every checkpoint restores exactly."""
    monkeypatch.setattr(fill_plan, "PIECE_BYTES", 1000)
    real = fill_plan._backend.core.gather_many
    helped = threading.Event()
    worker_ran: list[list[int | None]] = []

    def gather_many(jobs: list, claims: bytearray | None = None, from_end: bool = False) -> list[int | None]:
        if not from_end:  # the worker's call: only once the capture has copied
            helped.wait(timeout=60)
            worker_ran.append(real(jobs, claims, from_end))
            return worker_ran[-1]
        out = real(jobs, claims, from_end)
        helped.set()
        return out

    monkeypatch.setattr(fill_plan, "_backend", SimpleNamespace(core=SimpleNamespace(gather_many=gather_many)))
    model, opt = _large_trained()
    state = sc.SparseOptimizerState(model, opt)
    _saves_restore_exactly(tmp_path, model, opt, state, lambda m, o: (helped.clear(), _step_all(m, o)))
    assert takes == [False, True, True]
    assert planned == ([0, 2, 2] if STAGES else [0, 0, 0])
    pieces = state.fill_plans._plans["optim"].pieces
    assert len(pieces) == 1 and len(pieces[0]) > 1  # (one bucket, in several pieces)
    assert len(worker_ran) == 2 and all(r == [None] * len(r) for r in worker_ran)  # (the capture copied all)
    assert [n for _start, n, _a, _s in pieces[0]] == [1000, 728]
    assert len(worker_ran[0]) == 2 + (2 * -(-(512 * 512 * 4) // 1000) if STAGES else 0)
