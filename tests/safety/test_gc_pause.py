"""The GC pause around save/load nests, is thread-safe, and always restores the caller's setting
(interrupts at every line: tests/safety/test_interrupt_safety.py)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._gc import gc_paused, pauses_in_progress


@pytest.fixture
def gc_state():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_save_and_load_restore_setting(enabled: bool, gc_state) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    seen: list[bool] = []
    opt.register_state_dict_pre_hook(lambda o: seen.append(gc.isenabled()))
    (gc.enable if enabled else gc.disable)()
    sd = sc.sparse_state_dict(model, opt)
    sc.load_sparse_state_dict(model, opt, sd)
    assert seen == [False]
    assert gc.isenabled() is enabled


def test_setting_restored_after_error(gc_state) -> None:
    gc.enable()
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(sc.CheckpointMismatchError):
        sc.load_sparse_state_dict(model, opt, {})
    assert gc.isenabled()


def test_interleaved_threads_never_leave_gc_disabled(gc_state) -> None:
    """Thread A enters, B enters, A leaves, B leaves: the collector ends enabled."""
    gc.enable()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with gc_paused():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def second() -> None:
        a_in.wait(5)
        with gc_paused():
            b_in.set()
            a_out.wait(5)
            assert not gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert gc.isenabled()


def test_pause_never_exited_ends_when_freed(gc_state) -> None:
    """A signal at the entry of contextlib's ``__exit__`` (before any frame of ours) leaves the
    pause's generator suspended; freeing the context manager closes it, which ends the pause."""
    gc.enable()
    cm = gc_paused()
    cm.__enter__()
    assert not gc.isenabled() and pauses_in_progress() == 1
    del cm
    assert gc.isenabled() and pauses_in_progress() == 0


def test_inner_end_keeps_outer_pause(gc_state) -> None:
    """Every exit ends its pause twice (for interrupt safety); that never ends the outer pause."""
    gc.enable()
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled() and pauses_in_progress() == 1
    assert gc.isenabled() and pauses_in_progress() == 0


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_save_and_load_leave_no_cyclic_garbage(fmt: str, gc_state) -> None:
    """With the GC paused, a save or a load must not leave reference cycles behind (a frame kept
    in a local of its own stack made every save leave its whole call stack to the collector)."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sd = sc.sparse_state_dict(model, opt, format=fmt)
    target = torch.optim.AdamW(model.parameters(), lr=0.1)
    gc.collect()
    gc.disable()
    for _ in range(3):
        sc.sparse_state_dict(model, opt, format=fmt)
    assert gc.collect() == 0
    for _ in range(3):
        sc.load_sparse_state_dict(model, target, sd)
    assert gc.collect() == 0
