"""The resume drill: train, checkpoint asynchronously, get SIGKILLed mid-save, resume exactly.

``python -m bench.resume --nproc 2`` (also ``--nproc 1`` / ``--nproc 4``, ``--steps``, ``--every``,
``--kill-at``, ``--resume-sizes``, ``--device cpu|cuda|npu``) trains the way users train and checks
what users rely on:

* **Model:** a small vision-language MoE (:class:`DrillModel`): a frozen vision tower, an adapter,
  token embeddings, MoE blocks and a head, ``fully_shard`` per block and at the root (FSDP2). The
  router of every block masks the last experts out (``route_mask``), so those experts never get a
  token, a gradient or optimizer state.
* **Optimizer:** ``sparse_ckpt.MultiOptimizer(model, {"experts": AdamW, "dense": AdamW, "vision":
  AdamW})`` with one LR scheduler per leaf. The vision tower is frozen (``requires_grad=False``: its
  leaf's ``step`` does nothing), but its scheduler moves its lr 0.01 -> 0.005 -> 0.0025.
* **Checkpoints:** every ``every`` steps ``dcp.async_save({"model": ModelState, "optim": mo,
  "sched": SchedulerState, "train": TrainState}, checkpoint_id=<run>/step-<n>)`` on a dedicated Gloo
  group (as torchtitan does: the save's collectives run in a background thread and must not
  interleave with FSDP's), waiting for the previous save first.
* **Kill:** the run is SIGKILLed (every rank's process group) while the save of
  step ``kill_at`` is in flight: :class:`StallingWriter` writes that checkpoint's data files, signals
  and stalls before DCP can write ``.metadata``.
* **Resume:** fresh processes at every size in ``resume_sizes`` load the last *complete* checkpoint
  (the newest ``step-*`` directory with ``.metadata``) with ``sparse_ckpt.SparseLoadPlanner`` and
  train on to ``steps``; parameters, optimizer state, lrs and scheduler states must equal an
  uninterrupted run bit for bit. Every rank gets the same batch, so FSDP's gradient averaging over a
  power-of-two number of identical values is exact and results do not depend on the world size.
* **Devices:** ``--device cpu`` (default): Gloo ranks on the CPU; ``cuda``: NCCL, rank r on ``cuda:r``
  (one rank per GPU, deterministic kernels); ``npu``: ``torch_npu``, HCCL. Ranks start from a fork
  server or by spawn (``.ranks``), never by fork, and ``fully_shard`` always gets an explicit mesh
  on the run's device, so a CPU run also works on a GPU machine.

:func:`run_drill` is what the CLI and ``tests/benchmark/test_resume_drill.py`` call; the pieces are importable
on their own (and from here): the model and its sizes in :mod:`.drill_model`, what every rank runs
(:func:`train_run`, the ``Stateful`` app state) in :mod:`.drill_rank`, the checks
(:func:`compare_snapshots`, ...) in :mod:`.drill_checks`, the rank launchers (:func:`run_ranks`,
:func:`run_killed`) in :mod:`.ranks`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import sparse_ckpt as sc

from ..suite.devices import DEVICES, DeviceUnavailable, check_device, check_world_sizes, device_count
from .drill_checks import check_checkpoint_keys, check_snapshot_sparsity, compare_snapshots
from .drill_model import DrillConfig, DrillModel, VisionDecay, build
from .drill_rank import (
    SNAPSHOT,
    STEP_DIR,
    TIMINGS,
    ModelState,
    SchedulerState,
    StallingWriter,
    TrainState,
    latest_complete,
    train_run,
)
from .ranks import run_killed, run_ranks

__all__ = [
    "DrillConfig",
    "DrillModel",
    "DrillResult",
    "ModelState",
    "SchedulerState",
    "StallingWriter",
    "TrainState",
    "VisionDecay",
    "build",
    "compare_snapshots",
    "default_resume_sizes",
    "latest_complete",
    "main",
    "run_drill",
    "run_killed",
    "run_ranks",
    "train_run",
]


# --------------------------------------------------------------------------- the drill


@dataclasses.dataclass
class DrillResult:
    """What :func:`run_drill` measured and checked."""

    cfg: DrillConfig
    nproc: int
    root: Path
    kill_step: int
    resumed_from: str
    reference: dict[str, Any]
    """``timings.json`` of the uninterrupted run."""
    killed_after_s: float
    incomplete: list[str]
    """Checkpoint directories of the killed run without ``.metadata``."""
    resumes: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """World size -> ``timings.json`` of that resume plus ``checks`` (a summary of what matched)."""


def run_drill(
    cfg: DrillConfig,
    nproc: int = 2,
    resume_sizes: Sequence[int] = (2, 1, 4),
    root: str | os.PathLike[str] | None = None,
    *,
    rank_fn: Callable[..., None] = train_run,
) -> DrillResult:
    """The whole drill under ``root`` (a new temp directory if ``None``); raises ``AssertionError`` on a mismatch.

    1. ``reference/``: an uninterrupted run at ``nproc`` ranks (saves included);
    2. ``killed/``: the same run, SIGKILLed while the save of ``cfg.kill_step()`` is in flight;
    3. ``resume-<n>/`` for every ``n`` in ``resume_sizes``: resume from ``killed/``'s newest complete
       checkpoint at ``n`` ranks and train to ``cfg.steps``; compare with the reference.

    Ranks run on ``cfg.device``. ``rank_fn``: what every rank runs, :func:`train_run` or a picklable
    function that calls it with the same arguments (a test may wrap it to add checks inside the ranks).
    """
    if dist.is_initialized():
        raise RuntimeError("run_drill starts its own process groups; call it outside one")
    base = Path(tempfile.mkdtemp(prefix="resume-drill-") if root is None else root)
    kill = cfg.kill_step()
    dirs = {name: base / name for name in ("reference", "killed", *(f"resume-{n}" for n in resume_sizes))}
    for d in dirs.values():
        (d / "ckpt").mkdir(parents=True, exist_ok=True)

    ref_dir = dirs["reference"]
    run_ranks(rank_fn, nproc, cfg, str(ref_dir / "ckpt"), str(ref_dir), err_dir=str(ref_dir), device=cfg.device)
    reference = json.loads((ref_dir / TIMINGS).read_text())
    ref_snap = torch.load(ref_dir / SNAPSHOT, weights_only=True)
    initial, _, _ = build(cfg)  # unsharded: the initial values of the parameters that must never move
    check_snapshot_sparsity(ref_snap, cfg, initial)
    for step in cfg.save_steps():
        check_checkpoint_keys(ref_dir / "ckpt" / f"step-{step}", cfg)

    kdir = dirs["killed"]
    markers = [kdir / f"stalled-{r}" for r in range(nproc)]
    killed_after = run_killed(
        rank_fn,
        nproc,
        cfg,
        str(kdir / "ckpt"),
        str(kdir),
        None,
        kill,
        markers=markers,
        err_dir=str(kdir),
        device=cfg.device,
    )
    ckpts = sorted((p for p in (kdir / "ckpt").iterdir() if STEP_DIR.match(p.name)), key=lambda p: int(p.name[5:]))
    incomplete = [p.name for p in ckpts if not (p / ".metadata").exists()]
    assert incomplete == [f"step-{kill}"], f"incomplete checkpoints {incomplete}, expected [step-{kill}]"
    assert any((kdir / "ckpt" / f"step-{kill}").glob("*.distcp")), "the killed save wrote no data files"
    found = latest_complete(kdir / "ckpt")
    expected_from = kill - cfg.every
    assert found is not None and found[0] == expected_from, f"latest complete {found}, expected step-{expected_from}"
    check_checkpoint_keys(found[1], cfg)

    result = DrillResult(cfg, nproc, base, kill, found[1].name, reference, killed_after, incomplete)
    for n in resume_sizes:
        rdir = dirs[f"resume-{n}"]
        run_ranks(
            rank_fn, n, cfg, str(rdir / "ckpt"), str(rdir), str(kdir / "ckpt"), err_dir=str(rdir), device=cfg.device
        )
        info = json.loads((rdir / TIMINGS).read_text())
        snap = torch.load(rdir / SNAPSHOT, weights_only=True)
        check_snapshot_sparsity(snap, cfg, initial)
        info["checks"] = compare_snapshots(ref_snap, snap, f"resume at world size {n}")
        for step in (s for s in cfg.save_steps() if s > expected_from):
            check_checkpoint_keys(rdir / "ckpt" / f"step-{step}", cfg)
        result.resumes[n] = info
    return result


# --------------------------------------------------------------------------- CLI


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


def format_saves(title: str, info: Mapping[str, Any]) -> list[str]:
    """One line per save: the checkpoint stall next to the mean step time."""
    lines = [f"{title} ({info['world_size']} rank(s) on {info.get('device', 'cpu')}, core {info['backend']})"]
    if "load_s" in info:
        lines.append(f"  load {info['resumed_from']}: {_ms(info['load_s'])}")
    for s in info["saves"]:
        stall = s["wait_prev_s"] + s["async_save_s"]
        lines.append(
            f"  save step {s['step']:>4}: stall {_ms(stall)} (wait for previous {_ms(s['wait_prev_s'])}, "
            f"async_save {_ms(s['async_save_s'])}) | mean step {_ms(s['mean_step_s'])} over {s['steps']} steps"
        )
    if "final_wait_s" in info:
        lines.append(f"  wait for the last save: {_ms(info['final_wait_s'])}")
    return lines


def _sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive world sizes expected")
    return sizes


def default_resume_sizes(nproc: int, devices: int | None) -> list[int]:
    """``nproc`` first, then those of 1, 2 and 4 that differ from it and that ``devices`` accelerators
    allow (one rank each; ``None``: the CPU, no limit)."""
    return [nproc, *(n for n in (1, 2, 4) if n != nproc and (devices is None or n <= devices))]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.resume``: run the drill, print stalls, step times and the resume checks."""
    parser = argparse.ArgumentParser(prog="python -m bench.resume", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="world size of the trained and killed runs (default 2)")
    parser.add_argument("--steps", type=int, default=DrillConfig.steps, help="total steps N+M (default %(default)s)")
    parser.add_argument("--every", type=int, default=DrillConfig.every, help="save every K steps (default %(default)s)")
    parser.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="the save step in flight when killed (default: the second to last save)",
    )
    parser.add_argument(
        "--resume-sizes",
        type=_sizes,
        default=None,
        help="world sizes to resume at (default 1,2,4 "
        "with --nproc first; on cuda/npu only those the devices present allow)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu: Gloo ranks (default); cuda: NCCL, one "
        "rank per GPU (--nproc and --resume-sizes at most the GPUs present); npu: torch_npu, HCCL",
    )
    parser.add_argument("--dim", type=int, default=DrillConfig.dim, help="model width (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=DrillConfig.hidden, help="expert width (default %(default)s)")
    parser.add_argument(
        "--experts", type=int, default=DrillConfig.n_experts, help="experts per block (default %(default)s)"
    )
    parser.add_argument(
        "--routed", type=int, default=DrillConfig.routed, help="experts that get tokens (default %(default)s)"
    )
    parser.add_argument("--blocks", type=int, default=DrillConfig.n_blocks, help="MoE blocks (default %(default)s)")
    parser.add_argument("--out", default=None, help="keep the run here (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be >= 1")
    cfg = DrillConfig(
        steps=args.steps,
        every=args.every,
        kill_at=args.kill_at,
        dim=args.dim,
        hidden=args.hidden,
        n_experts=args.experts,
        routed=min(args.routed, args.experts),
        n_blocks=args.blocks,
        device=args.device,
    )
    try:
        kill = cfg.kill_step()
    except ValueError as exc:
        parser.error(str(exc))
    try:
        check_device(args.device)
        present = device_count(args.device)
        sizes = args.resume_sizes or default_resume_sizes(args.nproc, present)
        check_world_sizes(args.device, [args.nproc, *sizes])
    except DeviceUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    where = args.device if present is None else f"{args.device} ({present} present)"
    print(
        f"resume drill: {args.nproc} rank(s) on {where}, {cfg.steps} steps, save every {cfg.every}, SIGKILL during "
        f"the save of step {kill}, resume at {','.join(map(str, sizes))}; core {sc.backend()}; "
        f"torch {torch.__version__}",
        flush=True,
    )
    root = args.out
    tmp = None
    if root is None:
        tmp = root = tempfile.mkdtemp(prefix="resume-drill-")
    elif Path(root).exists() and any(Path(root).iterdir()):
        parser.error(f"--out {root}: not empty")
    try:
        try:
            res = run_drill(cfg, args.nproc, sizes, root)
        except AssertionError as exc:
            print(f"RESUME CHECK FAILED: {exc}", flush=True)
            return 1
        for line in format_saves("uninterrupted run", res.reference):
            print(line)
        print(
            f"killed run: SIGKILL {res.killed_after_s:.2f} s after start, while saving step {res.kill_step}; "
            f"incomplete (no .metadata): {', '.join(res.incomplete)}; last complete: {res.resumed_from}"
        )
        for n, info in res.resumes.items():
            for line in format_saves(f"resume at {n} rank(s)", info):
                print(line)
            c = info["checks"]
            print(
                f"  checks: OK, bit-identical to the uninterrupted run at step {cfg.steps}: {c['params']} parameters, "
                f"optimizer state of {c['state_params']} parameters ({c['state_tensors']} tensors), lr and scheduler "
                f"state of 3 leaves; no state for {len(cfg.unrouted_prefixes())} unrouted experts or the vision "
                "leaf; no {} entries"
            )
        print("resume drill: PASS")
        return 0
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
