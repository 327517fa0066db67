"""Run a function on N ranks in fresh processes, never forked from the caller (the drill's launcher).

:func:`run_ranks` starts ``world_size`` processes, initialises a process group in each (Gloo on
CPU, NCCL on CUDA, HCCL on NPU: :mod:`.devices`), calls ``fn(rank, world_size, *args)`` and
raises with every failing rank's traceback. :func:`run_killed` does the same in process groups of
their own and SIGKILLs them once marker files exist (the drill's kill mid-save).

Ranks start through a fork server (POSIX) or by ``spawn`` (:func:`rank_start_method`), never by
``fork``: a fork of a process that has touched CUDA cannot use CUDA ("Cannot re-initialize CUDA in
forked subprocess"), so forked ranks crash on a GPU machine even for a Gloo/CPU run. The fork
server is a fresh interpreter that imports torch and sparse_ckpt once (:data:`PRELOAD`) and never
touches a device; each rank is forked from it (~2 s for the first group, ~0.1 s for later ones, on
2 cores; ``spawn`` pays ~3 s per group, every rank importing torch). A rank gets nothing from the
caller but its arguments: the caller's core backend (``sparse_ckpt.backend()``) and the device are
passed explicitly (the fork server's environment is the one it started with).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import sparse_ckpt as sc

from ..suite.devices import bind_rank, process_group_backend

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch._dynamo",
    "sparse_ckpt",
]
"""Modules the fork server imports once, so that the ranks forked from it need not (``torch._dynamo``:
~1.4 s on 2 cores, imported lazily by FSDP2's first backward). Importing them touches no device."""


def rank_start_method() -> str:
    """``"forkserver"`` where the platform has it (its server preloading :data:`PRELOAD`), else ``"spawn"``.

    Multi-process helpers (this module, ``tests/_dist.py``) start ranks with it; ``fork`` is never used.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        return "forkserver"
    return "spawn"


def use_core(name: str) -> None:
    """Make this process use core backend ``name`` (``"python"`` or ``"cpp"``), as the caller did."""
    from sparse_ckpt import _backend

    _backend.core = importlib.import_module("sparse_ckpt._core_py" if name == "python" else "sparse_ckpt._C")
    _backend.NAME = name


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """What every rank of one run is told (it inherits nothing else from the caller)."""

    core: str
    """The caller's core backend, ``sparse_ckpt.backend()``."""
    device: str = "cpu"
    """``cpu`` (Gloo), ``cuda`` (NCCL, rank r on ``cuda:r``) or ``npu`` (HCCL, rank r on ``npu:r``)."""
    own_group: bool = False
    """Put the rank in a process group of its own (:func:`run_killed` SIGKILLs that group)."""


def _name(fn: Callable[..., Any]) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", repr(fn))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for ``MASTER_PORT`` and ``tcp://`` stores)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(worker: Callable[..., Any], nproc: int, args: Any, prefix: str) -> None:
    """Run ``worker(rank, nproc, port, args, out_dir)`` on ``nproc`` spawned processes (torch's
    ``start_processes``), with a free port and a temporary folder ``out_dir`` (named ``prefix...``,
    removed afterwards): how the trainer benches start their ranks."""
    import torch.multiprocessing as mp

    port = free_port()
    out_dir = tempfile.mkdtemp(prefix=prefix)
    try:
        mp.start_processes(worker, args=(nproc, port, args, out_dir), nprocs=nproc, start_method="spawn")
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _torchrun_env(rank: int, world_size: int, port: int) -> None:
    """The variables torchrun gives a rank, which trainers read (Accelerate's ``PartialState``, VeOmni's
    parallel state); the process group itself is set up through a file store, not through them."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )


def _rank_entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store: str,
    err_dir: str,
    setup: RankSetup,
    args: tuple[Any, ...],
    port: int = 0,
) -> None:
    code = 0
    try:
        _torchrun_env(rank, world_size, port)
        if setup.own_group:
            os.setpgid(0, 0)
        torch.set_num_threads(1)
        use_core(setup.core)
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        device = bind_rank(setup.device, rank)
        dist.init_process_group(
            process_group_backend(setup.device),
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
            **({} if device.type == "cpu" else {"device_id": device}),
        )
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report any failure (DCP's CheckpointException is a BaseException)
        Path(err_dir, f"error-rank{rank}.txt").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start_ranks(
    fn: Callable[..., Any], world_size: int, err_dir: str, setup: RankSetup, args: tuple[Any, ...]
) -> list[Any]:
    ctx = multiprocessing.get_context(rank_start_method())
    store = tempfile.mktemp(prefix="pgstore-", dir=err_dir)
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(fn, r, world_size, store, err_dir, setup, args, port))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def _rank_errors(err_dir: str) -> str:
    return "\n".join(p.read_text() for p in sorted(Path(err_dir).glob("error-rank*.txt")))


def _stop(procs: Sequence[Any], kill_groups: bool = False) -> None:
    """Terminate (or, with ``kill_groups``, SIGKILL the process group of) every rank still running; reap all."""
    for p in procs:
        if not p.is_alive():  # (checked first: the pid of a reaped rank may belong to another process)
            continue
        if kill_groups:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank's own group: the rank and anything it started
                continue
            except (ProcessLookupError, PermissionError):
                pass  # not (yet) a group leader: kill the rank alone
        (p.kill if kill_groups else p.terminate)()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    err_dir: str,
    timeout: float = 300.0,
    device: str = "cpu",
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks on ``device``; raise on any failure.

    ``fn`` and ``args`` must be picklable (module-level functions). A failing rank writes its
    traceback to ``err_dir``; the others are then terminated.
    """
    procs = _start_ranks(fn, world_size, err_dir, RankSetup(sc.backend(), device), args)
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    finally:
        _stop(procs)
    errors = _rank_errors(err_dir)
    if errors or any(p.exitcode != 0 for p in procs):
        codes = [p.exitcode for p in procs]
        late = f" (timed out after {timeout} s)" if time.monotonic() > deadline else ""
        raise RuntimeError(f"{world_size} ranks of {_name(fn)}: exit codes {codes}{late}\n{errors}")


def run_killed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    markers: Sequence[Path],
    err_dir: str,
    timeout: float = 300.0,
    device: str = "cpu",
) -> float:
    """Run ``fn`` like :func:`run_ranks`, each rank in a process group of its own; SIGKILL those groups
    once all ``markers`` exist.

    Returns the seconds from the start to the kill. Raises if a rank fails or ends before the markers.
    """
    t0 = time.monotonic()
    procs = _start_ranks(fn, world_size, err_dir, RankSetup(sc.backend(), device, own_group=True), args)
    try:
        while not all(m.exists() for m in markers):
            errors = _rank_errors(err_dir)
            if errors or not all(p.is_alive() for p in procs) or time.monotonic() - t0 > timeout:
                raise RuntimeError(
                    f"the run to kill ended or failed before stalling in its save (exit codes "
                    f"{[p.exitcode for p in procs]}, {time.monotonic() - t0:.1f} s)\n{errors}"
                )
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
    finally:
        _stop(procs, kill_groups=True)
    return elapsed


__all__ = ["PRELOAD", "RankSetup", "free_port", "rank_start_method", "run_killed", "run_ranks", "use_core"]
