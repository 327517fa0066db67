"""Concurrency: the reentrancy guard is per optimizer and thread-safe.

* Two threads serializing two *different* optimizers at the same time both succeed (a post-hook
  waiting on a ``threading.Barrier`` forces them to overlap inside the guard).
* The *same* optimizer from two threads: each call either returns exactly the sequential result
  or raises :class:`ReentrantSerializationError` -- never a torn result; the guard is released.
* Serializing a different optimizer from inside a hook is allowed (the guard is not global).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_deep_equal, deep_equal
from torch import nn

import sparse_ckpt as sc

TIMEOUT = 20.0
# The strictest deep_equal: NaN equals nothing (as in torch.equal), a dict equals only a dict.
EXACT: dict[str, Any] = {"nan_equal": "none", "mapping": dict}


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stepped model/optimizer pair; different seeds give different state."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.003 * (seed + 1)}], lr=0.01
    )
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    return model, opt


def run_threads(targets: list[Callable[[], Any]]) -> list[tuple[str, Any]]:
    """Run each target in its own thread; ``[("ok", result) | ("error", exc)]`` in order."""
    results: list[tuple[str, Any]] = [("missing", None)] * len(targets)

    def runner(i: int, fn: Callable[[], Any]) -> None:
        try:
            results[i] = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            results[i] = ("error", exc)

    threads = [threading.Thread(target=runner, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a serializing thread hung"
    return results


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_two_optimizers_in_parallel(fmt: str) -> None:
    """Both threads are inside capture at once (the barrier proves it) and both succeed."""
    (m1, o1), (m2, o2) = make(1), make(2)
    ref1, ref2 = sc.sparse_state_dict(m1, o1, format=fmt), sc.sparse_state_dict(m2, o2, format=fmt)
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    inside: list[str] = []

    def meet(name: str) -> Callable[[Any, dict], None]:
        def hook(_opt: Any, _sd: dict) -> None:
            inside.append(name)
            barrier.wait()  # BrokenBarrierError if the other thread cannot enter concurrently

        return hook

    o1.register_state_dict_post_hook(meet("o1"))
    o2.register_state_dict_post_hook(meet("o2"))
    results = run_threads(
        [lambda: sc.sparse_state_dict(m1, o1, format=fmt), lambda: sc.sparse_state_dict(m2, o2, format=fmt)]
    )
    assert [status for status, _ in results] == ["ok", "ok"], results
    assert sorted(inside) == ["o1", "o2"]
    assert_deep_equal(results[0][1], ref1, "thread 1", **EXACT)
    assert_deep_equal(results[1][1], ref2, "thread 2", **EXACT)
    assert not deep_equal(ref1, ref2, **EXACT)


def test_same_optimizer_from_two_threads_forced_overlap() -> None:
    """While thread A is inside the capture, thread B gets ReentrantSerializationError; A's result is exact."""
    model, opt = make(3)
    reference = sc.sparse_state_dict(model, opt)
    entered, release = threading.Event(), threading.Event()
    calls = [0]

    def hold(_opt: Any, _sd: dict) -> None:
        calls[0] += 1
        entered.set()
        assert release.wait(TIMEOUT)

    handle = opt.register_state_dict_post_hook(hold)
    results: list[tuple[str, Any]] = []

    def first() -> Any:
        return sc.sparse_state_dict(model, opt)

    def second() -> Any:
        assert entered.wait(TIMEOUT)
        try:
            return sc.sparse_state_dict(model, opt)
        finally:
            release.set()

    results = run_threads([first, second])
    assert results[0][0] == "ok", results[0]
    assert_deep_equal(results[0][1], reference, "first thread", **EXACT)
    status, err = results[1]
    assert status == "error" and isinstance(err, sc.ReentrantSerializationError), results[1]
    assert "'optim'" in str(err) and "AdamW" in str(err)
    assert calls[0] == 1  # the refused call ran no hook
    handle.remove()
    assert_deep_equal(sc.sparse_state_dict(model, opt), reference, "guard released", **EXACT)


def test_same_optimizer_hammered() -> None:
    """Many threads, many calls, no forced order: each result is exact or a clean refusal."""
    model, opt = make(4)
    reference = sc.sparse_state_dict(model, opt)
    reference_flat = sc.sparse_state_dict(model, opt, format="flat")
    switch = threading.Event()

    def maybe_yield(_opt: Any, _sd: dict) -> None:
        switch.wait(0.0005)  # releases the GIL inside the guard, inviting overlap

    opt.register_state_dict_post_hook(maybe_yield)
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(fmt: str) -> None:
        for _ in range(25):
            try:
                out = sc.sparse_state_dict(model, opt, format=fmt)
            except sc.ReentrantSerializationError:
                with lock:
                    outcomes.append("refused")
                continue
            expected = reference if fmt == "packed" else reference_flat
            with lock:
                outcomes.append("ok" if deep_equal(out, expected, **EXACT) else "TORN")

    results = run_threads([lambda f=fmt: worker(f) for fmt in ("packed", "flat", "packed", "flat")])
    assert all(status == "ok" for status, _ in results), results
    assert "TORN" not in outcomes
    assert outcomes.count("ok") > 0 and len(outcomes) == 100
    assert_deep_equal(sc.sparse_state_dict(model, opt), reference, "after the threads", **EXACT)


def test_hook_may_serialize_another_optimizer() -> None:
    """The guard is per optimizer: a hook of leaf A may serialize optimizer B, but not A itself."""
    (m1, o1), (m2, o2) = make(5), make(6)
    ref2 = sc.sparse_state_dict(m2, o2)
    nested: list[dict] = []
    o1.register_state_dict_post_hook(lambda _o, _sd: nested.append(sc.sparse_state_dict(m2, o2)))
    sc.sparse_state_dict(m1, o1)
    assert len(nested) == 1
    assert_deep_equal(nested[0], ref2, "nested", **EXACT)

    o2.register_state_dict_pre_hook(lambda _o: sc.sparse_state_dict(m2, o2))
    with pytest.raises(sc.ReentrantSerializationError):
        sc.sparse_state_dict(m2, o2)
    with pytest.raises(sc.ReentrantSerializationError):  # still refused, and o1's hook propagates it
        sc.sparse_state_dict(m1, o1)


def test_guard_released_after_error_in_other_thread() -> None:
    """A hook failing in one thread releases that optimizer's guard; other threads are unaffected."""
    (m1, o1), (m2, o2) = make(7), make(8)
    ref1, ref2 = sc.sparse_state_dict(m1, o1), sc.sparse_state_dict(m2, o2)
    armed = [True]

    def fail_once(_opt: Any, _sd: dict) -> None:
        if armed[0]:
            armed[0] = False
            raise RuntimeError("hook failed")

    o1.register_state_dict_post_hook(fail_once)
    results = run_threads([lambda: sc.sparse_state_dict(m1, o1), lambda: sc.sparse_state_dict(m2, o2)])
    assert results[0][0] == "error" and isinstance(results[0][1], RuntimeError)
    assert results[1][0] == "ok", results[1]
    assert_deep_equal(results[1][1], ref2, "other thread", **EXACT)
    results = run_threads([lambda: sc.sparse_state_dict(m1, o1)])
    assert results[0][0] == "ok", results[0]
    assert_deep_equal(results[0][1], ref1, "retry", **EXACT)


def test_parallel_loads_into_different_optimizers() -> None:
    """Loads into two optimizers from two threads do not interfere."""
    (m1, o1), (m2, o2) = make(9), make(10)
    sd1, sd2 = sc.sparse_state_dict(m1, o1), sc.sparse_state_dict(m2, o2)
    (t1m, t1), (t2m, t2) = make(11), make(12)
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    def meet(_opt: Any, _sd: dict) -> None:
        barrier.wait()  # both loads are in progress at once

    t1.register_load_state_dict_pre_hook(meet)
    t2.register_load_state_dict_pre_hook(meet)
    results = run_threads(
        [lambda: sc.load_sparse_state_dict(t1m, t1, sd1), lambda: sc.load_sparse_state_dict(t2m, t2, sd2)]
    )
    assert [s for s, _ in results] == ["ok", "ok"], results
    assert_deep_equal(sc.sparse_state_dict(t1m, t1), sd1, "target 1", **EXACT)
    assert_deep_equal(sc.sparse_state_dict(t2m, t2), sd2, "target 2", **EXACT)
