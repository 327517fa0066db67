"""Run a function on N Gloo ranks in real processes (multi-rank tests).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (``fork`` where available:
no re-import of torch, so a 2-rank group starts in well under a second), initialises a Gloo
process group on a free port in each, calls ``fn(rank, world_size, *args)``, and always destroys
the process group. A worker's exception fails the parent test with the worker's traceback; the
other ranks are terminated. The core backend of the parent test (``SPARSE_CKPT_BACKEND``) is
used by the workers.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _select_backend(name: str | None) -> None:
    if not name:
        return
    import importlib

    from sparse_ckpt import _backend

    module = "sparse_ckpt._core_py" if name == "python" else "sparse_ckpt._C"
    _backend.core = importlib.import_module(module)
    _backend.NAME = name


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str | None, args: tuple[Any, ...]
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    _select_backend(backend)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; re-raise a worker's failure."""
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    backend = os.environ.get("SPARSE_CKPT_BACKEND")
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), backend, args),
        nprocs=world_size,
        join=False,
        start_method=method,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(5)
            if p.is_alive():
                p.kill()


__all__ = ["free_port", "run_ranks"]
