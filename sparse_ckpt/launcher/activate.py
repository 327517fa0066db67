"""What a process started by ``sparse-ckpt-run`` does when a trigger module was imported.

`activate` is called by the import hook (``_sitecustomize/_sparse_ckpt_run.py``) with the selected
integrations whose trigger modules the process has just imported (torch is imported by then). For each,
in order: import ``sparse_ckpt.integrations.<name>`` (an integration module this sparse_ckpt does not
have is skipped: ``absent``) and call its ``install()``. Then one line says what was routed.

- An ``install()`` that raises (``RuntimeError`` when it refuses this torch's or this trainer's
  internals, or anything else) leaves that integration out: the process runs stock for it, with one
  WARNING naming the integration, the error and how to get a hard failure instead. With
  ``SPARSE_CKPT_RUN_STRICT=1`` (``sparse-ckpt-run --strict``) it raises `LauncherError` instead, from the
  import that triggered it, so the process fails before training.
- The line: INFO on the ``sparse_ckpt.launcher`` logger when logging is configured to show it.
  When it is not (no handler, or the level hides INFO: the usual state of a torchrun worker when
  torch is imported), the line is written to stderr directly, so it is never lost; with
  ``SPARSE_CKPT_RUN_LOG=logging`` it only goes through logging. Warnings are handled the same way.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import LauncherError
from ._sitecustomize._sparse_ckpt_run import INTEGRATIONS

__all__ = ["LauncherError", "activate", "describe_process"]

logger = logging.getLogger("sparse_ckpt.launcher")


def describe_process() -> str:
    """``rank R, pid P`` (the rank of torchrun's ``RANK`` when it is set)."""
    rank = os.environ.get("RANK")
    return f"rank {rank}, pid {os.getpid()}" if rank is not None else f"pid {os.getpid()}"


def activate(names: Sequence[str], *, problems: Sequence[str] = (), strict: bool = False) -> list[dict[str, Any]]:
    """Install the integrations ``names`` (keys of the hook's table) in this process; one outcome dict
    each (``integration``, ``status``: ``routed``/``absent``/``refused``/``failed``, ``detail``).

    ``problems`` (an unknown or conflicting name in ``SPARSE_CKPT_INTEGRATIONS``) are reported as a
    warning, or raised as `LauncherError` when ``strict``; so is a failed ``install()``.
    """
    outcomes = []
    for problem in problems:
        _fail(problem, strict)
    for name in names:
        integration = INTEGRATIONS[name]
        try:
            getattr(importlib.import_module(integration.module), integration.function)()
        except ModuleNotFoundError as exc:
            if exc.name == integration.module:  # this sparse_ckpt has no such integration: nothing to route
                outcomes.append(_outcome(name, "absent", f"{integration.module} is not part of this sparse_ckpt"))
            else:
                outcomes.append(_failed(name, exc, strict))
            continue
        except Exception as exc:  # noqa: BLE001 - any failure leaves the process stock, with a warning (or strict: an error)
            outcomes.append(_failed(name, exc, strict))
            continue
        outcomes.append(_outcome(name, "routed", f"{integration.routes} -> {integration.module}"))
    routed = [o["detail"] for o in outcomes if o["status"] == "routed"]
    if routed:
        _say(logging.INFO, f"sparse-ckpt-run ({describe_process()}): routed {'; '.join(routed)}")
    return outcomes


def _outcome(name: str, status: str, detail: str) -> dict[str, Any]:
    return {"integration": name, "status": status, "detail": detail}


def _failed(name: str, exc: Exception, strict: bool) -> dict[str, Any]:
    refused = isinstance(exc, RuntimeError)
    what = "refused this process's packages" if refused else "failed"
    message = (
        f"sparse-ckpt-run ({describe_process()}): {INTEGRATIONS[name].module}.install() {what} "
        f"({type(exc).__name__}: {exc})"
    )
    if strict:
        raise LauncherError(f"{message}; SPARSE_CKPT_RUN_STRICT=1 asks for this process to stop") from exc
    message += (
        f"; this process runs STOCK for {name}: {INTEGRATIONS[name].routes} is not routed through sparse_ckpt "
        "(SPARSE_CKPT_RUN_STRICT=1, or sparse-ckpt-run --strict, makes this an error)"
    )
    _say(logging.WARNING, message)
    return _outcome(name, "refused" if refused else "failed", message)


def _fail(message: str, strict: bool) -> None:
    if strict:
        raise LauncherError(f"sparse-ckpt-run: {message}")
    _say(logging.WARNING, f"sparse-ckpt-run ({describe_process()}): {message}")


def _say(level: int, message: str) -> None:
    """Through logging when a handler would show it; otherwise straight to stderr (see the module doc)."""
    if os.environ.get("SPARSE_CKPT_RUN_LOG", "auto").strip().lower() == "logging" or (
        logger.isEnabledFor(level) and logger.hasHandlers()
    ):
        logger.log(level, message)
        return
    sys.stderr.write(f"{logging.getLevelName(level)} {message}\n")
    sys.stderr.flush()
