"""Ctrl-C safety: an interrupt anywhere in a save or a load breaks nothing.

A ``KeyboardInterrupt`` at any point of ``sparse_state_dict`` / ``load_sparse_state_dict`` must
leave no reentrancy guard and no lock held, the cyclic GC exactly as it was before the call, and
a load all-or-nothing (the target optimizer unchanged, or fully loaded).

* Exhaustive: a ``sys.settrace`` tracer raises ``KeyboardInterrupt`` at the N-th line event of a
  frame inside the ``sparse_ckpt`` package, once, for every N of the run (a sweep is quadratic in the
  run's line count: by default a seeded sample, `SAMPLE_RATE` of the events, the first and last
  included; ``SPARSE_CKPT_EXHAUSTIVE_SWEEPS=1``, which .ci/run sets, runs every N) (the ``python`` core's
  frames included), for saves (packed and flat) and loads (packed, flat, a two-leaf
  MultiOptimizer), with and without ``state_dict`` / ``load_state_dict`` pre- and post-hooks, and
  with the collector enabled or disabled beforehand. After each run the interrupt must have
  reached the caller, and the same call on the same optimizer, from another thread with a join
  timeout (a held lock would hang it), must succeed and give the uninterrupted result.
* Real signals: a one-shot ``SIGALRM`` whose handler raises ``KeyboardInterrupt`` lands at a
  random bytecode boundary (signal handlers run after calls, at function entry, on backward
  jumps) of repeated saves and loads, frames of ``contextlib``, torch and the test included.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import torch
from _sampling import EXHAUSTIVE
from helpers import assert_deep_equal
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import _gc
from sparse_ckpt._leaves import named_leaves

PKG_DIR = os.path.dirname(os.path.abspath(sc.__file__)) + os.sep
JOIN_TIMEOUT = 10.0


class LineInjector:
    """A ``sys.settrace`` tracer over frames whose file is in the package.

    Counts their ``line`` events; raises ``KeyboardInterrupt`` at the ``at``-th one (1-based,
    ``0``: never). CPython drops a tracer that raised, so it fires at most once.
    """

    def __init__(self, at: int = 0) -> None:
        self.at = at
        self.count = 0
        self.where: str | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        """Global trace function: trace only the package's frames."""
        return self._local if frame.f_code.co_filename.startswith(PKG_DIR) else None

    def _local(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "line":
            self.count += 1
            if self.count == self.at:
                self.where = f"{frame.f_code.co_filename[len(PKG_DIR) :]}:{frame.f_lineno} ({frame.f_code.co_name})"
                raise KeyboardInterrupt
        return self._local


def run_traced(op: Callable[[], Any], at: int) -> tuple[LineInjector, bool]:
    """Run ``op`` under a :class:`LineInjector`; ``(injector, interrupted)``."""
    injector = LineInjector(at)
    previous = sys.gettrace()
    sys.settrace(injector)
    try:
        op()
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(previous)
    return injector, interrupted


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a fresh thread; fails (instead of hanging) if it does not finish in time."""
    box: list[tuple[bool, Any]] = []

    def runner() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            box.append((False, exc))

    thread = threading.Thread(target=runner, daemon=True)
    thread.start()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive(), "the follow-up call hung: a lock was left held"
    ok, value = box[0]
    if not ok:
        raise value
    return value


_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


_package_modules: tuple[int, list[tuple[str, Any]]] = (-1, [])
"""``(len(sys.modules), the package's modules)`` when last listed: :func:`package_locks` runs twice per
interrupt, and after the whole suite's imports ``sys.modules`` holds thousands of other modules."""


def _modules_of_the_package() -> list[tuple[str, Any]]:
    """The package's modules, listed again whenever ``sys.modules`` grew or shrank (an import)."""
    global _package_modules
    if _package_modules[0] != len(sys.modules):
        listed = [(n, m) for n, m in list(sys.modules.items()) if n == "sparse_ckpt" or n.startswith("sparse_ckpt.")]
        _package_modules = (len(sys.modules), listed)
    return _package_modules[1]


def package_locks() -> list[tuple[str, Any]]:
    """Every lock object held in a module global of the package (found, not listed by hand)."""
    return [
        (f"{name}.{attr}", obj)
        for name, module in _modules_of_the_package()
        for attr, obj in list(vars(module).items())
        if isinstance(obj, _LOCK_TYPES)
    ]


def free_leaked_locks() -> list[str]:
    """The package locks found held (by any thread); each is released, so the suite cannot hang."""
    leaked = []
    for name, lock in package_locks():
        owned = getattr(lock, "_is_owned", None)  # an RLock this thread holds is acquirable again
        if owned is not None and owned():
            lock._release_save()
            leaked.append(name)
        elif lock.acquire(blocking=False):
            lock.release()
        else:
            if owned is None:
                lock.release()
            leaked.append(name)
    return leaked


def assert_nothing_held(gc_was: bool, where: str) -> None:
    """No pause in progress, no package lock held (by any thread), and the collector as it was."""
    leaked = free_leaked_locks()
    assert not leaked, f"interrupt at {where}: {', '.join(leaked)} left held"
    assert gc.isenabled() is gc_was, f"interrupt at {where}: gc.isenabled() is {gc.isenabled()}, was {gc_was}"
    assert _gc.pauses_in_progress() == 0, f"interrupt at {where}: a GC pause was left in progress"


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Three parameters in two groups, stepped; ``0.bias`` got no grad, so it has no state."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1, bias=False))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.01}], lr=0.1)
    model(torch.randn(4, 3)).pow(2).sum().backward()
    model[0].bias.grad = None
    opt.step()
    return model, opt


def make_multi(seed: int) -> tuple[nn.Module, sc.MultiOptimizer]:
    """The same model split into two leaves (a load commits leaf ``a``, then leaf ``b``)."""
    model, _ = make(seed)
    a = torch.optim.AdamW(model[0].parameters(), lr=0.1)
    b = torch.optim.SGD(model[1].parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(4, 3)).pow(2).sum().backward()
    model[0].bias.grad = None
    a.step()
    b.step()
    return model, sc.MultiOptimizer(model, {"a": a, "b": b})


def add_hooks(optimizer: Any) -> list[str]:
    """A ``state_dict`` pre/post hook and a ``load_state_dict`` pre/post hook on every leaf."""
    calls: list[str] = []
    leaves = optimizer.leaves() if isinstance(optimizer, sc.MultiOptimizer) else [("optim", optimizer)]
    for _name, opt in leaves:
        opt.register_state_dict_pre_hook(lambda _o: calls.append("sd-pre"))
        opt.register_state_dict_post_hook(lambda _o, _sd: calls.append("sd-post"))
        opt.register_load_state_dict_pre_hook(lambda _o, _sd: calls.append("load-pre"))
        opt.register_load_state_dict_post_hook(lambda _o: calls.append("load-post"))
    return calls


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.tolist())
    if isinstance(value, dict):
        return ("dict", tuple((k, _plain(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    return value


def fingerprint(optimizer: Any) -> tuple[Any, ...]:
    """Each leaf's group settings, params (identity, order) and per-param state, as plain values.

    A cheap exact comparison (tensor dtype, shape and values, dict key order included).
    """
    out = []
    for name, opt in named_leaves(optimizer):
        groups = opt.param_groups
        params = [p for g in groups for p in g["params"]]
        out.append(
            (
                name,
                tuple(_plain({k: v for k, v in g.items() if k != "params"}) for g in groups),
                tuple(tuple(id(p) for p in g["params"]) for g in groups),
                tuple(_plain(opt.state[p]) if p in opt.state else None for p in params),
                len(opt.state),
            )
        )
    return tuple(out)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap() -> Iterator[None]:
    """The objects alive before this module's tests (every earlier test's imports: half a million in a
    full run) moved out of the collector's sight (``gc.freeze``) while the sweeps run, and back after.

    A sweep makes thousands of calls; each full collection would otherwise walk that whole heap,
    which made this module five times slower in the full suite than alone. Whether the collector
    is enabled, which the tests check, is not touched.
    """
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def gc_setting() -> Iterator[None]:
    """Restore the collector's setting after the test."""
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


SAMPLE_RATE = 0.125
"""The share of a run's line events a sweep interrupts by default (seeded: the same events every run)."""


def sweep_events(total: int, seed: str) -> list[int]:
    """The events (1-based) a sweep over ``total`` interrupts: all of them when `EXHAUSTIVE`, else the
    first, the last and a `SAMPLE_RATE` sample of the rest drawn from ``random.Random(seed)``."""
    if EXHAUSTIVE or total <= 2:
        return list(range(1, total + 1))
    inner = random.Random(seed).sample(range(2, total), max(1, round((total - 2) * SAMPLE_RATE)))
    return [1, *sorted(inner), total]


def sweep(op: Callable[[], Any], check: Callable[[str, int], None], prepare: Callable[[], Any] = lambda: None) -> int:
    """Run ``op`` once per line event it has (or a sample: `sweep_events`), interrupted at that event;
    ``check(where, at)`` after each.

    ``prepare()`` runs (untraced) before every run. Counting and interrupted runs start at the
    same stack depth: the reentrancy check walks the stack, so its event count depends on it.
    """
    prepare()
    op()  # warm up (first-call caches), so every later run takes the same path
    prepare()
    injector, interrupted = run_traced(op, 0)
    total = injector.count
    assert not interrupted and total > 20, total
    for at in sweep_events(total, os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]):
        prepare()
        injector, interrupted = run_traced(op, at)
        where = injector.where
        assert where is not None, f"event {at} of {total} never came: the call does not take one path"
        assert interrupted, f"the interrupt at {where} was swallowed"
        check(where, at)
    return total


def follow_up(fn: Callable[[], Any], at: int) -> Any:
    """The call after an interrupted one: here (every lock was just seen free, so it cannot hang),
    and in a fresh thread with a join timeout for every 32nd event."""
    return in_thread(fn) if at % 32 == 0 else fn()


@pytest.mark.parametrize("gc_on", [True, False], ids=["gc-on", "gc-off"])
@pytest.mark.parametrize("hooks", [False, True], ids=["no-hooks", "hooks"])
@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_save_interrupted_at_every_line(fmt: str, hooks: bool, gc_on: bool, gc_setting: None) -> None:
    """An interrupted save changes nothing; the next save of the same optimizer is exact."""
    model, opt = make(0)
    if hooks:
        add_hooks(opt)
    reference = sc.sparse_state_dict(model, opt, format=fmt)
    before = fingerprint(opt)
    (gc.enable if gc_on else gc.disable)()

    def save() -> dict[str, Any]:
        return sc.sparse_state_dict(model, opt, format=fmt)

    def check(where: str, at: int) -> None:
        assert_nothing_held(gc_on, where)
        assert fingerprint(opt) == before, f"an interrupted save at {where} changed the optimizer"
        assert_deep_equal(follow_up(save, at), reference, f"save after an interrupt at {where}")
        assert_nothing_held(gc_on, where)

    sweep(save, check)


@pytest.mark.parametrize(
    ("kind", "hooks"),
    [("packed", False), ("packed", True), ("flat", True), ("multi", True)],
    ids=["packed-no-hooks", "packed-hooks", "flat-hooks", "multi-hooks"],
)
def test_load_interrupted_at_every_line(kind: str, hooks: bool, gc_setting: None) -> None:
    """An interrupted load leaves the target unchanged or fully loaded; the next load succeeds.

    ``multi``: two leaves, committed one after the other, so an interrupt between the commits
    must roll the first back. (The collector-disabled case is swept by the save test: the pause
    is the same code.)
    """
    build = make_multi if kind == "multi" else make
    fmt = "flat" if kind == "flat" else "packed"
    source_model, source = build(1)
    model, target = build(2)
    sd = sc.sparse_state_dict(source_model, source, format=fmt)
    if hooks:
        add_hooks(target)
    originals = [(opt, opt.state, opt.param_groups) for _name, opt in named_leaves(target)]
    unchanged = fingerprint(target)

    def restore() -> None:
        for opt, state, groups in originals:
            opt.state, opt.param_groups = state, groups

    def load() -> None:
        sc.load_sparse_state_dict(model, target, sd)

    load()
    loaded = fingerprint(target)
    assert loaded != unchanged
    restore()
    gc.enable()

    def check(where: str, at: int) -> None:
        assert_nothing_held(True, where)
        assert fingerprint(target) in (unchanged, loaded), f"an interrupt at {where} left the optimizer partly loaded"
        follow_up(load, at)
        assert_nothing_held(True, where)
        assert fingerprint(target) == loaded, f"the load after an interrupt at {where}"

    sweep(load, check, restore)


SIGALRM_MIN_TRIALS = 100
"""Interrupts :func:`test_real_sigalrm_interrupts` needs in all, and (``SIGALRM_MIN_INSIDE``) inside saves and
inside loads each: it runs until it has them (or the time cap), however slow or loaded the machine."""
SIGALRM_MIN_INSIDE = 30
SIGALRM_TIME_CAP_S = 120.0


class _Landings:
    """A SIGALRM handler raising KeyboardInterrupt that counts where it landed: inside a save, inside a
    load (``call`` names the call in progress) or between calls."""

    def __init__(self) -> None:
        self.call: str | None = None
        self.counts = {"save": 0, "load": 0, "between": 0}

    def __call__(self, _signum: int, _frame: Any) -> None:
        self.counts[self.call or "between"] += 1
        self.call = None
        raise KeyboardInterrupt

    def total(self) -> int:
        return sum(self.counts.values())


def test_real_sigalrm_interrupts(gc_setting: None) -> None:
    """A one-shot SIGALRM raising KeyboardInterrupt at random points of repeated saves and of loads.

    A save trial repeats saves until the signal lands (inside one, or in the loop between two);
    a load trial resets the target, loads once and spins until it lands. After every interrupt
    that landed: the GC is enabled, no pause or lock is left, a loaded target is unchanged or fully
    loaded, and a save of the same optimizer succeeds and is exact. Trials go on until at least
    ``SIGALRM_MIN_TRIALS`` interrupts landed, ``SIGALRM_MIN_INSIDE`` of them inside saves and as many
    inside loads (a count of samples, not of time: a slow or loaded machine just takes longer).
    """
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        pytest.skip("needs signal.setitimer in the main thread")
    gc.enable()
    model, opt = make(3)
    add_hooks(opt)
    reference = sc.sparse_state_dict(model, opt)
    target_model, target = make(4)
    add_hooks(target)
    original = (target.state, target.param_groups)
    unchanged = fingerprint(target)
    sc.load_sparse_state_dict(target_model, target, reference)
    loaded = fingerprint(target)
    rng = random.Random(0)
    t0 = time.perf_counter()
    for _ in range(20):
        sc.load_sparse_state_dict(target_model, target, reference)
    per_call = (time.perf_counter() - t0) / 20
    landings = _Landings()
    previous = signal.signal(signal.SIGALRM, landings)
    trials = broken = 0
    t0 = time.perf_counter()

    def enough() -> bool:
        c = landings.counts
        return trials >= SIGALRM_MIN_TRIALS and min(c["save"], c["load"]) >= SIGALRM_MIN_INSIDE

    try:
        while not enough() and time.perf_counter() - t0 < SIGALRM_TIME_CAP_S:
            trials += 1
            loading = trials % 2 == 0
            if loading:
                target.state, target.param_groups = original
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.5 * per_call))
                if loading:
                    landings.call = "load"
                    sc.load_sparse_state_dict(target_model, target, reference)
                    landings.call = None
                while True:
                    if not loading:
                        landings.call = "save"
                        sc.sparse_state_dict(model, opt)
                        landings.call = None
            except KeyboardInterrupt:
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                landings.call = None
            ok = gc.isenabled() and _gc.pauses_in_progress() == 0
            try:
                assert_nothing_held(True, "a random point")
            except AssertionError:
                ok = False
            if loading:
                ok = ok and fingerprint(target) in (unchanged, loaded)
            if ok:
                try:
                    assert_deep_equal(sc.sparse_state_dict(model, opt), reference)
                except sc.ReentrantSerializationError:
                    ok = False
            if not ok:
                broken += 1
                gc.enable()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - t0
    assert landings.total() == trials, f"{trials} trials, but {landings.counts} interrupts landed"
    assert enough(), (
        f"only {trials} interrupts landed in {elapsed:.0f} s ({landings.counts}); the test needs "
        f"{SIGALRM_MIN_TRIALS}, {SIGALRM_MIN_INSIDE} inside saves and inside loads each"
    )
    assert broken == 0, f"{broken} of {trials} interrupts ({landings.counts}) left something broken"


def test_interrupted_pause_never_ends_another_threads_pause(gc_setting: None) -> None:
    """Pauses are tokens, not a shared count: an interrupted save in this thread, at any line,
    never re-enables the collector while another thread's pause is in progress."""
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with _gc.gc_paused():
            inside.set()
            assert leave.wait(JOIN_TIMEOUT)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    assert inside.wait(JOIN_TIMEOUT)
    model, opt = make(5)

    def check(where: str, _at: int) -> None:
        leaked = free_leaked_locks()
        assert not leaked, f"interrupt at {where}: {', '.join(leaked)} left held"
        assert not gc.isenabled(), f"an interrupt at {where} ended the other thread's pause"
        assert _gc.pauses_in_progress() == 1, where

    try:
        sweep(lambda: sc.sparse_state_dict(model, opt), check)
    finally:
        leave.set()
        thread.join(JOIN_TIMEOUT)
    assert gc.isenabled() and _gc.pauses_in_progress() == 0


def test_sweep_events_sample_is_seeded_and_keeps_the_ends() -> None:
    """The default sample: the first and last events, `SAMPLE_RATE` of the rest, the same for a seed."""
    if EXHAUSTIVE:
        assert sweep_events(100, "x") == list(range(1, 101))
        return
    events = sweep_events(1002, "x")
    assert events[0] == 1 and events[-1] == 1002 and events == sorted(set(events))
    assert len(events) == 2 + round(1000 * SAMPLE_RATE)
    assert events == sweep_events(1002, "x") and events != sweep_events(1002, "y")
