"""`sparse_ckpt._save.worker.CaptureWorker`: a job the worker has not begun when its result is needed
runs on the calling thread; one it has begun is waited for; errors reach the caller."""

from __future__ import annotations

import threading

import pytest
import torch

from sparse_ckpt._host_memory import HostPool
from sparse_ckpt._save import worker as worker_module
from sparse_ckpt._save.worker import CaptureWorker


def test_a_job_not_begun_runs_on_the_caller() -> None:
    """While the worker is held by a first job, the result of a second is computed by the caller (its
    thread); the first one's, begun, is waited for (the worker's thread)."""
    started, release = threading.Event(), threading.Event()

    def hold() -> int:
        started.set()
        release.wait(timeout=60)
        return threading.get_ident()

    worker = CaptureWorker()
    try:
        first = worker.submit(hold)
        second = worker.submit(threading.get_ident)
        assert started.wait(timeout=60)
        assert worker._result(second) == threading.get_ident()
        release.set()
        assert worker._result(first) != threading.get_ident()
    finally:
        release.set()
        worker.close()


def test_crcs_raise_the_error_of_a_part() -> None:
    def fails() -> int:
        raise ValueError("a part failed")

    worker = CaptureWorker()
    try:
        worker.add_crc(0, worker.submit(fails), 1)
        with pytest.raises(ValueError, match="a part failed"):
            worker.crcs(1)
    finally:
        worker.close()


def test_copies_are_shared_between_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CaptureWorker.stage` queues a copy per large tensor; `copies` makes those the worker has not begun
    (here: all but none, the worker being held) and returns every ``(original, copy)``."""
    monkeypatch.setattr(worker_module, "STAGER_DEEP_COPIES", True)
    release = threading.Event()
    pool = HostPool()
    tensors = {f"t{i}": torch.randn(64 << 10) for i in range(4)}
    worker = CaptureWorker()
    try:
        worker.submit(release.wait, 60)
        worker.stage(pool, {**tensors, "small": torch.randn(4)})
        copies = worker.copies()
    finally:
        release.set()
        worker.close()
    assert sorted(id(o) for o, _c in copies) == sorted(id(t) for t in tensors.values())
    assert all(torch.equal(o, c) and o.data_ptr() != c.data_ptr() for o, c in copies)
    assert pool.allocated == 4


def test_a_small_capture_starts_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buckets under ``SPLIT_BYTES`` (here a small model's, copied ones and a lone live chunk) are filled
    and checksummed on the capture's thread: no job is submitted, so no worker thread starts; the same
    capture with ``SPLIT_BYTES`` lowered submits some."""
    import sparse_ckpt as sc
    from sparse_ckpt._layouts import bucketed

    submitted: list[object] = []
    submit = CaptureWorker.submit

    def counting(self: CaptureWorker, fn: object, *args: object) -> object:
        submitted.append(fn)
        return submit(self, fn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CaptureWorker, "submit", counting)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4, bias=False))
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    small = sc.sparse_state_dict(model, opt, state_layout="buffers")
    assert submitted == []
    monkeypatch.setattr(bucketed, "SPLIT_BYTES", 1)
    split = sc.sparse_state_dict(model, opt, state_layout="buffers")
    assert submitted
    assert small.keys() == split.keys()
    assert all(torch.equal(v, split[k]) if isinstance(v, torch.Tensor) else v == split[k] for k, v in small.items())


def test_close_drops_the_jobs_not_begun() -> None:
    """A capture that failed (or took its results) closes its worker: the job running finishes, the ones
    not begun never run, and no thread is left."""
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold() -> None:
        started.set()
        release.wait(timeout=60)
        ran.append("first")

    worker = CaptureWorker()
    worker.submit(hold)
    worker.submit(ran.append, "second")
    assert started.wait(timeout=60)
    timer = threading.Timer(0.1, release.set)
    timer.start()
    worker.close()
    timer.join()
    assert ran == ["first"]
    assert not [t for t in threading.enumerate() if t.name.startswith("sparse_ckpt-capture")]


def test_help_makes_the_copies_not_begun_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the worker is held by an earlier job, `CaptureWorker.help` makes every staged copy on the
    calling thread; `copies` then returns them all (exact, in the same order as without help), and a copy
    that failed in `help` raises from `copies`."""
    monkeypatch.setattr(worker_module, "STAGER_DEEP_COPIES", True)
    started, release = threading.Event(), threading.Event()
    pool = HostPool()
    tensors = {f"t{i}": torch.randn(64 << 10) for i in range(3)}
    worker = CaptureWorker()
    try:
        worker.submit(lambda: (started.set(), release.wait(timeout=60)))
        assert started.wait(timeout=60)
        made_on: list[int] = []
        snapshot = pool.snapshot
        monkeypatch.setattr(pool, "snapshot", lambda v: (made_on.append(threading.get_ident()), snapshot(v))[1])
        worker.stage(pool, tensors)
        worker.help()
        assert made_on == [threading.get_ident()] * 3
        release.set()
        pairs = worker.copies()
        assert [id(original) for original, _copy in reversed(pairs)] == [id(t) for t in tensors.values()]
        assert all(torch.equal(original, copy) and copy is not original for original, copy in pairs)
    finally:
        release.set()
        worker.close()

    worker = CaptureWorker()
    release.clear()
    try:
        worker.submit(lambda: release.wait(timeout=60))
        monkeypatch.setattr(pool, "snapshot", lambda v: (_ for _ in ()).throw(OSError("no memory")))
        worker.stage(pool, tensors)
        worker.help()
        release.set()
        with pytest.raises(OSError, match="no memory"):
            worker.copies()
    finally:
        release.set()
        worker.close()
