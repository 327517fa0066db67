"""Process-group questions, answered in one place: is there a default process group, this rank,
its world size, and whether a given group is the default one; and `agree_on_refusal`, the one
exchange that makes a load's refusal on one rank a refusal on every rank."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ._process_group import initialised, is_default_group

__all__ = [
    "AGREEMENT_WAIT_ENV",
    "agree_on_refusal",
    "agreement_wait_s",
    "initialised",
    "is_default_group",
    "multi_rank",
    "world_and_rank",
]


def world_and_rank() -> tuple[int, int]:
    """``(world size, rank)`` in the default process group; ``(1, 0)`` without one."""
    if not initialised():
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def multi_rank() -> bool:
    """Whether this process is one rank of an initialised default process group of several ranks."""
    return world_and_rank()[0] > 1


_SUMMARY_CHARS = 2000
"""How much of a refusing rank's message travels to the other ranks."""


AGREEMENT_WAIT_ENV = "SPARSE_CKPT_AGREEMENT_WAIT_S"
"""Environment variable: how long (seconds) a bounded agreement waits for the other ranks to reach it."""
_AGREEMENT_WAIT_DEFAULT_S = 30.0


def agreement_wait_s() -> float:
    """The bound of a bounded agreement (`agree_on_refusal` ``within``): ``$SPARSE_CKPT_AGREEMENT_WAIT_S``
    seconds, 30 without it. A `sparse_ckpt.errors.SparseCheckpointError` names a value that is not a
    positive number."""
    raw = os.environ.get(AGREEMENT_WAIT_ENV)
    if raw is None or raw == "":
        return _AGREEMENT_WAIT_DEFAULT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):  # (NaN compares False)
        from .errors import SparseCheckpointError

        raise SparseCheckpointError(f"{AGREEMENT_WAIT_ENV}={raw!r}: expected a positive number of seconds")
    return value


_rounds: dict[int, int] = {}
"""Bounded agreements this process completed, per default process group (by ``id``): the next one's number."""
_PREFIX = "sparse_ckpt/agreement"


def agree_on_refusal(error: BaseException | None, what: str, *, within: float | None = None) -> None:
    """Every rank of the default process group calls this at the same decision point of a load,
    before anything is mutated, with the error it met (``None``: it would go on). If any rank refused,
    every rank raises: the refusing rank its own ``error`` (its message naming the other refusing
    ranks, if any), the others a `sparse_ckpt.errors.SparseCheckpointError` of the first refusing
    rank's class naming the refusing rank(s) and their messages. So no rank goes on alone (and hangs
    or crashes in the next collective). ``what`` names the load (``"set_optimizer_state_dict"``).
    Without a process group of several ranks it only re-raises ``error``.

    ``within=None`` (a load every rank is inside by construction: ``dcp.load``): one
    ``all_gather_object`` of a short summary. ``within=seconds`` (a call stock torch makes on one rank
    without waiting on the others: DSD's ``set_optimizer_state_dict``): the summaries travel through the
    default group's store, and a rank waits at most ``within`` seconds for the others to reach this
    point; if one does not, this rank alone refuses (`sparse_ckpt.errors.CheckpointMismatchError`
    naming the rule and the ranks that did not come), leaving no trace the next agreement could read
    and the process group as it was."""
    if not multi_rank():
        if error is not None:
            raise error
        return
    from . import errors

    world, rank = world_and_rank()
    mine = None if error is None else (type(error).__name__, str(error)[:_SUMMARY_CHARS])
    if within is None:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
    else:
        gathered = _exchange_in_store(mine, what, within, world, rank, error)
    refused = [(r, s) for r, s in enumerate(gathered) if s is not None]
    if not refused:
        return
    names = ", ".join(str(r) for r, _s in refused)
    if error is not None:
        if isinstance(error, errors.SparseCheckpointError):
            error.args = (
                f"{what} refused on rank(s) {names} of {world} (this rank, {rank}, among them): {error}",
                *error.args[1:],
            )
        raise error
    first_cls = getattr(errors, refused[0][1][0], None)
    cls = (
        first_cls
        if isinstance(first_cls, type) and issubclass(first_cls, errors.SparseCheckpointError)
        else (errors.CheckpointMismatchError)
    )
    detail = "; ".join(f"rank {r}: {name}: {msg}" for r, (name, msg) in refused)
    raise cls(
        f"{what} refused on rank(s) {names} of {world}, so no rank loads anything (this rank, {rank}, had "
        f"nothing to refuse; its optimizer is as it was): {detail}"
    )


def _exchange_in_store(
    mine: tuple[str, str] | None, what: str, within: float, world: int, rank: int, error: BaseException | None
) -> list[Any]:
    """`agree_on_refusal`'s bounded exchange: each rank sets its summary, then its arrival, under the
    agreement's number in the default group's store, and reads the others' once all have arrived.
    A rank that times out deletes its keys and keeps the number (the ranks that never came use it next
    time); a completed agreement deletes this rank's keys of the one before the last (every rank has
    read those: it reached the last one)."""
    from . import errors
    from ._torch_internals import default_store

    store = default_store()
    group = id(dist.group.WORLD)
    n = _rounds.get(group, 0)
    key = f"{_PREFIX}/{n}"
    store.set(f"{key}/verdict/{rank}", json.dumps(mine))
    store.set(f"{key}/arrived/{rank}", "1")
    others = [r for r in range(world) if r != rank]
    deadline = time.monotonic() + within
    missing = others
    while missing:
        left = deadline - time.monotonic()
        try:
            store.wait([f"{key}/arrived/{r}" for r in missing], timedelta(seconds=max(left, 0.001)))
            missing = []
        except RuntimeError:  # the store's timeout (DistStoreError, a RuntimeError)
            missing = [r for r in missing if not store.check([f"{key}/arrived/{r}"])]
            if missing and time.monotonic() >= deadline:
                for part in ("arrived", "verdict"):
                    store.delete_key(f"{key}/{part}/{rank}")
                absent = ", ".join(map(str, missing))
                mine_too = f" (this rank's own: {type(error).__name__}: {error})" if error is not None else ""
                raise errors.CheckpointMismatchError(
                    f"{what} refused on rank {rank} of {world}: rank(s) {absent} did not reach its agreement within "
                    f"{within:g} s, so nothing was loaded{mine_too}. Under sparse_ckpt, {what} in a process group "
                    f"of several ranks is a collective: every rank of the default process group calls it (each with "
                    f"its own dict), and the ranks agree on a refusal before any optimizer is changed; call it on "
                    f"every rank (a rank that is slower to get there than {within:g} s: set {AGREEMENT_WAIT_ENV})"
                ) from error
    gathered = [mine if r == rank else json.loads(store.get(f"{key}/verdict/{r}")) for r in range(world)]
    _rounds[group] = n + 1
    if n >= 2:
        for part in ("arrived", "verdict"):
            store.delete_key(f"{_PREFIX}/{n - 2}/{part}/{rank}")
    return [tuple(s) if s is not None else None for s in gathered]
